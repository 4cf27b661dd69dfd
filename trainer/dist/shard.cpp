// The shards' layout and the parameters' all-gather (shard.h).
#include "trainer/dist/shard.h"

#include <algorithm>
#include <stdexcept>

#include "trainer/dist/dist.h"

namespace trainer {

torch::Tensor flat_values(const torch::Tensor& t) {
  if (!t.is_non_overlapping_and_dense())
    throw std::invalid_argument("a tensor of sizes " + c10::str(t.sizes()) + " and strides " + c10::str(t.strides()) +
                                " is not dense: its values are not one run of memory");
  return t.as_strided({t.numel()}, {1}, t.storage_offset());
}

torch::Tensor shaped_like(const torch::Tensor& flat, const torch::Tensor& like) {
  return flat.as_strided(like.sizes(), like.strides(), flat.storage_offset());
}

std::vector<std::vector<size_t>> bucket_groups(const std::vector<TensorShape>& params, int64_t bucket_bytes) {
  if (bucket_bytes <= 0) throw std::invalid_argument("bucket_groups: bucket_bytes must be positive");
  std::vector<std::vector<size_t>> groups;
  int64_t bytes = 0;
  for (size_t k = params.size(); k-- > 0;) {
    const int64_t b = params[k].numel * params[k].element_size;
    const bool fresh = groups.empty() || (bytes > 0 && bytes + b > bucket_bytes) ||
                       params[groups.back().front()].kind != params[k].kind;
    if (fresh) {
      groups.emplace_back();
      bytes = 0;
    }
    groups.back().push_back(k);
    bytes += b;
  }
  return groups;
}

ShardLayout::ShardLayout(const std::vector<TensorShape>& params, int64_t bucket_bytes, int64_t world, int64_t align)
    : world_(world) {
  if (world < 1 || align < 1) throw std::invalid_argument("ShardLayout: world and align must be at least 1");
  const auto up = [align](int64_t n) { return (n + align - 1) / align * align; };
  for (auto& group : bucket_groups(params, bucket_bytes)) {
    ShardBucket b;
    for (size_t k : group) {
      b.params.push_back(k);
      b.offsets.push_back(up(b.numel));
      b.numels.push_back(params[k].numel);
      b.numel = b.offsets.back() + params[k].numel;
    }
    b.slice = up((b.numel + world - 1) / world);
    buckets_.push_back(std::move(b));
  }
}

std::vector<ShardPiece> ShardLayout::pieces(int64_t rank) const {
  std::vector<ShardPiece> out;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const ShardBucket& b = buckets_[i];
    const int64_t lo = rank * b.slice, hi = std::min(b.numel, lo + b.slice);
    for (size_t j = 0; j < b.params.size(); ++j) {
      const int64_t start = b.offsets[j], stop = start + b.numels[j];
      const int64_t from = std::max(lo, start), to = std::min(hi, stop);
      if (from >= to) continue;
      out.push_back({b.params[j], i, from - start, to - start, from - lo});
    }
  }
  return out;
}

int64_t ShardLayout::owned(int64_t rank) const {
  int64_t n = 0;
  for (const ShardPiece& p : pieces(rank)) n += p.numel();
  return n;
}

namespace {
std::vector<TensorShape> shapes_of(const std::vector<torch::Tensor>& params) {
  std::vector<TensorShape> out;
  for (const auto& p : params)
    out.push_back({p.numel(), static_cast<int64_t>(p.element_size()),
                   std::string(c10::toString(p.scalar_type())) + "@" + p.device().str()});
  return out;
}
}  // namespace

ParamShards::ParamShards(Distributed& dist, std::vector<torch::Tensor> params, int64_t bucket_bytes)
    : dist_(dist),
      params_(std::move(params)),
      layout_(shapes_of(params_), bucket_bytes, dist.world_size(), kShardAlign),
      pieces_(layout_.pieces(dist.rank())) {
  for (size_t k = 0; k < params_.size(); ++k)
    if (!params_[k].is_non_overlapping_and_dense())
      throw std::invalid_argument("dist.shard: parameter " + std::to_string(k) + " (sizes " + c10::str(params_[k].sizes()) +
                                  ", strides " + c10::str(params_[k].strides()) + ") is not dense: its values are not "
                                  "one run of memory, which a shard's pieces need");
  for (const auto& p : params_)
    if (p.scalar_type() != params_.front().scalar_type() || p.device() != params_.front().device())
      throw std::invalid_argument("dist.shard: the trainable parameters must share one dtype and one device");
  for (const ShardPiece& p : pieces_) {
    // A tensor of its own (no autograd history) on the parameter's storage: the optimizer updates the
    // parameter's values through it, and its .grad is set per step.
    views_.push_back(flat_values(params_[p.param].detach()).narrow(0, p.begin, p.numel()));
  }
}

void ParamShards::take_parameter_gradients() {
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const torch::Tensor& p = params_[pieces_[i].param];
    if (p.grad().defined() && p.grad().strides() != p.strides()) {  // rare: the gradient laid out as its weight
      torch::NoGradGuard no_grad;
      p.mutable_grad() = torch::empty_strided(p.sizes(), p.strides(), p.grad().options()).copy_(p.grad());
    }
    const torch::Tensor& g = p.grad();
    views_[i].mutable_grad() = g.defined() ? flat_values(g).narrow(0, pieces_[i].begin, pieces_[i].numel()) : torch::Tensor();
  }
}

void ParamShards::take_slice_gradients(const std::vector<torch::Tensor>& slices) {
  for (size_t i = 0; i < pieces_.size(); ++i)
    views_[i].mutable_grad() = slices.at(pieces_[i].bucket).narrow(0, pieces_[i].offset, pieces_[i].numel());
}

void ParamShards::drop_gradients() {
  for (auto& v : views_) v.mutable_grad() = torch::Tensor();
}

void ParamShards::allocate_staging() {
  if (staging_.defined()) return;
  int64_t most = 0;
  for (const auto& b : layout_.buckets()) most = std::max(most, b.slice);
  const auto opts = params_.empty() ? torch::TensorOptions() : params_.front().options().requires_grad(false);
  staging_ = torch::zeros({most * layout_.world()}, opts);
}

void ParamShards::gather() {
  torch::NoGradGuard no_grad;
  const auto& buckets = layout_.buckets();
  allocate_staging();
  const int64_t world = layout_.world();
  size_t next_piece = 0;
  for (size_t i = 0; i < buckets.size(); ++i) {
    const ShardBucket& b = buckets[i];
    // In place: this rank's slice is written where the gathered bucket holds it, and sent from there.
    torch::Tensor all = staging_.narrow(0, 0, world * b.slice), send = all.narrow(0, dist_.rank() * b.slice, b.slice);
    for (; next_piece < pieces_.size() && pieces_[next_piece].bucket == i; ++next_piece) {
      const ShardPiece& p = pieces_[next_piece];
      send.narrow(0, p.offset, p.numel()).copy_(views_[next_piece]);
    }
    dist_.all_gather_async(send, all, "parameter all-gather (bucket " + std::to_string(i) + ")")();
    for (size_t j = 0; j < b.params.size(); ++j) {
      const torch::Tensor& p = params_[b.params[j]];
      flat_values(p.detach()).copy_(all.narrow(0, b.offsets[j], p.numel()));
    }
  }
}

}  // namespace trainer
