// The next step's batch staged on a side stream (trainer/step/batch_stager.h): on the CPU or switched off it
// returns the batch as it is; on a CUDA device the staged batch is the host batch, the compute stream waits
// for its copy, its blocks are not handed out again while the compute stream still reads them, and a batch
// that does not fit under the cap stays on the host. The CUDA tests skip without a device, each saying why,
// and run in the GPU window's tests phase (scripts/gpu-check.sh, `*Cuda*`).
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "test_util.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/resources.h"
#include "trainer/step/batch_stager.h"

#ifdef TRAINER_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace test_batch_stager {

constexpr int64_t kMiB = 1 << 20;

// B uint8 NHWC images (channels_last, as the loader's uint8 batches), their labels and erase boxes, in
// page-locked memory where `pinned` (the loader's batches on a CUDA job).
data::Batch host_batch(int64_t b, int64_t side, bool pinned) {
  torch::manual_seed(3);
  data::Batch batch;
  auto opts = torch::TensorOptions().pinned_memory(pinned);
  batch.images = torch::empty({b, 3, side, side}, opts.dtype(torch::kUInt8).memory_format(torch::MemoryFormat::ChannelsLast));
  batch.images.copy_(torch::randint(0, 256, {b, 3, side, side}, torch::kUInt8));
  batch.labels = torch::empty({b}, opts.dtype(torch::kInt64)).copy_(torch::randint(0, 1000, {b}));
  batch.erase = torch::empty({b, 4}, opts.dtype(torch::kInt64)).copy_(torch::randint(0, side, {b, 4}));
  batch.indices.resize(static_cast<size_t>(b));
  return batch;
}

TEST(BatchStager, OnTheCpuOrSwitchedOffItReturnsTheBatchAsItIs) {
  for (const auto& [device, enabled] : {std::pair{c10::Device(c10::kCPU), true}, std::pair{c10::Device(c10::kCUDA, 0), false}}) {
    trainer::BatchStager s(device, enabled);
    EXPECT_FALSE(s.active()) << device;
    const data::Batch in = host_batch(4, 8, /*pinned=*/false);
    data::Batch out = s.stage(in);
    EXPECT_EQ(out.images.data_ptr(), in.images.data_ptr()) << device;
    EXPECT_EQ(out.labels.data_ptr(), in.labels.data_ptr()) << device;
    EXPECT_NO_THROW(s.ready(out));
    EXPECT_EQ(s.fallbacks(), 0);
  }
}

#ifdef TRAINER_WITH_CUDA
// The staged batch equals the host batch, layout included, and a kernel queued on the compute stream right
// after ready() reads the whole copy: 192 MiB of images take milliseconds to cross, so a compute stream that
// did not wait for the copy's event would sum a partial batch.
TEST(BatchStagerCuda, TheStagedBatchIsTheHostBatchAndTheComputeStreamWaitsForIt) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: the side stream and its event run there";
  const data::Batch host = host_batch(1024, 128, /*pinned=*/true);  // 1024 x 3 x 128 x 128 uint8: 48 MiB
  const int64_t expected = host.images.to(torch::kInt64).sum().item<int64_t>();
  trainer::BatchStager s(c10::Device(c10::kCUDA, 0), true);
  ASSERT_TRUE(s.active());
  for (int round = 0; round < 4; ++round) {
    data::Batch b = s.stage(host);
    ASSERT_TRUE(b.images.is_cuda());
    EXPECT_TRUE(b.images.is_contiguous(torch::MemoryFormat::ChannelsLast)) << "the NHWC layout crosses as it is";
    s.ready(b);
    EXPECT_EQ(b.images.to(torch::kInt64).sum().item<int64_t>(), expected) << "round " << round;
    EXPECT_TRUE(torch::equal(b.labels.cpu(), host.labels));
    EXPECT_TRUE(torch::equal(b.erase.cpu(), host.erase));
  }
  EXPECT_TRUE(torch::equal(s.stage(host).images.cpu(), host.images));
  EXPECT_EQ(s.fallbacks(), 0);
}

// record_stream: a staged batch dropped while the compute stream is still busy with it (a sleeping kernel
// queued after its read) keeps its block until that stream is past it, so the next staged batch of the same
// size lands elsewhere. The control: without ready() the block goes straight back and the next batch takes it.
TEST(BatchStagerCuda, ADroppedBatchKeepsItsBlockUntilTheComputeStreamIsPastIt) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: the caching allocator's streams run there";
  const data::Batch host = host_batch(64, 128, /*pinned=*/true);  // 3 MiB of images: a block of its own
  trainer::BatchStager s(c10::Device(c10::kCUDA, 0), true);
  torch::cuda::synchronize();
  const void* kept = nullptr;
  {
    data::Batch a = s.stage(host);
    s.ready(a);
    kept = a.images.data_ptr();
    [[maybe_unused]] auto read = a.images.sum();
    at::cuda::sleep(int64_t{1} << 30);  // about half a second of the compute stream, after the read
  }
  data::Batch b = s.stage(host);
  EXPECT_NE(b.images.data_ptr(), kept) << "the block was handed out while the compute stream still used it";
  torch::cuda::synchronize();

  trainer::BatchStager control(c10::Device(c10::kCUDA, 0), true);
  const void* freed = nullptr;
  {
    data::Batch a = control.stage(host);
    torch::cuda::synchronize();
    freed = a.images.data_ptr();
  }
  EXPECT_EQ(control.stage(host).images.data_ptr(), freed) << "without ready(), the allocator reuses the block";
  torch::cuda::synchronize();
}

// Under a cap with no room for the batch, stage() leaves it on the host and says why (the step then copies it
// one micro-batch at a time); with the cap lifted the next one is staged.
TEST(BatchStagerCuda, ABatchThatDoesNotFitUnderTheCapStaysOnTheHost) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device: the caching allocator's cap runs there";
  auto m = trainer::make_memory_backend(torch::Device(torch::kCUDA, 0));
  const data::Batch host = host_batch(256, 128, /*pinned=*/true);  // 12 MiB of images
  trainer::BatchStager s(c10::Device(c10::kCUDA, 0), true);
  torch::cuda::synchronize();
  m->set_limit(0);
  m->set_limit(m->current_bytes() + 2 * kMiB);
  data::Batch b = s.stage(host);
  m->set_limit(0);
  EXPECT_FALSE(b.images.is_cuda());
  EXPECT_EQ(b.images.data_ptr(), host.images.data_ptr());
  EXPECT_EQ(s.fallbacks(), 1);
  EXPECT_FALSE(s.last_fallback().empty());
  EXPECT_NO_THROW(s.ready(b));
  EXPECT_TRUE(s.stage(host).images.is_cuda());
  EXPECT_EQ(s.fallbacks(), 1);
}
#endif

}  // namespace test_batch_stager
