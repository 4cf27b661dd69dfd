// The step as a CUDA graph at its lowest level (trainer/step/step_graph.h): a capture replays its body on
// each new batch, and a capture that fails half way, by a C++ exception or by a CUDA call a capture cannot
// hold, gives back its memory pool and leaves the device, the generator and the next capture working.
// (StepInProcess.ACudaGraphRunGivesTheLossesAndWeightsOfTheEagerRun checks a whole run against the eager
// one; GraphPolicy, when a run captures.) The CUDA tests skip without a device, each saying why, and run
// in the GPU window's tests phase (scripts/gpu-check.sh, `*Cuda*`).
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <stdexcept>

#include "test_util.h"
#include "trainer/memory/backend.h"
#include "trainer/step/step_graph.h"

namespace test_step_graph {

constexpr int64_t kMiB = 1 << 20;

data::Batch batch_of(int64_t seed) {
  torch::manual_seed(seed);
  data::Batch b;
  b.images = torch::randint(0, 256, {8, 3, 16, 16}, torch::kUInt8);
  b.labels = torch::randint(0, 10, {8});
  b.indices.resize(8);
  return b;
}

// What the graph's body computes, eagerly: one value per sample from its pixels and label.
torch::Tensor body(const data::Batch& b) {
  return b.images.to(torch::kFloat).mul(0.5).sum({1, 2, 3}) + b.labels.to(torch::kFloat);
}

TEST(StepGraph, WithoutAGraphReplayIsRefused) {
  trainer::StepGraph g;
  EXPECT_FALSE(g.held());
  EXPECT_THROW(g.replay(batch_of(1)), std::logic_error);
}

#ifdef TRAINER_WITH_CUDA
const torch::Device kCuda(torch::kCUDA, 0);

// Captured on one batch, replayed on others: each replay's values are the eager body's on that batch.
TEST(StepGraphCuda, AReplayComputesTheBodyOnTheNewBatch) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: graphs are captured and replayed there";
  trainer::StepGraph g;
  const torch::Tensor values = g.capture(batch_of(1), kCuda, body);
  ASSERT_TRUE(g.held());
  for (int64_t seed : {2, 3, 1}) {
    const data::Batch b = batch_of(seed);
    const torch::Tensor got = g.replay(b);
    EXPECT_EQ(got.data_ptr(), values.data_ptr()) << "every replay rewrites the captured values";
    EXPECT_TRUE(torch::equal(got.cpu(), body(b))) << "batch " << seed;
  }
  g.release();
  EXPECT_FALSE(g.held());
}

// After a failed capture: the exception reaches the caller, no graph is held, the 256 MiB the body
// allocated in the graph's pool is given back (what the cache holds returns to where it was), a dropout
// draws from the default generator eagerly (its capture mode ended), and the next capture works.
void expect_a_clean_failure(const std::function<void(const data::Batch&)>& failing, const char* what) {
  auto memory = trainer::make_memory_backend(kCuda);
  torch::cuda::synchronize();
  memory->empty_cache();
  const int64_t reserved_before = memory->reserved_bytes();
  trainer::StepGraph g;
  EXPECT_ANY_THROW(g.capture(batch_of(1), kCuda, [&](const data::Batch& b) {
    auto held = torch::empty({256 * kMiB}, torch::TensorOptions().dtype(torch::kUInt8).device(kCuda));
    held.fill_(1);
    auto dropped = torch::dropout(b.images.to(torch::kFloat), 0.5, /*train=*/true);
    failing(b);
    return dropped.sum().reshape({1});
  })) << what;
  EXPECT_FALSE(g.held()) << what;
  torch::cuda::synchronize();
  memory->empty_cache();
  EXPECT_LT(memory->reserved_bytes() - reserved_before, 256 * kMiB) << what << ": the pool's 256 MiB were kept";
  const auto x = torch::ones({4096}, torch::TensorOptions().device(kCuda));
  int64_t kept = 0;
  ASSERT_NO_THROW(kept = torch::dropout(x, 0.5, /*train=*/true).count_nonzero().item<int64_t>()) << what;
  EXPECT_GT(kept, 1024) << what;
  EXPECT_LT(kept, 3072) << what;
  g.capture(batch_of(1), kCuda, body);
  ASSERT_TRUE(g.held()) << what;
  EXPECT_TRUE(torch::equal(g.replay(batch_of(2)).cpu(), body(batch_of(2)))) << what;
}

TEST(StepGraphCuda, ACaptureThatThrowsGivesBackItsPoolAndTheGenerator) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: graphs are captured there";
  expect_a_clean_failure([](const data::Batch&) { throw std::runtime_error("planted"); }, "a C++ exception");
}

// A host sync inside the capture (a loss read back mid-step) invalidates the stream's capture: capture_end
// itself then fails, and the pool is given back by hand.
TEST(StepGraphCuda, ACaptureInvalidatedByASyncGivesBackItsPoolAndTheGenerator) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: graphs are captured there";
  expect_a_clean_failure([](const data::Batch& b) { (void)b.images.sum().item<int64_t>(); }, "a sync in the capture");
}
#endif

}  // namespace test_step_graph
