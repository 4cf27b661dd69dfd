// Data-parallel ranks that share the optimizer's work instead of copying it (dist.shard: ZeRO stages 1
// and 2, as DeepSpeed and PyTorch's FSDP2 give Python users).
//
// The trainable parameters are laid out in the flat buckets of the gradient exchange (GradientSync:
// reverse registration order, up to dist.bucket_mb each). A bucket of `numel` values is padded to
// world * slice values, slice = ceil(numel / world) (rounded up to 256 values, with each parameter starting
// at a multiple of 256: kShardAlign), and rank r owns values [r * slice, (r + 1) * slice):
//
//   bucket 0:  | conv3.weight          | conv2.bias | conv2.weight | pad |
//   ranks:     | rank 0's slice   | rank 1's slice   | rank 2's slice   |
//
// Where a slice crosses a parameter, the rank owns a piece of it: values [begin, end) of the flattened
// parameter (ShardPiece), flattened in memory order (flat_values: a channels_last weight's pieces are
// runs of its storage). The optimizer updates this rank's pieces only and keeps their state only
// (1/world of it); after the update each bucket's slices are all-gathered into every rank's parameters.
// With `gradients` the gradients are reduce-scattered instead of all-reduced, so that after backward a
// rank keeps the summed gradient of its slice only (GradientSync's sharded mode).
//
// ShardLayout is the arithmetic alone (tested without a process group); ParamShards holds the pieces as
// views of the parameters' storage and runs the all-gather.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace trainer {

class Distributed;  // dist.h

/// The values of `t` as one flat tensor on its storage, in memory order (for a channels_last weight, not
/// its logical order): the order of its values in a bucket and in a piece. Throws std::invalid_argument
/// unless `t` is non-overlapping and dense (contiguous, channels_last, ...).
torch::Tensor flat_values(const torch::Tensor& t);
/// `flat` (numel values of `like`, in memory order) seen with `like`'s sizes and strides.
torch::Tensor shaped_like(const torch::Tensor& flat, const torch::Tensor& like);

/// What bucketing needs of a parameter: its values, their bytes, and a key for its dtype and device (a
/// bucket holds one of each).
struct TensorShape {
  int64_t numel = 0;
  int64_t element_size = 4;
  std::string kind;
};

/// The parameters' indices grouped into buckets: reverse registration order (the order backward
/// completes them), each bucket filled up to `bucket_bytes` (a larger tensor gets one of its own), a new
/// one where the kind changes. Throws std::invalid_argument when bucket_bytes <= 0.
std::vector<std::vector<size_t>> bucket_groups(const std::vector<TensorShape>& params, int64_t bucket_bytes);

/// The alignment of the shards' layout, in values: the block of int8 optimizer state (quant8::kBlock), so that
/// a piece of a large parameter is whole blocks and its moments are quantized as the whole tensor's are.
constexpr int64_t kShardAlign = 256;

/// One bucket of the layout.
struct ShardBucket {
  std::vector<size_t> params;    ///< parameter indices, in the bucket's order
  std::vector<int64_t> offsets;  ///< each one's first value in the bucket
  std::vector<int64_t> numels;   ///< each one's values
  int64_t numel = 0;             ///< values up to the last parameter's end (alignment gaps included)
  int64_t slice = 0;             ///< values each rank owns: ceil(numel / world), aligned; the bucket holds world * slice
};

/// One rank's part of one parameter.
struct ShardPiece {
  size_t param = 0;    ///< index into the parameters
  size_t bucket = 0;
  int64_t begin = 0;   ///< values [begin, end) of the flattened parameter
  int64_t end = 0;
  int64_t offset = 0;  ///< where value `begin` sits in the rank's slice of the bucket
  int64_t numel() const { return end - begin; }
};

class ShardLayout {
 public:
  /// `align`: each parameter starts at a multiple of it in its bucket, and slices are multiples of it, so
  /// that pieces of large parameters are whole blocks of that many values (kShardAlign: the int8 moments'
  /// blocks). Throws std::invalid_argument when world < 1, align < 1 or bucket_bytes <= 0.
  ShardLayout(const std::vector<TensorShape>& params, int64_t bucket_bytes, int64_t world, int64_t align = 1);

  int64_t world() const { return world_; }
  const std::vector<ShardBucket>& buckets() const { return buckets_; }
  /// Rank r's pieces, bucket by bucket, in bucket order: at most one per parameter.
  std::vector<ShardPiece> pieces(int64_t rank) const;
  /// The values rank r owns (padding excluded): the sum of its pieces.
  int64_t owned(int64_t rank) const;

 private:
  int64_t world_;
  std::vector<ShardBucket> buckets_;
};

/// This rank's pieces of the parameters, as tensors that share the parameters' storage, and the
/// all-gather that brings every rank's updated pieces into every rank's parameters.
class ParamShards {
 public:
  /// `params`: the trainable tensors, the same list in the same order on every rank (the optimizer's).
  /// Throws std::invalid_argument naming a parameter that is not dense (flat_values), and when the
  /// parameters differ in dtype or device.
  ParamShards(Distributed& dist, std::vector<torch::Tensor> params, int64_t bucket_bytes);

  const ShardLayout& layout() const { return layout_; }
  const std::vector<ShardPiece>& pieces() const { return pieces_; }
  /// The pieces as flat tensors viewing their parameters' values: what the optimizer updates.
  const std::vector<torch::Tensor>& views() const { return views_; }
  const std::vector<torch::Tensor>& params() const { return params_; }

  /// Each piece's gradient becomes its part of its parameter's gradient (all-reduced: dist.shard
  /// optimizer); a parameter without one gives its piece none.
  void take_parameter_gradients();
  /// Each piece's gradient becomes its part of its bucket's summed slice (dist.shard gradients:
  /// GradientSync::slices()).
  void take_slice_gradients(const std::vector<torch::Tensor>& slices);
  /// Drops the pieces' gradients.
  void drop_gradients();
  /// After the update: every bucket's slices all-gathered into every rank's parameters, one bucket at a
  /// time, in place through one staging buffer the size of the largest bucket (allocated by the first
  /// call, or by allocate_staging() before the step's agreement).
  void gather();
  /// The gather's staging buffer, allocated now if it is not yet: before the ranks agree that a step
  /// succeeded, so that nothing is allocated on one rank only after that (Step::prepare_update).
  void allocate_staging();

 private:
  Distributed& dist_;
  std::vector<torch::Tensor> params_;
  ShardLayout layout_;
  std::vector<ShardPiece> pieces_;
  std::vector<torch::Tensor> views_;
  torch::Tensor staging_;  // world * slice values of the largest bucket; this rank's slice is sent from its place
};

}  // namespace trainer
