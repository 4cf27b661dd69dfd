// The memory layer under a real cap: the capped CPU allocator counts what LibTorch allocates and makes
// real convolutions, backward passes and optimizer steps fail with c10::OutOfMemoryError; the cgroup,
// CPU and control-file readers against fake files with hand-written values.
#include "trainer/memory/backend.h"
#include "trainer/memory/oom.h"
#include "trainer/memory/resources.h"

#include "test_util.h"

#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <set>
#include <thread>

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_memory {

namespace {

namespace fs = std::filesystem;
using trainer::cpu_allocator::live_bytes;
using trainer::cpu_allocator::peak_bytes;

using testutil::kKiB;
using testutil::kMiB;

// Every test that sets a cap derives from this: the cap goes back to none when the test ends, however
// it ends (the allocator is process-wide and the binary runs other suites too).
class CappedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    trainer::cpu_allocator::install();
    trainer::cpu_allocator::set_cap(0);
  }
  void TearDown() override { trainer::cpu_allocator::set_cap(0); }
};
class MemoryCap : public CappedTest {};
class ResourcesLimitCapped : public CappedTest {};

using testutil::error_text;

// A small conv net: enough layers that forward, backward and the optimizer each allocate.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 3).padding(1)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 16, 3).padding(1)))),
        fc(register_module("fc", torch::nn::Linear(16, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(conv1(x));               // (B, 16, H, W)
    h = torch::relu(conv2(h));                    // (B, 16, H, W)
    return fc(h.mean(std::vector<int64_t>{2, 3}));  // (B, 16) -> (B, 10)
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc;
};
TORCH_MODULE(Net);

// One input batch, created under whatever cap is in force (as a data loader's batch would be).
torch::Tensor batch(int64_t b, int64_t hw = 32) { return torch::randn({b, 3, hw, hw}); }

void drop_grads(Net& net) {
  for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
}

int64_t param_bytes(Net& net) {
  int64_t n = 0;
  for (const auto& p : net->parameters()) n += p.numel() * static_cast<int64_t>(p.element_size());
  return n;
}

}  // namespace

// ---- byte sizes -----------------------------------------------------------------------------------

TEST(MemoryBytes, ParsesBinaryDecimalAndPlainSizes) {
  EXPECT_EQ(trainer::parse_bytes("6GiB"), 6LL * 1024 * 1024 * 1024);
  EXPECT_EQ(trainer::parse_bytes("300MiB"), 300LL * 1024 * 1024);
  EXPECT_EQ(trainer::parse_bytes("512KiB"), 524288);
  EXPECT_EQ(trainer::parse_bytes("1.5GB"), 1500000000);
  EXPECT_EQ(trainer::parse_bytes("123"), 123);
  EXPECT_EQ(trainer::parse_bytes("0"), 0);
  EXPECT_EQ(trainer::parse_bytes(" 1.5 gib "), 1610612736);
  EXPECT_EQ(trainer::parse_bytes("2k"), 2048);
  EXPECT_EQ(trainer::parse_bytes("3MB"), 3000000);
  EXPECT_EQ(trainer::parse_bytes("7B"), 7);
  EXPECT_EQ(trainer::parse_bytes("1TiB"), 1099511627776LL);
  EXPECT_EQ(trainer::parse_bytes("0.5KiB"), 512);
}

TEST(MemoryBytes, RejectsWhatIsNotASizeNamingTheText) {
  for (const char* bad : {"", "abc", "-5MiB", "5XB", "1.2.3GB", "1e3", "GiB", "5 GiB extra", "99999999TiB"}) {
    const std::string msg = error_text([&] { trainer::parse_bytes(bad); });
    EXPECT_NE(msg.find(std::string("'") + bad + "' is not a byte size"), std::string::npos) << bad << ": " << msg;
  }
  EXPECT_NE(error_text([] { trainer::parse_bytes("-5MiB"); }).find("negative"), std::string::npos);
  EXPECT_NE(error_text([] { trainer::parse_bytes("5XB"); }).find("unknown unit 'xb'"), std::string::npos);
  EXPECT_THROW(trainer::parse_bytes("lots"), std::invalid_argument);
}

TEST(MemoryBytes, FormatsWithBinaryUnits) {
  EXPECT_EQ(trainer::format_bytes(0), "0 B");
  EXPECT_EQ(trainer::format_bytes(12), "12 B");
  EXPECT_EQ(trainer::format_bytes(1023), "1023 B");
  EXPECT_EQ(trainer::format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(trainer::format_bytes(300 * kMiB), "300.00 MiB");
  EXPECT_EQ(trainer::format_bytes(6LL * 1024 * kMiB), "6.00 GiB");
  EXPECT_EQ(trainer::format_bytes(-2048), "-2.00 KiB");
  EXPECT_EQ(trainer::parse_bytes("300MiB"), 300 * kMiB);  // and back
}

// ---- the allocator's accounting -------------------------------------------------------------------

TEST_F(MemoryCap, AllocatorCountsExactlyTheTensorsCreatedAfterInstall) {
  const int64_t base = live_bytes();
  {
    auto a = torch::empty({3, 5}, torch::kFloat);     // 15 * 4 = 60
    auto b = torch::empty({7}, torch::kDouble);       // 7 * 8 = 56
    auto c = torch::empty({2, 3, 4}, torch::kLong);   // 24 * 8 = 192
    auto d = torch::zeros({0});                       // 0
    auto e = torch::ones({1000}, torch::kUInt8);      // 1000
    EXPECT_EQ(live_bytes() - base, 60 + 56 + 192 + 0 + 1000);
    auto v = a.view({5, 3});  // a view shares the storage: nothing new
    EXPECT_EQ(live_bytes() - base, 1308);
    b = torch::Tensor();
    EXPECT_EQ(live_bytes() - base, 1308 - 56);
    auto f = c.to(torch::kFloat);  // a real kernel's output: 24 * 4 = 96
    EXPECT_EQ(live_bytes() - base, 1252 + 96);
  }
  EXPECT_EQ(live_bytes(), base);
}

// oneDNN allocates through raw_allocate, which asserts that the DataPtr's context is its data pointer
// (oneDNN asserts data == context); a oneDNN convolution must run, be counted and fail cleanly under a cap.
TEST_F(MemoryCap, AllocatorServesRawAllocateAndOneDnnConvolution) {
  const int64_t base = live_bytes();
  c10::Allocator* a = c10::GetCPUAllocator();
  void* p = a->raw_allocate(1000);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  EXPECT_EQ(live_bytes(), base + 1000);
  a->raw_deallocate(p);
  EXPECT_EQ(live_bytes(), base);

  torch::manual_seed(0);
  auto x = torch::randn({2, 8, 12, 12});
  auto w = torch::randn({4, 8, 3, 3});
  auto b = torch::randn({4});
  const int64_t inputs = live_bytes();
  auto y = at::mkldnn_convolution(x, w, b, {1, 1}, {1, 1}, {1, 1}, 1);
  auto ref = at::thnn_conv2d(x, w, {3, 3}, b, {1, 1}, {1, 1});  // the plain im2col path
  EXPECT_TRUE(torch::allclose(y, ref, 1e-4, 1e-5));
  y = torch::Tensor();
  ref = torch::Tensor();
  EXPECT_EQ(live_bytes(), inputs);
  trainer::cpu_allocator::set_cap(inputs + 100);
  EXPECT_THROW(at::mkldnn_convolution(x, w, b, {1, 1}, {1, 1}, {1, 1}, 1), c10::OutOfMemoryError);
  EXPECT_EQ(live_bytes(), inputs);
}

TEST_F(MemoryCap, AllocatorReportsAFailedSystemAllocationAsOom) {
  // 4 PiB is more than a 47-bit address space holds: malloc fails whatever the overcommit policy.
  const int64_t base = live_bytes();
  const std::string msg = error_text([] { auto t = torch::empty({int64_t(1) << 50}, torch::kFloat); });
  EXPECT_NE(msg.find("CPU out of memory (system): malloc of 4.00 PiB (4503599627370496 bytes) failed"),
            std::string::npos)
      << msg;
  try {
    auto t = torch::empty({int64_t(1) << 50}, torch::kFloat);
  } catch (const std::exception& e) {
    EXPECT_TRUE(trainer::is_oom_error(e));
  }
  EXPECT_EQ(live_bytes(), base);
}

TEST_F(MemoryCap, AllocatorPeakTracksAndResets) {
  const int64_t base = live_bytes();
  trainer::cpu_allocator::reset_peak();
  EXPECT_EQ(peak_bytes(), base);
  { auto big = torch::empty({kMiB / 4}, torch::kFloat); }  // 1 MiB, then freed
  auto small = torch::empty({25}, torch::kFloat);           // 100 bytes
  EXPECT_EQ(peak_bytes(), base + kMiB);
  EXPECT_EQ(live_bytes(), base + 100);
  trainer::cpu_allocator::reset_peak();
  EXPECT_EQ(peak_bytes(), base + 100);
}

// Tensors allocated before install() keep LibTorch's own deleter and never enter the count. That needs
// a process where nothing installed the allocator yet, so the test runs itself in a child process.
TEST(MemoryAllocator, TensorsFromBeforeInstallAreNotCounted) {
  if (std::getenv("TRAINER_TEST_PRE_INSTALL_CHILD") == nullptr) {
    const auto r = testutil::run(
        "TRAINER_TEST_PRE_INSTALL_CHILD=1 /proc/" + std::to_string(getpid()) +
        "/exe --gtest_filter=MemoryAllocator.TensorsFromBeforeInstallAreNotCounted");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("[  PASSED  ] 1 test"), std::string::npos) << r.output;
    return;
  }
  ASSERT_FALSE(trainer::cpu_allocator::installed());
  auto before = torch::ones({1000}, torch::kFloat);  // default allocator
  void* raw_before = c10::GetCPUAllocator()->raw_allocate(4096);  // as oneDNN allocates
  trainer::cpu_allocator::install();
  trainer::cpu_allocator::install();  // idempotent
  ASSERT_TRUE(trainer::cpu_allocator::installed());
  EXPECT_NE(c10::GetCPUAllocator(), c10::GetDefaultCPUAllocator());
  const int64_t base = live_bytes();
  auto after = before * 2;  // allocated by the capped allocator: 4000 bytes
  EXPECT_EQ(live_bytes(), base + 4000);
  before = torch::Tensor();  // freed by the default allocator's deleter: the count does not move
  EXPECT_EQ(live_bytes(), base + 4000);
  after = torch::Tensor();
  EXPECT_EQ(live_bytes(), base);
  // raw_deallocate goes through the allocator installed now; a block from before goes back to its own.
  c10::GetCPUAllocator()->raw_deallocate(raw_before);
  EXPECT_EQ(live_bytes(), base);
  EXPECT_FLOAT_EQ(torch::ones({3}).sum().item<float>(), 3.0f);  // still a working allocator
}

// Note: at::parallel_for is a header template that runs serially in a translation unit compiled without
// -fopenmp (this project's), so the concurrency here comes from std::threads, LibTorch's inter-op pool
// (at::launch) and concurrent autograd, which is where LibTorch itself allocates from several threads.
TEST_F(MemoryCap, AllocatorCountsExactlyUnderConcurrentAllocation) {
  const int kThreads = 4, kPerThread = 500;
  auto size_of = [](int i) { return int64_t(i % 17 + 1); };  // floats
  int64_t per_thread = 0;
  for (int i = 0; i < kPerThread; ++i) per_thread += 4 * size_of(i);

  std::vector<std::vector<torch::Tensor>> held(kThreads + 1);
  std::atomic<bool> go{false};
  auto work = [&](int t) {
    while (!go.load()) std::this_thread::yield();
    for (int i = 0; i < kPerThread; ++i) {
      held[t].push_back(torch::empty({size_of(i)}, torch::kFloat));
      auto churn = torch::empty({64 + i % 5}, torch::kDouble);  // allocated and freed at once
    }
  };
  const int64_t base = live_bytes();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(work, t);
  std::promise<std::thread::id> pool_thread;
  at::launch([&] {
    work(kThreads);
    pool_thread.set_value(std::this_thread::get_id());
  });
  go.store(true);
  for (auto& th : threads) th.join();
  EXPECT_NE(pool_thread.get_future().get(), std::this_thread::get_id());
  EXPECT_EQ(live_bytes() - base, (kThreads + 1) * per_thread);
  held.clear();
  EXPECT_EQ(live_bytes(), base);
}

TEST_F(MemoryCap, ConcurrentAutogradReturnsToTheBaseline) {
  const int64_t base = live_bytes();
  std::vector<std::thread> threads;
  std::atomic<int> steps{0};
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      torch::manual_seed(t);
      Net net;
      for (int i = 0; i < 4; ++i) {
        net->forward(batch(4, 16)).pow(2).mean().backward();
        ++steps;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(steps.load(), 12);
  EXPECT_EQ(live_bytes(), base);
}

TEST_F(MemoryCap, AllocatorNeverPassesTheCapUnderConcurrentAllocation) {
  const int64_t base = live_bytes();
  const int64_t cap = base + 40 * kKiB;
  trainer::cpu_allocator::set_cap(cap);
  trainer::cpu_allocator::reset_peak();
  const int64_t refused_before = trainer::cpu_allocator::refused_allocations();
  std::atomic<int64_t> refused{0}, ok{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<torch::Tensor> held;
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < 400; ++i) {
        try {
          held.push_back(torch::empty({1024 + 256 * ((i + t) % 8)}, torch::kUInt8));  // 1-3 KiB
          ++ok;
        } catch (const c10::OutOfMemoryError&) {
          ++refused;
          held.clear();
        }
        if (held.size() > 24) held.erase(held.begin());  // up to ~50 KiB per thread
      }
    });
  }
  go.store(true);
  for (auto& th : threads) th.join();
  EXPECT_GT(refused.load(), 0);
  EXPECT_GT(ok.load(), 0);
  EXPECT_EQ(trainer::cpu_allocator::refused_allocations() - refused_before, refused.load());
  EXPECT_LE(peak_bytes(), cap);  // the reservation is atomic: threads never overshoot together
  EXPECT_EQ(live_bytes(), base);
}

// ---- real OOMs under a real cap -------------------------------------------------------------------

TEST_F(MemoryCap, CapFailsAConvolutionForwardThenASmallerBatchRuns) {
  torch::manual_seed(0);
  Net net;
  const int64_t base = live_bytes();
  trainer::cpu_allocator::reset_peak();
  { auto y = net->forward(batch(32)); }
  const int64_t need = peak_bytes() - base;  // input + activations of one forward at batch 32
  ASSERT_EQ(live_bytes(), base);
  ASSERT_GT(need, 32 * 3 * 32 * 32 * 4);

  const int64_t cap = base + need / 2;
  trainer::cpu_allocator::set_cap(cap);
  bool caught = false;
  try {
    auto y = net->forward(batch(32));
  } catch (const c10::OutOfMemoryError& e) {
    caught = true;
    EXPECT_TRUE(trainer::is_oom_error(e));
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("CPU out of memory (trainer memory cap): tried to allocate "), std::string::npos) << msg;
    EXPECT_NE(msg.find(" bytes) live under a cap of " + trainer::format_bytes(cap) + " (" + std::to_string(cap) +
                       " bytes)"),
              std::string::npos)
        << msg;
  }
  EXPECT_TRUE(caught);
  EXPECT_EQ(live_bytes(), base);  // everything the failed forward held is gone

  trainer::cpu_allocator::reset_peak();
  auto y = net->forward(batch(4));  // an eighth of the batch under the same cap
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{4, 10}));
  EXPECT_LE(peak_bytes(), cap);
}

TEST_F(MemoryCap, CapFailsBackwardThenASmallerBatchRuns) {
  torch::manual_seed(0);
  Net net;
  const int64_t base = live_bytes();
  // Reference run without a cap: what backward needs on top of the forward graph.
  int64_t backward_need = 0;
  {
    auto loss = net->forward(batch(32)).pow(2).mean();
    const int64_t after_forward = live_bytes();
    trainer::cpu_allocator::reset_peak();
    loss.backward();
    backward_need = peak_bytes() - after_forward;
  }
  drop_grads(net);
  ASSERT_EQ(live_bytes(), base);

  // The cap goes on between forward and backward.
  int64_t cap = 0;
  bool caught = false;
  {
    auto loss = net->forward(batch(32)).pow(2).mean();
    cap = live_bytes() + backward_need / 2;
    trainer::cpu_allocator::set_cap(cap);
    try {
      loss.backward();
    } catch (const c10::OutOfMemoryError& e) {
      caught = true;
      EXPECT_TRUE(trainer::is_oom_error(e));
    }
  }
  EXPECT_TRUE(caught);
  // Backward may have accumulated some gradients before it failed: drop them with the graph.
  drop_grads(net);
  EXPECT_EQ(live_bytes(), base);

  trainer::cpu_allocator::reset_peak();
  auto loss = net->forward(batch(4)).pow(2).mean();
  loss.backward();
  EXPECT_LE(peak_bytes(), cap);
  for (const auto& p : net->parameters()) EXPECT_TRUE(p.grad().defined());
}

TEST_F(MemoryCap, CapFailsTheFirstOptimizerStepHalfApplied) {
  // The limit falls between backward and the first optimizer step (an operator's control file, another
  // process): SGD with momentum allocates one buffer per parameter (P bytes in all) on its first step,
  // and only half of that is left.
  torch::manual_seed(0);
  Net net;
  const int64_t P = param_bytes(net);
  // Copies to see which parameters the failed step changed (allocated before the baseline).
  std::vector<torch::Tensor> before;
  for (const auto& p : net->parameters()) before.push_back(p.detach().clone());
  const int64_t base = live_bytes();

  int64_t cap = 0;
  bool caught = false;
  {
    auto opt = std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    auto x = batch(256, 16);  // the step still holds its input batch (768 KiB) at the optimizer step
    net->forward(x).pow(2).mean().backward();
    cap = live_bytes() + P / 2;
    trainer::cpu_allocator::set_cap(cap);
    try {
      opt->step();
    } catch (const c10::OutOfMemoryError& e) {
      caught = true;
      EXPECT_TRUE(trainer::is_oom_error(e));
    }
    // The step failed part-way: parameters before the one whose buffer did not fit were already updated.
    // A retry would update them twice, so the loop must not simply retry an optimizer step.
    const auto params = net->parameters();
    EXPECT_FALSE(torch::equal(params[0], before[0])) << "conv1.weight (1.7 KiB of momentum) fit: updated";
    EXPECT_TRUE(torch::equal(params[2], before[2])) << "conv2.weight (9 KiB of momentum) did not fit";
  }  // the optimizer and its partial momentum buffers die here
  EXPECT_TRUE(caught);
  drop_grads(net);
  EXPECT_EQ(live_bytes(), base);

  // The ladder's answer under the same cap: a fresh optimizer and a whole step at a small micro-batch.
  trainer::cpu_allocator::reset_peak();
  auto opt = torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto x = batch(2, 16);
  net->forward(x).pow(2).mean().backward();
  opt.step();
  EXPECT_LE(peak_bytes(), cap);
  EXPECT_EQ(live_bytes() - base, 2 * P + x.nbytes());  // gradients, momentum buffers and the batch
}

// ---- find_max_micro_batch on a real net under a real cap -------------------------------------------

TEST_F(MemoryCap, FindMaxMicroBatchMatchesExhaustiveSearchUnderARealCap) {
  torch::manual_seed(0);
  Net net;
  const int64_t hw = 16, hi = 48;
  auto run = [&](int64_t mb) {
    auto loss = net->forward(batch(mb, hw)).pow(2).mean();
    loss.backward();
  };
  // One forward + backward at mb under the cap; OOM means "does not fit".
  int calls = 0;
  auto fits = [&](int64_t mb) {
    ++calls;
    bool ok = true;
    try {
      run(mb);
    } catch (const std::exception& e) {
      if (!trainer::is_oom_error(e)) throw;
      ok = false;
    }
    drop_grads(net);
    return ok;
  };
  const int64_t base = live_bytes();
  trainer::cpu_allocator::reset_peak();
  run(16);
  drop_grads(net);
  const int64_t need16 = peak_bytes() - base;
  trainer::cpu_allocator::set_cap(base + need16 * 3 / 2);  // roughly 24 samples' worth

  std::vector<bool> fit(hi + 1, false);
  int64_t exhaustive = 0;
  for (int64_t mb = 1; mb <= hi; ++mb) {
    fit[mb] = fits(mb);
    if (fit[mb]) exhaustive = mb;
  }
  ASSERT_EQ(live_bytes(), base);
  // The premise of the search: memory grows with the batch, so the sizes that fit are exactly 1..max.
  for (int64_t mb = 1; mb <= hi; ++mb) EXPECT_EQ(fit[mb], mb <= exhaustive) << mb;
  ASSERT_GT(exhaustive, 16);
  ASSERT_LT(exhaustive, hi);

  calls = 0;
  const int64_t found = trainer::find_max_micro_batch(fits, 1, hi);
  EXPECT_EQ(found, exhaustive);  // exact, not just within a factor of two
  EXPECT_LE(calls, 2 * 6 + 2);
  EXPECT_TRUE(fits(found));
  EXPECT_FALSE(fits(found + 1));
  EXPECT_EQ(live_bytes(), base);
}

// ---- the controller driving a real net under a real cap -------------------------------------------

TEST_F(MemoryCap, LadderKeepsTheGlobalBatchAndMatchesTheUncappedGradients) {
  // A global batch of 32 under a cap that only fits a few samples: the controller halves until a step
  // runs, and the accumulated gradients equal the gradients of the whole batch at once.
  torch::manual_seed(0);
  Net net;
  auto x = batch(32, 16);  // the step's data, fixed
  auto loss_of = [&](const torch::Tensor& xb) { return net->forward(xb).pow(2).sum(); };

  loss_of(x).div(32).backward();
  std::vector<torch::Tensor> reference;
  for (const auto& p : net->parameters()) reference.push_back(p.grad().clone());
  drop_grads(net);

  const int64_t base = live_bytes();
  trainer::cpu_allocator::reset_peak();
  { auto l = loss_of(x.narrow(0, 0, 4)).div(32); l.backward(); }
  drop_grads(net);
  const int64_t need4 = peak_bytes() - base;
  const int64_t cap = base + need4 * 3 / 2;
  trainer::cpu_allocator::set_cap(cap);

  trainer::MicroBatchOptions o;
  o.global_batch = 32;
  o.min_micro_batch = 1;
  o.allow_checkpointing = false;
  trainer::MicroBatchController ctl(o);
  int attempts = 0;
  for (;;) {
    ++attempts;
    ASSERT_LT(attempts, 10);
    try {
      int64_t start = 0;
      for (int64_t n : ctl.micro_batch_sizes()) {
        loss_of(x.narrow(0, start, n)).div(32).backward();  // each sample weighs 1/32, as in one batch
        start += n;
      }
      EXPECT_EQ(start, 32);
      break;
    } catch (const std::exception& e) {
      ASSERT_TRUE(trainer::is_oom_error(e)) << e.what();
      drop_grads(net);  // a failed step's partial gradients are discarded, the whole step reruns
      const auto a = ctl.on_oom(cap);
      ASSERT_NE(a.kind, trainer::OomAction::Kind::kGiveUp) << a.event.reason;
    }
  }
  EXPECT_GT(attempts, 1);
  EXPECT_LE(ctl.micro_batch(), 4);
  EXPECT_EQ(ctl.global_batch(), 32);
  const auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(torch::allclose(params[i].grad(), reference[i], 1e-4, 1e-6)) << i;
}

// ---- classifying failures -------------------------------------------------------------------------

TEST(MemoryOomError, RecognisesOutOfMemoryInAllItsSpellings) {
  auto thrown = [](auto f) -> bool {
    try {
      f();
    } catch (const std::exception& e) {
      return trainer::is_oom_error(e);
    }
    ADD_FAILURE() << "nothing thrown";
    return false;
  };
  EXPECT_TRUE(thrown([] { TORCH_CHECK_WITH(OutOfMemoryError, false, "anything at all"); }));
  EXPECT_TRUE(thrown([] { throw std::bad_alloc(); }));
  EXPECT_TRUE(thrown([] {
    throw std::runtime_error(
        "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.93 GiB total capacity; 7.20 GiB already allocated)");
  }));
  EXPECT_TRUE(thrown([] { TORCH_CHECK(false, "CUDA error: out of memory"); }));
  EXPECT_TRUE(thrown([] { throw std::runtime_error("cudaMalloc failed: out of memory"); }));
  EXPECT_TRUE(thrown([] {
    throw std::runtime_error("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`");
  }));
  EXPECT_TRUE(thrown([] { TORCH_CHECK(false, "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"); }));
  EXPECT_TRUE(thrown([] { throw std::runtime_error("cudaErrorMemoryAllocation"); }));

  EXPECT_FALSE(thrown([] {
    TORCH_CHECK(false,
                "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
                "non-contiguous input.");
  }));
  EXPECT_FALSE(thrown([] { TORCH_CHECK(false, "shape '[2, 3]' is invalid for input of size 7"); }));
  EXPECT_FALSE(thrown([] { throw std::invalid_argument("Expected 4-dimensional input for conv2d"); }));
  EXPECT_FALSE(thrown([] { throw std::runtime_error("CUDA error: device-side assert triggered"); }));
  // A real shape error from a real op is not an OOM either.
  EXPECT_FALSE(thrown([] { torch::ones({2, 3}).view({7}); }));
}

// ---- the backend seam -----------------------------------------------------------------------------

TEST_F(MemoryCap, CpuBackendIsTheCappedAllocator) {
  auto backend = trainer::make_memory_backend(torch::kCPU);
  EXPECT_EQ(backend->name(), "cpu");
  EXPECT_TRUE(backend->device().is_cpu());
  const int64_t base = backend->current_bytes();
  EXPECT_EQ(base, live_bytes());
  auto t = torch::empty({1000}, torch::kDouble);
  EXPECT_EQ(backend->current_bytes(), base + 8000);
  EXPECT_EQ(backend->reserved_bytes(), base + 8000);
  backend->reset_peak();
  EXPECT_EQ(backend->peak_bytes(), base + 8000);

  backend->set_limit(base + 10000);
  EXPECT_EQ(backend->limit(), base + 10000);
  EXPECT_EQ(trainer::cpu_allocator::cap(), base + 10000);
  const std::string msg = error_text([] { auto u = torch::empty({1000}, torch::kDouble); });
  EXPECT_NE(msg.find("tried to allocate 7.81 KiB (8000 bytes)"), std::string::npos) << msg;
  EXPECT_NE(backend->report().find("cpu: current " + trainer::format_bytes(base + 8000)), std::string::npos)
      << backend->report();
  EXPECT_NE(backend->report().find("limit " + trainer::format_bytes(base + 10000)), std::string::npos);
  backend->set_limit(0);
  EXPECT_NE(backend->report().find("limit none"), std::string::npos);
  EXPECT_THROW(backend->set_limit(-1), std::invalid_argument);
  backend->empty_cache();  // nothing cached on CPU
  EXPECT_EQ(backend->current_bytes(), base + 8000);

  // total_bytes is the host's physical memory: MemTotal.
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  meminfo >> key >> kib;
  ASSERT_EQ(key, "MemTotal:");
  EXPECT_EQ(backend->total_bytes(), kib * 1024);
  EXPECT_GT(backend->free_bytes(), 0);
  EXPECT_LE(backend->free_bytes(), backend->total_bytes());
}

TEST_F(MemoryCap, ScopedCapRestoresThePreviousCap) {
  trainer::cpu_allocator::set_cap(123 * kMiB);
  try {
    trainer::ScopedCpuCap cap(live_bytes() + 10);
    auto t = torch::empty({100});
    FAIL() << "allocation under the cap succeeded";
  } catch (const c10::OutOfMemoryError&) {
  }
  EXPECT_EQ(trainer::cpu_allocator::cap(), 123 * kMiB);
  EXPECT_THROW(trainer::cpu_allocator::set_cap(-5), std::invalid_argument);
}

TEST(MemoryBackendFactory, RejectsDevicesItCannotServe) {
#ifndef TRAINER_WITH_CUDA
  EXPECT_NE(error_text([] { trainer::make_memory_backend(c10::Device(c10::kCUDA, 0)); })
                .find("this build of the trainer has no CUDA"),
            std::string::npos);
#else
  if (!torch::cuda::is_available()) GTEST_SKIP() << "CUDA build without a device";
  auto b = trainer::make_memory_backend(c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(b->name(), "cuda:0");
  const int64_t before = b->current_bytes();
  auto t = torch::empty({1 << 20}, torch::TensorOptions().device(torch::kCUDA));
  EXPECT_GE(b->current_bytes() - before, 4 << 20);
  EXPECT_GT(b->total_bytes(), 0);
#endif
  EXPECT_NE(error_text([] { trainer::make_memory_backend(c10::Device(c10::kMeta)); })
                .find("no memory backend for device meta"),
            std::string::npos);
}

// ---- cgroups, CPUs, host memory -------------------------------------------------------------------

namespace {

// A fake file system root: write("proc/self/cgroup", "...") puts the file under the temp folder.
struct FakeRoot {
  testutil::TempDir dir{"trainer_cgroup"};
  void write(const std::string& rel, const std::string& text) {
    fs::create_directories((dir.path / rel).parent_path());
    testutil::write_file(dir.path / rel, text);
  }
  void mkdir(const std::string& rel) { fs::create_directories(dir.path / rel); }
  std::string root() const { return dir.str(); }
};

int affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  return CPU_COUNT(&set);
}

}  // namespace

TEST(ResourcesCgroup, V2LimitQuotaAndUsageWithAParentLimit) {
  FakeRoot f;
  f.write("proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
  f.write("sys/fs/cgroup/cgroup.controllers", "cpu memory\n");
  f.write("sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "3221225472\n");
  f.write("sys/fs/cgroup/kubepods/pod1/ctr/memory.current", "1048576\n");
  f.write("sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "150000 100000\n");
  auto m = trainer::read_cgroup_memory(f.root());
  EXPECT_EQ(m.version, 2);
  EXPECT_EQ(m.limit_bytes, 3221225472LL);
  EXPECT_EQ(m.usage_bytes, 1048576);
  EXPECT_EQ(fs::path(m.dir), f.dir.path / "sys/fs/cgroup/kubepods/pod1/ctr");
  auto c = trainer::read_cgroup_cpu(f.root());
  EXPECT_EQ(c.version, 2);
  EXPECT_DOUBLE_EQ(c.cpus, 1.5);
  EXPECT_EQ(trainer::usable_cpus(f.root()), std::min(affinity_cpus(), 2));

  // A tighter limit on the pod binds the container too.
  f.write("sys/fs/cgroup/kubepods/pod1/memory.max", "2147483648\n");
  f.write("sys/fs/cgroup/kubepods/cpu.max", "50000 100000\n");
  EXPECT_EQ(trainer::read_cgroup_memory(f.root()).limit_bytes, 2147483648LL);
  EXPECT_DOUBLE_EQ(trainer::read_cgroup_cpu(f.root()).cpus, 0.5);
  EXPECT_EQ(trainer::usable_cpus(f.root()), 1);
}

TEST(ResourcesCgroup, V2MaxMeansNone) {
  FakeRoot f;
  f.write("proc/self/cgroup", "0::/\n");
  f.write("sys/fs/cgroup/cgroup.controllers", "cpu memory\n");
  f.write("sys/fs/cgroup/memory.max", "max\n");
  f.write("sys/fs/cgroup/memory.current", "4096\n");
  f.write("sys/fs/cgroup/cpu.max", "max 100000\n");
  auto m = trainer::read_cgroup_memory(f.root());
  EXPECT_EQ(m.version, 2);
  EXPECT_EQ(m.limit_bytes, 0);
  EXPECT_EQ(m.usage_bytes, 4096);
  auto c = trainer::read_cgroup_cpu(f.root());
  EXPECT_EQ(c.version, 2);
  EXPECT_EQ(c.cpus, 0);
  EXPECT_EQ(trainer::usable_cpus(f.root()), affinity_cpus());
}

TEST(ResourcesCgroup, V2HostPathWithoutANamespaceFallsBackToTheMount) {
  FakeRoot f;
  // Without a cgroup namespace /proc/self/cgroup names the host's path, which the container cannot see.
  f.write("proc/self/cgroup", "0::/system.slice/docker-abc.scope\n");
  f.write("sys/fs/cgroup/cgroup.controllers", "memory\n");
  f.write("sys/fs/cgroup/memory.max", "1073741824\n");
  EXPECT_EQ(trainer::read_cgroup_memory(f.root()).limit_bytes, 1073741824LL);
}

TEST(ResourcesCgroup, V1LimitQuotaAndUnlimited) {
  FakeRoot f;
  f.write("proc/self/cgroup",
          "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n0::/\n");
  f.write("sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", "536870912\n");
  f.write("sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes", "1000\n");
  f.write("sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "250000\n");
  f.write("sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n");
  auto m = trainer::read_cgroup_memory(f.root());
  EXPECT_EQ(m.version, 1);  // the v1 controller wins over the unified line on a hybrid host
  EXPECT_EQ(m.limit_bytes, 536870912);
  EXPECT_EQ(m.usage_bytes, 1000);
  auto c = trainer::read_cgroup_cpu(f.root());
  EXPECT_EQ(c.version, 1);
  EXPECT_DOUBLE_EQ(c.cpus, 2.5);
  EXPECT_EQ(trainer::usable_cpus(f.root()), std::min(affinity_cpus(), 3));

  // v1's "unlimited" is a huge number; a quota of -1 is none.
  f.write("sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n");
  f.write("sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n");
  EXPECT_EQ(trainer::read_cgroup_memory(f.root()).limit_bytes, 0);
  EXPECT_EQ(trainer::read_cgroup_cpu(f.root()).cpus, 0);
}

TEST(ResourcesCgroup, NoCgroupMeansNoLimit) {
  FakeRoot f;
  f.mkdir("proc");
  auto m = trainer::read_cgroup_memory(f.root());
  EXPECT_EQ(m.version, 0);
  EXPECT_EQ(m.limit_bytes, 0);
  EXPECT_EQ(trainer::read_cgroup_cpu(f.root()).cpus, 0);
  EXPECT_EQ(trainer::usable_cpus(f.root()), affinity_cpus());
}

TEST(ResourcesCgroup, UnparsableLimitNamesTheFile) {
  FakeRoot f;
  f.write("proc/self/cgroup", "0::/\n");
  f.write("sys/fs/cgroup/cgroup.controllers", "memory\n");
  f.write("sys/fs/cgroup/memory.max", "lots\n");
  const std::string msg = error_text([&] { trainer::read_cgroup_memory(f.root()); });
  EXPECT_NE(msg.find("cannot parse 'lots' in " + (f.dir.path / "sys/fs/cgroup/memory.max").string()),
            std::string::npos)
      << msg;
}

TEST(ResourcesCgroup, ReadsThisMachineWithoutFailing) {
  // Whatever this machine has, the readers agree with each other and with the affinity mask.
  const auto m = trainer::read_cgroup_memory();
  EXPECT_GE(m.limit_bytes, 0);
  const auto c = trainer::read_cgroup_cpu();
  const int n = trainer::usable_cpus();
  EXPECT_GE(n, 1);
  EXPECT_LE(n, affinity_cpus());
  if (c.cpus > 0) EXPECT_EQ(n, std::min(affinity_cpus(), static_cast<int>(std::ceil(c.cpus - 1e-9))));
  else EXPECT_EQ(n, affinity_cpus());
}

TEST(ResourcesCpu, ApplyCpuThreadsSetsIntraOpThreads) {
  const int prev = at::get_num_threads();
  trainer::apply_cpu_threads(2);
  EXPECT_EQ(at::get_num_threads(), 2);
  // Once parallel work ran, the inter-op pool cannot be resized; that must not throw.
  at::parallel_for(0, 100, 1, [](int64_t, int64_t) {});
  at::launch([] {});
  EXPECT_NO_THROW(trainer::apply_cpu_threads(1));
  EXPECT_EQ(at::get_num_threads(), 1);
  EXPECT_NE(error_text([] { trainer::apply_cpu_threads(0); }).find("CPU threads must be >= 1, got 0"),
            std::string::npos);
  at::set_num_threads(prev);
}

TEST(ResourcesHost, RssAndAvailableMemory) {
  FakeRoot f;
  f.write("proc/self/statm", "5000 1000 300 10 0 800 0\n");
  f.write("proc/meminfo", "MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:    8000000 kB\n");
  const int64_t page = sysconf(_SC_PAGE_SIZE);
  EXPECT_EQ(trainer::host_rss_bytes(f.root()), 1000 * page);
  EXPECT_EQ(trainer::host_available_bytes(f.root()), 8000000LL * 1024);
  FakeRoot empty;
  EXPECT_EQ(trainer::host_rss_bytes(empty.root()), 0);
  EXPECT_EQ(trainer::host_available_bytes(empty.root()), 0);

  // The real one agrees with VmRSS in /proc/self/status.
  const int64_t rss = trainer::host_rss_bytes();
  std::ifstream status("/proc/self/status");
  std::string line;
  int64_t vmrss_kib = -1;
  while (std::getline(status, line))
    if (line.rfind("VmRSS:", 0) == 0) vmrss_kib = std::stoll(line.substr(6));
  ASSERT_GT(vmrss_kib, 0);
  EXPECT_NEAR(static_cast<double>(rss), vmrss_kib * 1024.0, 4.0 * kMiB);
  // It is read afresh each time (one descriptor kept open, read again from its start): 64 MiB touched
  // show in the next read.
  std::vector<char> touched(64 * kMiB, 1);
  EXPECT_GT(trainer::host_rss_bytes() - rss, 60 * kMiB);
  EXPECT_EQ(touched[12345], 1);
}

TEST(ResourcesLimit, AutoCpuRuleByHand) {
  EXPECT_EQ(trainer::auto_cpu_limit(1000, 100, 0, 0.1), 810);    // (1000 - 100) * 0.9
  EXPECT_EQ(trainer::auto_cpu_limit(1000, 100, 50, 0.1), 765);   // (1000 - 100 - 50) * 0.9
  EXPECT_EQ(trainer::auto_cpu_limit(1000, 0, 0, 0.0), 1000);
  EXPECT_EQ(trainer::auto_cpu_limit(0, 100, 50, 0.1), 0);        // no cgroup limit: no cap
  EXPECT_EQ(trainer::auto_cpu_limit(100, 200, 0, 0.1), 1);       // already full: the smallest cap, not none
  EXPECT_EQ(trainer::auto_cpu_limit(1000, 100, 900, 0.1), 1);    // the reserve takes the rest
  EXPECT_THROW(trainer::auto_cpu_limit(1000, 0, 0, 1.0), std::invalid_argument);
  EXPECT_THROW(trainer::auto_cpu_limit(1000, 0, -1, 0.1), std::invalid_argument);
}

TEST_F(ResourcesLimitCapped, ResolvesMemoryLimitSpecs) {
  trainer::CpuMemoryBackend cpu;
  FakeRoot none;
  none.mkdir("proc");
  trainer::AutoLimitOptions o;
  o.system_root = o.proc_root = none.root();
  EXPECT_EQ(trainer::resolve_memory_limit("none", cpu, o), 0);
  EXPECT_EQ(trainer::resolve_memory_limit("", cpu, o), 0);
  EXPECT_EQ(trainer::resolve_memory_limit("NONE", cpu, o), 0);
  EXPECT_EQ(trainer::resolve_memory_limit("300MiB", cpu, o), 300 * kMiB);
  EXPECT_EQ(trainer::resolve_memory_limit("1.5GB", cpu, o), 1500000000);
  EXPECT_EQ(trainer::resolve_memory_limit("auto", cpu, o), 0);  // no cgroup limit

  FakeRoot f;
  f.write("proc/self/cgroup", "0::/\n");
  f.write("sys/fs/cgroup/cgroup.controllers", "memory\n");
  f.write("sys/fs/cgroup/memory.max", "4294967296\n");
  f.write("proc/self/statm", "90000 25600 0 0 0 0 0\n");  // 100 MiB resident with 4 KiB pages
  o.system_root = o.proc_root = f.root();
  const int64_t rss = 25600 * static_cast<int64_t>(sysconf(_SC_PAGE_SIZE));
  const int64_t live = cpu.current_bytes();
  const int64_t expected = static_cast<int64_t>(std::floor((4294967296.0 - (rss - live)) * 0.9));
  EXPECT_EQ(trainer::resolve_memory_limit("auto", cpu, o), expected);
  EXPECT_EQ(trainer::resolve_memory_limit(" Auto ", cpu, o), expected);
  o.reserve_bytes = 64 * kMiB;
  EXPECT_EQ(trainer::resolve_memory_limit("auto", cpu, o),
            static_cast<int64_t>(std::floor((4294967296.0 - (rss - live) - 64.0 * kMiB) * 0.9)));

  // The trainer's way: the cgroup from a fake tree, the RSS from the real /proc (this process's own).
  o.proc_root = "/";
  o.reserve_bytes = 0;
  const int64_t real_other = trainer::host_rss_bytes() - cpu.current_bytes();
  const int64_t with_real_rss = trainer::resolve_memory_limit("auto", cpu, o);
  EXPECT_NEAR(static_cast<double>(with_real_rss), (4294967296.0 - real_other) * 0.9, 8.0 * kMiB);

  trainer::AutoLimitOptions real;
  EXPECT_NE(error_text([&] { trainer::resolve_memory_limit("lots", cpu, real); })
                .find("memory.limit: 'lots' is not a limit; write a byte size"),
            std::string::npos);
  real.margin = 1.0;
  EXPECT_NE(error_text([&] { trainer::resolve_memory_limit("auto", cpu, real); }).find("margin must be a fraction"),
            std::string::npos);
}

// `auto` on a host without a container limit (issue 24): the machine's memory binds too, MemAvailable
// plus what the process already holds, and the smaller of the two caps wins where both are known.
TEST_F(ResourcesLimitCapped, AutoTakesTheSmallerOfTheContainerAndTheMachine) {
  trainer::CpuMemoryBackend cpu;
  const int64_t page = sysconf(_SC_PAGE_SIZE);
  const int64_t rss = 25600 * page, anon = 20000 * page;  // statm: 25600 resident, 5600 of them file-backed
  const int64_t live = cpu.current_bytes();
  auto cap_of = [&](double bound, int64_t other) {  // the rule by hand, margin 0.1
    return static_cast<int64_t>(std::floor((bound - static_cast<double>(other)) * 0.9));
  };
  trainer::AutoLimitOptions o;

  // A bare host: no cgroup, 1 GiB available. The host's cap is (MemAvailable + live tensors) * 0.9: what
  // the process holds outside tensors is in neither figure.
  FakeRoot host;
  host.write("proc/meminfo", "MemTotal: 25165824 kB\nMemAvailable: 1048576 kB\nSwapTotal: 8388608 kB\n");
  host.write("proc/self/statm", "90000 25600 5600 0 0 0 0\n");
  o.system_root = o.proc_root = host.root();
  trainer::MemoryBounds b = trainer::read_memory_bounds(host.root(), host.root());
  EXPECT_EQ(b.container_bytes, 0);
  EXPECT_EQ(b.host_held_bytes, anon);
  EXPECT_EQ(b.host_bytes, 1024 * kMiB + anon);  // available + held; swap is not counted
  trainer::AutoCpuLimit a = trainer::resolve_auto_cpu_limit(cpu, o);
  EXPECT_EQ(a.source, "host");
  EXPECT_EQ(a.cap, cap_of(1024.0 * kMiB + anon, anon - live));
  EXPECT_EQ(a.cap, static_cast<int64_t>(std::floor((1024.0 * kMiB + live) * 0.9)));
  EXPECT_EQ(trainer::resolve_memory_limit("auto", cpu, o), a.cap);

  // A container of 512 MiB on that host: the container binds, with the whole resident set as its other.
  host.write("proc/self/cgroup", "0::/\n");
  host.write("sys/fs/cgroup/cgroup.controllers", "memory\n");
  host.write("sys/fs/cgroup/memory.max", std::to_string(512 * kMiB) + "\n");
  a = trainer::resolve_auto_cpu_limit(cpu, o);
  EXPECT_EQ(a.bounds.container_bytes, 512 * kMiB);
  EXPECT_EQ(a.source, "container");
  EXPECT_EQ(a.cap, cap_of(512.0 * kMiB, rss - live));
  EXPECT_EQ(trainer::resolve_memory_limit("auto", cpu, o), a.cap);

  // A container of 4 GiB on a host with 1 GiB available: the host binds, the container's limit is moot.
  host.write("sys/fs/cgroup/memory.max", std::to_string(4096 * kMiB) + "\n");
  a = trainer::resolve_auto_cpu_limit(cpu, o);
  EXPECT_EQ(a.source, "host");
  EXPECT_EQ(a.cap, cap_of(1024.0 * kMiB + anon, anon - live));

  // Neither known: no cap, as before.
  FakeRoot nothing;
  nothing.mkdir("proc");
  o.system_root = o.proc_root = nothing.root();
  a = trainer::resolve_auto_cpu_limit(cpu, o);
  EXPECT_EQ(a.cap, 0);
  EXPECT_EQ(a.source, "none");

  // The real machine: a bound exists, and it is at most MemTotal (the held part is not in MemAvailable).
  const trainer::MemoryBounds real = trainer::read_memory_bounds();
  EXPECT_GT(real.host_bytes, 0);
  EXPECT_GT(real.host_held_bytes, 0);
  EXPECT_LE(real.host_bytes, static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * page);
}

TEST(ResourcesLimit, ContainerRootComesFromTheEnvironment) {
  const char* before = std::getenv("TRAINER_CGROUP_ROOT");
  const std::string saved = before ? before : "";
  unsetenv("TRAINER_CGROUP_ROOT");
  EXPECT_EQ(trainer::container_root(), "/");
  setenv("TRAINER_CGROUP_ROOT", "", 1);
  EXPECT_EQ(trainer::container_root(), "/");
  setenv("TRAINER_CGROUP_ROOT", "/tmp/fake_container", 1);
  EXPECT_EQ(trainer::container_root(), "/tmp/fake_container");
  if (before) setenv("TRAINER_CGROUP_ROOT", saved.c_str(), 1);
  else unsetenv("TRAINER_CGROUP_ROOT");
}

// ---- the control file -----------------------------------------------------------------------------

TEST(ResourcesControlFile, DetectsChangesAndDoesNotRereadAnUnchangedFile) {
  testutil::TempDir run_dir("trainer_control");
  const fs::path p = run_dir / "control.yaml";
  trainer::ControlFile cf(p.string());

  auto r = cf.poll();  // no file yet
  EXPECT_FALSE(r.update.has_value());
  EXPECT_TRUE(r.warning.empty());
  EXPECT_EQ(cf.reads(), 0);

  testutil::write_file(p, "memory: {limit: 3GiB}\n");
  r = cf.poll();
  ASSERT_TRUE(r.update.has_value());
  EXPECT_EQ(r.update->memory_limit, std::optional<std::string>("3GiB"));
  EXPECT_EQ(cf.current().memory_limit, std::optional<std::string>("3GiB"));
  EXPECT_EQ(cf.reads(), 1);

  EXPECT_FALSE(cf.poll().update.has_value());  // unchanged: only stat'ed
  EXPECT_EQ(cf.reads(), 1);

  // Same size, same modification time, different text: proof that an unchanged stat means no read.
  const auto mtime = fs::last_write_time(p);
  testutil::write_file(p, "memory: {limit: 5GiB}\n");
  fs::last_write_time(p, mtime);
  EXPECT_FALSE(cf.poll().update.has_value());
  EXPECT_EQ(cf.reads(), 1);

  // A new modification time with the same size is a change.
  fs::last_write_time(p, mtime + std::chrono::seconds(1));
  r = cf.poll();
  ASSERT_TRUE(r.update.has_value());
  EXPECT_EQ(r.update->memory_limit, std::optional<std::string>("5GiB"));
  EXPECT_EQ(cf.reads(), 2);

  // A file without the key asks for nothing and keeps the value.
  testutil::write_file(p, "{}\n");
  r = cf.poll();
  ASSERT_TRUE(r.update.has_value());
  EXPECT_FALSE(r.update->memory_limit.has_value());
  EXPECT_EQ(cf.current().memory_limit, std::optional<std::string>("5GiB"));
}

TEST(ResourcesControlFile, MalformedFilesAreReportedAndIgnored) {
  testutil::TempDir run_dir("trainer_control");
  const fs::path p = run_dir / "control.yaml";
  trainer::ControlFile cf(p.string());
  testutil::write_file(p, "memory: {limit: 2GiB}\n");
  ASSERT_TRUE(cf.poll().update.has_value());

  const std::vector<std::pair<std::string, std::string>> cases = {
      {"memory: {limit: [1, 2}\n", "control file " + p.string() + ": "},  // YAML syntax error
      {"memroy: {limit: 1GiB}\n", "unknown key 'memroy'"},
      {"memory: {limt: 1GiB}\n", "unknown key 'memory.limt'"},
      {"memory: {limit: lots}\n", "memory.limit: 'lots' is not a limit"},
      {"memory: {limit: {a: 1}}\n", "memory.limit must be a scalar"},
      {"- 1\n- 2\n", "expected 'memory: {limit: 3GiB}'"},
  };
  int64_t reads = cf.reads();
  for (size_t i = 0; i < cases.size(); ++i) {
    testutil::write_file(p, cases[i].first + std::string(i + 1, '\n'));  // a new size each time
    const auto r = cf.poll();
    EXPECT_FALSE(r.update.has_value()) << cases[i].first;
    EXPECT_NE(r.warning.find(cases[i].second), std::string::npos) << r.warning;
    EXPECT_NE(r.warning.find("ignored; keeping memory.limit=2GiB"), std::string::npos) << r.warning;
    EXPECT_EQ(cf.current().memory_limit, std::optional<std::string>("2GiB"));
    EXPECT_EQ(cf.reads(), ++reads);
    // The bad file is reported once, not at every poll.
    const auto again = cf.poll();
    EXPECT_TRUE(again.warning.empty());
    EXPECT_FALSE(again.update.has_value());
  }
  testutil::write_file(p, "memory:\n  limit: auto   # the operator fixed it\n");
  const auto r = cf.poll();
  ASSERT_TRUE(r.update.has_value());
  EXPECT_EQ(r.update->memory_limit, std::optional<std::string>("auto"));
  EXPECT_TRUE(r.warning.empty());
}

// ---- caps on a GPU ------------------------------------------------------------------------------------

// The decision behind a cut that binds on CUDA: the cache is emptied only when a cap is set and the
// allocator holds more than it allows.
TEST(GpuCap, ALoweredCapEmptiesTheCacheOnlyWhenItHoldsMore) {
  EXPECT_TRUE(trainer::cache_over_limit(3 * kMiB, 2 * kMiB));
  EXPECT_FALSE(trainer::cache_over_limit(2 * kMiB, 2 * kMiB));  // exactly at the cap: it still fits
  EXPECT_FALSE(trainer::cache_over_limit(1 * kMiB, 2 * kMiB));
  EXPECT_FALSE(trainer::cache_over_limit(3 * kMiB, 0));  // no cap
}

// auto on a GPU, by hand: 20 GiB held by this process + 0.9 x 80 GiB free = 92 GiB. Two jobs on 140 GiB:
// A holds 100 and B starts with the 40 left, allowed 0.9 x 40 = 36. Once B holds its 36, A may hold its
// 100 + 0.9 x 4 = 103.6: at least what it holds, so B's start never pushes A into a backoff. (With the
// margin on free + reserved, A's cap would fall to (4 + 100) x 0.9 = 93.6, below the 100 it holds: A would
// back off, B grow into what A gave back, and so on in turn.)
TEST(GpuCap, AutoTakesTheMarginFromWhatIsFreeNotFromWhatTheJobHolds) {
  constexpr int64_t kGiB = 1024 * kMiB;
  EXPECT_EQ(trainer::auto_cuda_limit(80 * kGiB, 20 * kGiB, 0.1), 92 * kGiB);
  const int64_t b = trainer::auto_cuda_limit(40 * kGiB, 0, 0.1);
  EXPECT_EQ(b, 36 * kGiB);
  const int64_t a = trainer::auto_cuda_limit(140 * kGiB - 100 * kGiB - b, 100 * kGiB, 0.1);
  EXPECT_EQ(a, 100 * kGiB + static_cast<int64_t>(std::floor(4.0 * kGiB * 0.9)));
  EXPECT_GE(a, 100 * kGiB);
  EXPECT_EQ(trainer::auto_cuda_limit(0, 0, 0.1), 1);  // nothing free, nothing held
  EXPECT_EQ(trainer::auto_cuda_limit(5 * kGiB, 0, 0.0), 5 * kGiB);
}

// When auto on a GPU resolves again: at once on a fall past 2% of the device (at least 64 MiB), on a
// rise past 5% only once it has lasted 10 s. The swings are those of two ResNet-50 jobs on an H200
// (bench/results/gpu-2026-11-27-h200/share2.json): the neighbour's probes freed and took back up to
// 10 GiB within a step, which raised this job's cap and sent it probing a micro-batch that then failed.
TEST(GpuCap, AutoFollowsFallsAtOnceAndRisesThatLast) {
  constexpr int64_t kGiB = 1024 * kMiB;
  const int64_t total = 100 * kGiB, was = 60 * kGiB;
  trainer::GpuMemoryFollower f(10.0);
  f.reset(was);
  EXPECT_FALSE(f.moved(was, total, 0.0));
  EXPECT_FALSE(f.moved(was - 2 * kGiB, total, 1.0));  // exactly 2%: not yet
  EXPECT_TRUE(f.moved(was - 2 * kGiB - 1, total, 2.0));
  EXPECT_FALSE(f.moved(was + 5 * kGiB, total, 3.0));  // exactly 5%: not a rise
  // A rise for 9 s, then back: nothing.
  for (double t = 10; t < 19.5; t += 1) EXPECT_FALSE(f.moved(was + 8 * kGiB, total, t)) << t;
  EXPECT_FALSE(f.moved(was, total, 20.0));
  // The same rise again, lasting: acted on once it has lasted 10 s, counted from its first sight again.
  for (double t = 21; t < 30.5; t += 1) EXPECT_FALSE(f.moved(was + 8 * kGiB, total, t)) << t;
  EXPECT_TRUE(f.moved(was + 8 * kGiB, total, 31.0));
  // After the cap is resolved again, the new value is the base.
  f.reset(was + 8 * kGiB);
  EXPECT_FALSE(f.moved(was + 8 * kGiB, total, 32.0));
  // A small device: the 64 MiB floor, not 2% of 1 GiB (20 MiB), decides.
  f.reset(512 * kMiB);
  EXPECT_FALSE(f.moved(512 * kMiB - 64 * kMiB, kGiB, 40.0));
  EXPECT_TRUE(f.moved(512 * kMiB - 65 * kMiB, kGiB, 41.0));
}

// On a GPU: a cap lowered below what the caching allocator holds gives the cached segments back (the
// device's free memory rises by them) and binds: the same allocation that fitted from the cache before
// now fails with an OOM, and fits again once the cap is lifted.
TEST(GpuCap, ALoweredCapReleasesTheCachedSegmentsAndBindsOnCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: the caching allocator's cap cannot run here";
  auto m = trainer::make_memory_backend(torch::Device(torch::kCUDA, 0));
  m->set_limit(0);
  const auto opts = torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA, 0);
  { auto t = torch::empty({256 * kMiB}, opts); }  // freed: its segment stays in the cache
  const int64_t held = m->reserved_bytes(), live = m->current_bytes();
  ASSERT_GE(held - live, 256 * kMiB);
  const int64_t free_before = m->free_bytes();
  const int64_t cap = live + 64 * kMiB;
  m->set_limit(cap);
  EXPECT_LE(m->reserved_bytes(), cap);
  EXPECT_GE(m->free_bytes() - free_before, 256 * kMiB);
  bool oom = false;
  try {
    auto t = torch::empty({256 * kMiB}, opts);
  } catch (const std::exception& e) {
    oom = trainer::is_oom_error(e);
  }
  EXPECT_TRUE(oom) << "a 256 MiB allocation under a cap of live + 64 MiB did not fail";
  m->set_limit(0);
  EXPECT_NO_THROW(torch::empty({256 * kMiB}, opts));
}

}  // namespace test_memory
