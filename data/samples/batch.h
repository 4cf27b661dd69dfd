// What every loader returns and how a stream's place is stored: shared by the image loader
// (data/samples/loader.h) and the token loader (data/samples/token_loader.h), so the trainer drives both
// the same way.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace data {

/// A sample that could not be decoded (data/samples/image_sample.h): it kept its place in the batch as a zero
/// image with label kIgnoreLabel (data/samples/dataset.h).
struct SampleFailure {
  int64_t index = 0;  ///< dataset index
  std::string what;   ///< one line: the file (or packed file and index) and the decoder's reason
};

/// One rank's share of one global batch. Images: images (B, C, H, W) float32, or for datasets that decode
/// encoded images (layout HWC), and for stored pixels with LoaderOptions::uint8_batches, uint8 (B, C, H, W)
/// in channels_last memory (NHWC, not normalized: the step converts and normalizes on the device); labels
/// (B) int64; indices = dataset indices. Tokens: images = inputs (B, T) int64, labels = targets (B, T) int64 (the
/// inputs shifted by one token), indices = each window's first token offset in the split.
struct Batch {
  torch::Tensor images;
  torch::Tensor labels;
  /// One entry per sample of this rank, in batch order.
  std::vector<int64_t> indices;
  /// Epoch of this batch.
  int64_t epoch = 0;
  /// Samples of this epoch (over all ranks) consumed before this global batch.
  int64_t position = 0;
  /// Samples in the whole global batch (over all ranks).
  int64_t global_size = 0;
  /// uint8 images with random erasing (data.random_erasing): (B, 4) int64 rows (top, left, height,
  /// width), an empty box (height or width 0) for a sample not erased. The step sets each box to 0 after
  /// normalizing (data/pixels/augment.h's RandomErasing). Undefined: nothing to erase (float batches of
  /// stored pixels are erased by the loader).
  torch::Tensor erase;
  /// Samples of this rank's share that could not be decoded, in batch order (empty for stored pixels).
  std::vector<SampleFailure> failures;

  /// B: this rank's samples.
  int64_t size() const { return static_cast<int64_t>(indices.size()); }
};

/// Where a stream stands: its next batch starts at sample `position` of epoch `epoch`'s order.
/// Store it in a checkpoint and give it back to the loader's seek() to resume.
struct LoaderState {
  int64_t epoch = 0;
  int64_t position = 0;
  bool operator==(const LoaderState& o) const { return epoch == o.epoch && position == o.position; }
};

/// One pass over an evaluation split in order, what the image and the token evaluation loaders both are
/// (EvalLoader, data/samples/loader.h; TokenEvalLoader, data/samples/token_loader.h): batches of a fixed
/// size over all ranks, the last one partial, each rank its slice of each (possibly empty near the end),
/// the union over ranks every sample once.
class EvalPass {
 public:
  virtual ~EvalPass() = default;
  /// The next batch of the pass, or nullopt once the pass is over (until reset()).
  virtual std::optional<Batch> next() = 0;
  /// Starts a new pass at the split's first sample.
  virtual void reset() = 0;
  /// Global batches in a pass.
  virtual int64_t num_batches() const = 0;
};

}  // namespace data
