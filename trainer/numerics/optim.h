// Optimizers and the learning-rate schedule.
//
// Optimizer holds what every optimizer shares (the parameters, the step count, the implementation, the
// state's names in checkpoints); each optimizer's arithmetic and state is a type of its own behind one
// interface (optim_rule.h: sgd.cpp, adamw.cpp, lamb.cpp).
//
// SGD (momentum, Nesterov, L2 weight decay) and AdamW (decoupled weight decay) with PyTorch's update
// rules, written so that a step is never left half-applied: step() first allocates every piece of state
// it will need (the only part that can run out of memory), then updates in place, allocating nothing.
// An out-of-memory error thrown from step() therefore leaves every parameter untouched, and the OOM
// handling can redo the whole optimizer step. (LibTorch's torch::optim updates parameter by parameter,
// allocating temporaries as it goes, so an OOM half way leaves some parameters updated and some not.)
//
// Two ways to apply the same update: parameter by parameter (a few kernels per tensor), or with the
// multi-tensor `_foreach_*` ops (a few kernels per step), as PyTorch's optimizers do by default on CUDA.
// ResNet-50 has 161 parameter tensors: one by one, the update is about 650 small kernel launches after
// the step's host sync, during which the GPU waits. On the CPU LibTorch runs the foreach ops tensor by
// tensor anyway, so the plain path is the default there and the foreach path is tested against it.
//
// A third way, optim.implementation: fused, is one fused kernel per group of tensors (at::_fused_sgd_,
// at::_fused_adamw_: LibTorch 2.4+, CPU and CUDA), which reads and writes each parameter, gradient and
// state tensor once instead of once per op: PyTorch's `fused=True`. Its arithmetic is the same update,
// rounded differently (AdamW's bias corrections in float32, weight decay as p - lr*wd*p); it uses the
// same state tensors, so checkpoints move between the three. Every step runs inside a profiler scope
// "Optimizer.step#SGD.step" / "Optimizer.step#AdamW.step", the names torch.optim gives its steps.
// The fused kernels also take a skip flag on the device (step_unless: PyTorch's found_inf), so that the
// step need not read its non-finite check on the host before the update (Step::update_then_read).
// The default for CUDA parameters (auto) is fused where LibTorch has it (2.4+: 1.035x GPT-2 small's step
// on an H200, docs/BENCHMARKS.md), foreach before.
//
// LAMB (optim.name: lamb) is timm's `Lamb` (timm/optim/lamb.py; NVIDIA's FusedLAMB, "NvLamb") with its
// defaults bias_correction and grad_averaging on, caution and decoupled_decay off: the gradients divided
// by max(1, global norm / optim.lamb_max_grad_norm); exp_avg.lerp_(g, 1 - beta1); exp_avg_sq = beta2 *
// exp_avg_sq + (1 - beta2) g^2; the update u = exp_avg / (sqrt(exp_avg_sq) + eps sqrt(bc2)) + wd / s * p
// with s = sqrt(bc2) / bc1; where the tensor decays (or optim.always_adapt), the trust ratio r =
// |p| / (s |u|), 1 where either norm is 0, at most 1 with optim.trust_clip; then p -= lr s r u (p -= lr s u
// without adaptation). These are the ops of timm's multi-tensor step (its default on CUDA), one tensor at a
// time: on the CPU the parameters are bitwise those of timm's Lamb(foreach=True) (tests/test_lamb.cpp). It
// runs plain only (no fused LibTorch kernel; the multi-tensor ops would allocate), so no CUDA graph. Its
// state is AdamW's (exp_avg, exp_avg_sq, step) plus a workspace of 4 floats per tensor that allocate_state()
// also allocates: the norms and trust ratios, written in place by the step. (On CUDA a norm over a large
// tensor takes a small staging block from the allocator's cache for its cross-block reduction: the one
// allocation left in the step.)
#pragma once

#include <torch/torch.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "trainer/config/config.h"
#include "trainer/numerics/optim_rule.h"

namespace trainer {

/// One trainable tensor with its dotted name and whether weight decay applies to it.
struct ParamSlot {
  std::string name;
  torch::Tensor param;
  bool decay = true;
};

/// The module's trainable parameters in registration order. Unless `decay_norm_and_bias`, tensors with
/// fewer than 2 dimensions (biases, BatchNorm/LayerNorm weights) get no weight decay.
std::vector<ParamSlot> param_slots(const torch::nn::Module& module, bool decay_norm_and_bias);

class Optimizer {
 public:
  /// How step() applies the update: cfg.implementation, with auto = fused for CUDA parameters where
  /// LibTorch has the kernels (foreach where it does not), plain otherwise. `foreach`, when given,
  /// overrides it: true = foreach, false = plain. Throws std::invalid_argument for fused where LibTorch
  /// lacks the kernels (compat::kHasFusedOptimizers), and for lamb with anything but plain or auto.
  Optimizer(std::vector<ParamSlot> params, const OptimConfig& cfg, std::optional<bool> foreach = std::nullopt);
  ~Optimizer();
  Optimizer(Optimizer&&) noexcept;
  Optimizer& operator=(Optimizer&&) noexcept;

  /// Drops every gradient (sets it to an undefined tensor, freeing its memory).
  void zero_grad();
  /// One update with learning rate `lr`. Gradients are consumed (overwritten in place).
  /// Throws c10::OutOfMemoryError only before any parameter changed.
  void step(double lr);
  /// Whether step_unless() can run: the fused kernels, which read a skip flag on the device.
  bool skips_on_device() const { return impl_ == OptimImpl::kFused; }
  /// The update of step(), left undone on the device where `skip` (a one-element float32 tensor on the
  /// parameters' device) holds 1: the step's caller needs no host read of its non-finite check before
  /// the update (PyTorch's found_inf for fused optimizers). steps() stays as it was until the caller, once
  /// it has read whether the step was skipped, calls commit_step(). Throws std::logic_error unless
  /// skips_on_device(); c10::OutOfMemoryError only before any kernel was launched.
  void step_unless(double lr, const torch::Tensor& skip);
  /// Counts a step_unless() that was not skipped (AdamW's bias correction of the next step reads the count).
  void commit_step() { ++steps_; }
  /// For a step captured as a CUDA graph (trainer/step/step_graph.h): writes `lr` and AdamW's step count
  /// (steps() + 1) into the device tensors that step_unless_device() reads, before each replay (and
  /// before the capture, which allocates them). Queued on the current stream; no host sync.
  void set_device_scalars(double lr);
  /// step_unless() with the learning rate and the step count read from the tensors of
  /// set_device_scalars() when the kernels run, so that a captured update replays with each step's values.
  /// The same arithmetic as step_unless(lr) (both round the rate to float32: see step_fused).
  void step_unless_device(const torch::Tensor& skip);
  /// Allocates the state step() needs (zero-filled) if not yet there. step() calls it; the trainer calls it
  /// early so that memory measurements include the optimizer state.
  void allocate_state();
  /// Completed steps (AdamW's and LAMB's bias corrections count these).
  int64_t steps() const { return steps_; }
  bool foreach() const { return impl_ == OptimImpl::kForeach; }
  /// The seed the stochastic rounding of bfloat16 weights draws from (optim.stochastic_rounding): the run's.
  void set_rounding_seed(uint64_t seed) { rule_->set_rounding_seed(seed); }
  /// The weights were converted to bfloat16 in place (memory.state auto, mid-run): from the next step they
  /// are updated by the float32 block loop and rounded back, stochastically when `stochastic`. Throws
  /// std::invalid_argument for an optimizer without that update (SGD, LAMB).
  void use_bfloat16_weights(bool stochastic);
  /// "plain", "foreach" or "fused": what step() runs.
  std::string implementation() const;

  const std::vector<ParamSlot>& params() const { return params_; }
  /// Data parallel with dist.shard (trainer/dist/shard.h): step() updates `pieces` instead of params(), and
  /// the state covers them only. Each piece is a flat tensor on its parameter's values (this rank's part
  /// of it), named as its parameter and decaying as it does; the caller sets their gradients before each
  /// step and gathers the updated parameters after it. Before the first step (std::logic_error after).
  /// `owner[i]` is piece i's index in params(); `sum` adds a host vector over the ranks (LAMB's norms of
  /// whole tensors from their pieces': every rank calls it in every step, with or without pieces).
  void shard(std::vector<ParamSlot> pieces, std::vector<size_t> owner, RankSum sum);
  bool sharded() const { return sharded_; }
  /// What step() updates: params(), or the pieces of shard().
  const std::vector<ParamSlot>& updated() const { return update_; }
  /// Every state tensor of updated() by name ("momentum_buffer.<param>", "exp_avg.<param>", "exp_avg_sq.<param>",
  /// with int8 state also "exp_avg_absmax.<param>" and "exp_avg_sq_absmax.<param>": moments.h; plus
  /// "step"), for checkpoints. LAMB's are AdamW's names; its workspace is not state.
  std::vector<std::pair<std::string, torch::Tensor>> state() const;
  /// Restores what state() returned. Moments saved in another optim.state_dtype are converted: the
  /// return says from what to what ("float32 to int8"), for the caller's warning; "" when nothing was.
  /// Throws std::runtime_error naming a missing or mis-shaped entry.
  std::string load_state(const std::map<std::string, torch::Tensor>& state);
  /// Bytes of the state tensors (state()'s, the step count aside).
  int64_t state_bytes() const;
  /// Stores AdamW's or LAMB's moments in `cfg.state_dtype` from now on, converting what they hold tensor by
  /// tensor (as a checkpoint of another dtype is loaded: float32 to int8 quantizes); the update runs plain.
  /// Returns what was converted ("float32 to int8"; "" before the first step, when there is nothing yet).
  /// Throws std::invalid_argument for SGD or float32; c10::OutOfMemoryError when one tensor's new moments
  /// do not fit (those converted stay converted; calling again goes on: AdamMoments::convert).
  std::string convert_state(const OptimConfig& cfg);

 private:
  /// The fused kernels with the rate `lr`, or with the tensors of set_device_scalars() when `from_device`.
  void step_fused(double lr, const torch::Tensor& skip = {}, bool from_device = false);

  std::vector<ParamSlot> params_;
  std::vector<ParamSlot> update_;  // what the rule updates: params_, or this rank's pieces (shard())
  bool sharded_ = false;
  std::unique_ptr<OptimizerRule> rule_;  // sgd, adamw or lamb: its arithmetic and its state
  int64_t steps_ = 0;
  OptimImpl impl_ = OptimImpl::kPlain;  // what step() runs: plain, foreach or fused (auto resolved)
  torch::Tensor fused_step_;  // fused AdamW: the step count as a float32 scalar on the parameters' device
  torch::Tensor device_lr_;   // set_device_scalars(): the rate as a float32 one-element tensor there
};

/// Global L2 norm of the gradients (as PyTorch's clip_grad_norm_ computes it); if `max_norm` > 0 and the
/// norm exceeds it, scales the gradients in place to `max_norm`. Returns the norm before clipping as a
/// 0-dim tensor on the gradients' device (no host sync). `foreach`: the per-tensor norms with one
/// multi-tensor op (default: when the gradients are on a CUDA device).
torch::Tensor clip_grad_norm(const std::vector<ParamSlot>& params, double max_norm,
                             std::optional<bool> foreach = std::nullopt);

/// Learning rate for the optimizer step with 0-based index `step` of `total_steps`: linear warmup over
/// `warmup_steps` from lr/warmup to lr, then constant, cosine to schedule.min_lr, or step decay.
double learning_rate(const ScheduleConfig& schedule, double peak_lr, int64_t step, int64_t total_steps,
                     int64_t warmup_steps);

}  // namespace trainer
