// The training and evaluation loaders: deterministic, resumable, sharded, threaded.
//
// Order. Epoch e visits the samples in a permutation derived only from (seed, e) (splitmix64 and
// Fisher-Yates, data/pixels/rng.h), or in index order without shuffle. The global batch k of an epoch covers
// positions [p, p + G) of that order, where p counts the samples of the epoch consumed before it
// (p = k * G from the start of an epoch, or from wherever seek() put the stream).
//
// Sharding. With world_size W, rank r takes the contiguous slice [r*g/W, (r+1)*g/W) of each global batch
// of g samples (integer division), so the W slices are disjoint and together form the global batch every
// rank agrees on (every rank must use the same seed and global batch).
//
// Augmentation. Sample i in epoch e gets its crop offset and flip, its automatic augmentation
// (RandAugment, TrivialAugmentWide: data/pixels/augment.h) and its random-erasing box from RNGs seeded by
// (seed, e, i) alone: reading the same batch twice, with any number of workers, before or after a resume, gives
// bit-identical tensors. A dataset that decodes encoded images (PixelLayout::HWC: data/files/packed_images.h,
// data/samples/image_folder.h) applies its own transform from (seed, e, i) in read_epoch(); its batches are
// uint8 (B, C, H, W) in channels_last memory, and samples it could not decode are listed in
// Batch::failures. Stored pixels give float32 (B, C, H, W) batches, normalized and erased here, or with
// LoaderOptions::uint8_batches the same uint8 NHWC batches as decoded images.
//
// Epochs. In training mode (drop_last) an epoch ends when fewer than G samples remain, and those are
// skipped; steps_per_epoch() = N / G. Without drop_last the last batch is partial. After the last
// batch of an epoch the stream continues with the next epoch.
#pragma once

#include "data/pixels/augment.h"
#include "data/samples/batch.h"
#include "data/samples/dataset.h"

#include <array>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace data {

/// Per-sample augmentation, applied in this order: random crop, horizontal flip, automatic augmentation
/// (uint8), conversion to float (and normalization), random erasing.
struct AugmentOptions {
  /// Pixels of zero padding on every side before a random (H, W) crop of the padded image; 0 = no crop.
  int64_t random_crop_padding = 0;
  /// Mirror left-right with probability 1/2.
  bool hflip = false;
  /// Output (x / 255 - mean[c]) / std[c] with the dataset's mean and std; false outputs x / 255.
  bool normalize = true;
  /// RandAugment or TrivialAugmentWide on the uint8 crop (stored pixels only: a dataset that decodes
  /// images applies it in its own transform, data/samples/image_sample.h's ImageTransform::auto_augment).
  AutoAugmentOptions auto_augment;
  /// RandomErasing's probability (0 = off) on the normalized float image, value 0. Stored pixels in float
  /// batches: erased here; decoded images and uint8 batches (LoaderOptions::uint8_batches): the boxes go
  /// out in Batch::erase and the step erases after normalizing.
  double random_erasing = 0;
};

struct LoaderOptions {
  /// Samples per global batch (over all ranks), G.
  int64_t global_batch = 128;
  /// Seeds the epoch orders and the augmentation.
  uint64_t seed = 0;
  /// Threads that read and augment; each batch is split across them. 0 = everything in next()'s thread.
  int64_t workers = 2;
  /// Batches prepared in the background ahead of the one next() returns (bounded queue). 0 = none.
  int64_t prefetch = 2;
  /// Visit each epoch in a random permutation; false = index order.
  bool shuffle = true;
  /// Skip an epoch's last incomplete global batch (training); false = include it (evaluation).
  bool drop_last = true;
  AugmentOptions augment;
  /// Stored pixels leave as decoded images do: uint8 (B, C, H, W) in channels_last memory (NHWC), cropped,
  /// flipped and auto-augmented but not normalized, with the random-erasing boxes in Batch::erase; the
  /// step converts, normalizes and erases on the device (a quarter of float32's bytes cross to it). false:
  /// float32 NCHW, normalized and erased here. Decoded datasets give uint8 either way.
  bool uint8_batches = false;
  /// Allocate batch tensors in pinned (page-locked) host memory for asynchronous copies to the GPU.
  /// Takes effect only when LibTorch has CUDA and a GPU is present; otherwise ignored.
  bool pin_memory = false;
  /// This process's rank and the number of data-parallel processes.
  int64_t rank = 0;
  int64_t world_size = 1;
};

// data::Batch and data::LoaderState (shared with the token loader) are in data/samples/batch.h.

/// One sample's augmentation: crop offset (dy, dx) into the padded image, each in [0, 2 * padding], and
/// whether to mirror the crop.
struct AugmentParams {
  int64_t dy = 0, dx = 0;
  bool flip = false;
};

/// The augmentation of dataset sample `index` in epoch `epoch`: a function of (seed, epoch, index) and
/// the options only. Draws dy, then dx (when padding > 0), then the flip (when hflip).
AugmentParams draw_augment(uint64_t seed, int64_t epoch, int64_t index, const AugmentOptions& options);

/// The float value of each uint8 pixel per channel: table[c * 256 + v] = (v / 255 - mean[c]) / std[c]
/// with normalize, else v / 255 (float arithmetic in that order).
std::vector<float> pixel_table(const std::vector<float>& mean, const std::vector<float>& std, bool normalize);

/// Crops, flips and converts one image: src uint8 (C, H, W), dst float (C, H, W).
///   dst[c][y][x] = table[c*256 + padded[c][y + dy][sx + dx]], sx = flip ? W-1-x : x,
/// where padded is src with `padding` zero pixels on every side (so the padding maps to table[c*256+0]).
void augment_image(const uint8_t* src, const std::array<int64_t, 3>& shape, const AugmentParams& params,
                   int64_t padding, const float* table, float* dst);

/// The same crop and flip on a decoded image, uint8 (H, W, C) to uint8 (H, W, C), padding with 0:
///   dst[y][x][c] = padded[y + dy][sx + dx][c], sx = flip ? W-1-x : x.
/// The datasets that decode (data/samples/image_sample.h) use it for the stored-pixel recipe (data.crop_padding),
/// so a sample gets the very crop and flip the float path above gives it.
void augment_image_hwc(const uint8_t* src, int64_t H, int64_t W, int64_t C, const AugmentParams& params,
                       int64_t padding, uint8_t* dst);

/// augmentation_space(kind, bins, height, width) with LibTorch's own torch.linspace, so the magnitudes
/// are torchvision's bit for bit; computed once per argument tuple and kept (thread-safe).
std::shared_ptr<const AugmentSpace> cached_augment_space(AutoAugmentKind kind, int64_t bins, int64_t height,
                                                         int64_t width);

/// The training loader. Call its methods from one thread; the workers are internal.
class Loader {
 public:
  /// Validates the options against the dataset (G >= 1, G <= N and G >= world_size when drop_last,
  /// 0 <= rank < world_size, workers >= 0, prefetch >= 0, padding >= 0) and starts the workers at
  /// epoch 0, position 0. Throws std::invalid_argument naming the option.
  Loader(std::shared_ptr<const ImageDataset> dataset, LoaderOptions options);
  /// Stops and joins the workers (a batch being read is finished first).
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  /// The next batch of the stream. A worker's exception is rethrown here as std::runtime_error naming
  /// the batch and the original message; that batch is then not consumed (state() is unchanged), and the
  /// next call retries it. An allocation that fails (a memory cap: c10::OutOfMemoryError) propagates
  /// as it is, also without consuming or skipping a batch.
  Batch next();

  /// Restarts the stream at sample `position` (0 <= position <= N) of epoch `epoch`: the following
  /// batches equal those an uninterrupted stream returns from that point. Batches being prepared are
  /// discarded. A position where no full batch fits (drop_last) or N means the next epoch's start.
  void seek(int64_t epoch, int64_t position);
  void seek(const LoaderState& state) { seek(state.epoch, state.position); }

  /// Changes the global batch from the next batch on (validated as in the constructor): the stream goes
  /// on from state() with batches of the new size, exactly as a new loader with this global batch after
  /// seek(state()). Batches being prepared are discarded.
  void set_global_batch(int64_t global_batch);

  /// Where the next call to next() starts (normalized: a finished epoch reads as {epoch + 1, 0}).
  LoaderState state() const { return consumed_; }

  /// Global batches in one epoch started at position 0: N / G with drop_last, ceil(N / G) without.
  int64_t steps_per_epoch() const;

  /// Samples per epoch, N: seek() takes positions 0..N.
  int64_t samples_per_epoch() const { return n_; }

  /// The batch that starts at (epoch, position), prepared in the calling thread; the stream does not
  /// move. Equal, bit for bit, to the batch next() returns there.
  Batch batch_at(int64_t epoch, int64_t position);

  /// The order of epoch `epoch`: a permutation of [0, N) (identity without shuffle).
  std::vector<int64_t> epoch_order(int64_t epoch) const;

  const LoaderOptions& options() const { return opt_; }
  const ImageDataset& dataset() const { return *dataset_; }
  /// True if batch tensors are allocated in pinned memory (pin_memory and CUDA available).
  bool pinned() const { return pinned_; }

 private:
  friend class EvalLoader;
  struct Job;
  struct Task {
    std::shared_ptr<Job> job;
    int64_t begin, end;
  };

  void validate() const;
  LoaderState normalized(LoaderState s) const;
  bool plan(LoaderState at, Batch& out);
  std::shared_ptr<Job> make_job(Batch batch);
  torch::Tensor image_buffer(int64_t rows);
  void fill(Job& job, int64_t begin, int64_t end) const;
  void fill_stored(Job& job, int64_t begin, int64_t end, const std::vector<int64_t>& indices) const;
  void fill_stored_uint8(Job& job, int64_t begin, int64_t end, const std::vector<int64_t>& indices) const;
  void augment_u8(const uint8_t* src, const AugmentParams& params, int64_t epoch, int64_t index, uint8_t* out) const;
  void draw_erase_boxes(Batch& b, int64_t begin, const std::vector<int64_t>& indices) const;
  void run_parts(const std::shared_ptr<Job>& job);
  void top_up();
  void discard_in_flight();
  void worker_loop();

  std::shared_ptr<const ImageDataset> dataset_;
  LoaderOptions opt_;
  std::array<int64_t, 3> shape_;
  bool decoded_ = false;  // the dataset decodes (layout HWC): uint8 NHWC batches, no augmentation here
  bool uint8_ = false;    // uint8 NHWC batches: decoded_ or opt_.uint8_batches
  std::shared_ptr<const AugmentSpace> space_;  // stored pixels with an automatic augmentation
  int64_t n_;
  std::vector<float> table_;
  bool pinned_ = false;
  int64_t end_epoch_ = -1;  // EvalLoader: no batch of this epoch or later is planned

  LoaderState cursor_;    // start of the next batch to plan
  LoaderState consumed_;  // start of the next batch to return
  std::vector<torch::Tensor> pool_;  // recycled image tensors (not pinned ones)
  int64_t order_epoch_ = -1;
  std::vector<int64_t> order_;  // cached epoch_order(order_epoch_)

  std::mutex mu_;  // guards tasks_, running_, stop_ and every Job's parts_left and error
  std::condition_variable task_cv_, done_cv_;
  std::deque<Task> tasks_;
  int64_t running_ = 0;
  bool stop_ = false;
  std::deque<std::shared_ptr<Job>> in_flight_;  // submitted batches, in stream order
  std::vector<std::thread> threads_;
};

struct EvalOptions {
  /// Samples per global batch (over all ranks).
  int64_t batch = 256;
  int64_t workers = 2;
  int64_t prefetch = 2;
  /// As AugmentOptions::normalize.
  bool normalize = true;
  bool pin_memory = false;
  int64_t rank = 0;
  int64_t world_size = 1;
};

/// One pass over a dataset in index order, without augmentation, the last partial batch included
/// (EvalPass, data/samples/batch.h).
class EvalLoader : public EvalPass {
 public:
  EvalLoader(std::shared_ptr<const ImageDataset> dataset, EvalOptions options);

  std::optional<Batch> next() override;
  /// Starts a new pass at sample 0.
  void reset() override { loader_.seek(0, 0); }
  /// Global batches in a pass: ceil(N / batch).
  int64_t num_batches() const override { return loader_.steps_per_epoch(); }

 private:
  static LoaderOptions loader_options(const EvalOptions& o);
  Loader loader_;
};

/// Samples per second that `loader` delivers over `batches` calls of next(), after one call that fills
/// the prefetch queue (not timed). Counts this rank's samples.
double measure_loader_throughput(Loader& loader, int batches);

}  // namespace data
