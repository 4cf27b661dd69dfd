// One optimizer's arithmetic and state, behind one interface: SGD (sgd.cpp), AdamW (adamw.cpp) and LAMB
// (lamb.cpp), as torch::optim has one class per optimizer. Optimizer (optim.h) holds one of them and does
// what they share: the parameters, the step count, the choice of implementation, the profiler scope,
// allocating the state before any parameter changes, and the state's names in a checkpoint.
//
// A rule's step methods update in place and allocate nothing: Optimizer calls allocate_state() first, the
// only part that can run out of memory.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "trainer/config/config.h"

namespace trainer {

struct ParamSlot;  // optim.h

/// What a fused step reads its rate and step count from: the host's values, or (`from_device`, a step
/// captured as a CUDA graph) the tensors Optimizer::set_device_scalars fills before each replay.
struct FusedScalars {
  double lr = 0;              ///< rounded to float32 (see Optimizer::step_fused)
  int64_t t = 1;              ///< the step being taken: completed steps + 1
  bool from_device = false;
  torch::Tensor* device_lr = nullptr;  ///< (1) float32 on the parameters' device
  torch::Tensor* step = nullptr;       ///< () float32: t for every parameter (AdamW's kernel reads it)
};

/// A state tensor per parameter under one name: "<prefix><parameter's name>" in a checkpoint.
struct StateBuffers {
  const char* prefix;
  std::vector<torch::Tensor>* tensors;  ///< empty until allocated; else one per parameter
};

/// A sum over the data-parallel ranks, in place, of a vector of host values.
using RankSum = std::function<void(std::vector<double>&)>;

class OptimizerRule {
 public:
  explicit OptimizerRule(const OptimConfig& cfg) : cfg_(cfg) {}
  virtual ~OptimizerRule() = default;

  /// optim.name's value: "sgd", "adamw", "lamb".
  const std::string& name() const { return mode_name(cfg_.name); }
  /// The profiler scope torch.optim (timm for LAMB) records its steps under.
  virtual const char* scope() const = 0;
  /// Whether the multi-tensor and the fused implementations exist for this rule.
  virtual bool has_foreach() const { return true; }
  virtual bool has_fused() const { return true; }

  /// The state the steps need, zero-filled, where it is not there yet.
  virtual void allocate_state(const std::vector<ParamSlot>& params) = 0;
  /// The update of step `t` (1-based) at rate `lr`, tensor by tensor.
  virtual void step_plain(const std::vector<ParamSlot>& params, double lr, int64_t t) = 0;
  /// The same update with the multi-tensor `_foreach_*` ops. Only where has_foreach().
  virtual void step_foreach(const std::vector<ParamSlot>& params, double lr, int64_t t);
  /// The same update with one fused kernel per group, left undone where `skip` holds 1. Only where
  /// has_fused().
  virtual void step_fused(const std::vector<ParamSlot>& params, const FusedScalars& s, const torch::Tensor& skip);

  /// The state tensors a checkpoint holds, in their order there (an undefined tensor: no entry).
  virtual std::vector<StateBuffers> state_buffers() = 0;
  /// Restores state_buffers() from a checkpoint's entries after allocate_state(): each entry copied into
  /// its tensor. Returns what was converted on the way ("" when nothing: AdamMoments converts another
  /// optim.state_dtype). Throws std::runtime_error naming a missing or mis-shaped entry.
  virtual std::string load_state(const std::map<std::string, torch::Tensor>& state, const std::vector<ParamSlot>& params);
  /// Holds the state in `dtype` from now on, converting it tensor by tensor (AdamW, LAMB: AdamMoments::convert).
  /// Returns what was converted ("" when there is no state yet). Default: std::invalid_argument (SGD).
  virtual std::string convert_state(StateDtype dtype, const std::vector<ParamSlot>& params);
  /// Whether the rule updates bfloat16 weights in float32 and rounds them back (AdamW).
  virtual bool updates_bfloat16_weights() const { return false; }
  /// Data parallel with dist.shard: the rule updates pieces of the parameters (Optimizer::shard); owner[i]
  /// is piece i's parameter among `count`, and `sum` adds a host vector over the ranks in place (every rank
  /// calls it at the same point of every step). LAMB sums its per-tensor norms with it.
  void set_sharding(std::vector<size_t> owner, size_t count, RankSum sum) {
    owner_ = std::move(owner);
    owner_count_ = count;
    rank_sum_ = std::move(sum);
  }
  bool sharded() const { return static_cast<bool>(rank_sum_); }
  /// The run's seed, which the stochastic rounding of bfloat16 weights draws its bits from.
  void set_rounding_seed(uint64_t seed) { rounding_seed_ = seed; }
  void set_stochastic_rounding(bool on) { cfg_.stochastic_rounding = on; }

 protected:
  OptimConfig cfg_;
  uint64_t rounding_seed_ = 0;
  std::vector<size_t> owner_;  // sharded: each updated piece's parameter
  size_t owner_count_ = 0;
  RankSum rank_sum_;           // sharded: the sum over the ranks (empty: one process or whole tensors)
};

/// The rule of optim.name.
std::unique_ptr<OptimizerRule> make_optimizer_rule(const OptimConfig& cfg);

// The rules, one file each.
std::unique_ptr<OptimizerRule> make_sgd(const OptimConfig& cfg);    // sgd.cpp
std::unique_ptr<OptimizerRule> make_adamw(const OptimConfig& cfg);  // adamw.cpp
std::unique_ptr<OptimizerRule> make_lamb(const OptimConfig& cfg);   // lamb.cpp

// ---- what the rules share ----------------------------------------------------------------------------

/// The indices of the parameters that have a gradient, in order.
std::vector<size_t> with_gradient(const std::vector<ParamSlot>& params);

/// The parameters that have a gradient, grouped by (device, dtype, weight decay) in order of first
/// appearance: the fused kernels take one weight decay and one device and dtype per call.
struct FusedGroup {
  bool decays = false;
  c10::Device device = torch::kCPU;
  std::vector<size_t> index;
};
std::vector<FusedGroup> fused_groups(const std::vector<ParamSlot>& params);

/// `tensors` zero-filled like each parameter (their memory format kept), unless already one per parameter.
void allocate_like(std::vector<torch::Tensor>& tensors, const std::vector<ParamSlot>& params);

/// The tensors of `from` at `index`, in that order; none when `from` is empty (a state not kept).
std::vector<torch::Tensor> pick(const std::vector<torch::Tensor>& from, const std::vector<size_t>& index);

}  // namespace trainer
