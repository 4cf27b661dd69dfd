#include "trainer/numerics/optim.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <tuple>

#include "common/compat.h"

namespace trainer {

namespace {
bool on_cuda(const std::vector<ParamSlot>& params) { return !params.empty() && params.front().param.is_cuda(); }
bool any_bfloat16(const std::vector<ParamSlot>& params) {
  return std::any_of(params.begin(), params.end(), [](const ParamSlot& s) { return s.param.scalar_type() == torch::kBFloat16; });
}
}  // namespace

std::vector<ParamSlot> param_slots(const torch::nn::Module& module, bool decay_norm_and_bias) {
  std::vector<ParamSlot> out;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    bool decay = decay_norm_and_bias || item.value().dim() >= 2;
    out.push_back({item.key(), item.value(), decay});
  }
  return out;
}

Optimizer::Optimizer(std::vector<ParamSlot> params, const OptimConfig& cfg, std::optional<bool> foreach)
    : params_(std::move(params)), update_(params_), rule_(make_optimizer_rule(cfg)) {
  const OptimImpl impl = foreach ? (*foreach ? OptimImpl::kForeach : OptimImpl::kPlain) : cfg.implementation;
  if (any_bfloat16(params_)) {
    // bfloat16 weights: the update in float32, rounded back, by AdamW's block loop (adamw.cpp), plain.
    if (!rule_->updates_bfloat16_weights())
      throw std::invalid_argument("model.param_dtype: bfloat16 weights are updated by AdamW in float32 and rounded "
                                  "back; " + rule_->name() + " has no such update (use optim.name adamw, or float32)");
    if (impl != OptimImpl::kAuto && impl != OptimImpl::kPlain)
      throw std::invalid_argument("optim.implementation: " + mode_name(impl) + " updates in the weights' dtype; "
                                  "bfloat16 weights run their own float32 block update (use auto or plain)");
    impl_ = OptimImpl::kPlain;
    return;
  }
  if (cfg.state_dtype != StateDtype::kFloat32) {
    // Moments in bfloat16 or int8 are updated by their own block loop (moments.h), which is plain.
    if (impl != OptimImpl::kAuto && impl != OptimImpl::kPlain)
      throw std::invalid_argument("optim.implementation: " + mode_name(impl) + " keeps float32 moments; optim.state_dtype " +
                                  mode_name(cfg.state_dtype) + " runs its own block update (use auto or plain)");
    impl_ = OptimImpl::kPlain;
    return;
  }
  if (!rule_->has_foreach() && !rule_->has_fused()) {
    if (impl != OptimImpl::kAuto && impl != OptimImpl::kPlain)
      throw std::invalid_argument("optim.implementation: " + mode_name(impl) + " has no " + rule_->name() +
                                  " version (" + rule_->name() + " runs plain); use auto or plain");
    impl_ = OptimImpl::kPlain;
    return;
  }
  // auto: the fused kernels on CUDA where LibTorch has them (1.035x GPT-2's step on an H200, 1.014x
  // ResNet-50's: docs/BENCHMARKS.md), else the multi-tensor ops; on the CPU the plain loop.
  if (impl == OptimImpl::kAuto)
    impl_ = !on_cuda(params_) ? OptimImpl::kPlain : compat::kHasFusedOptimizers ? OptimImpl::kFused : OptimImpl::kForeach;
  else
    impl_ = impl;
  if (impl_ == OptimImpl::kFused && !compat::kHasFusedOptimizers)
    throw std::invalid_argument("optim.implementation: fused needs LibTorch 2.4 or later (this is " +
                                compat::torch_version() + "); use auto, plain or foreach");
}

Optimizer::~Optimizer() = default;
Optimizer::Optimizer(Optimizer&&) noexcept = default;
Optimizer& Optimizer::operator=(Optimizer&&) noexcept = default;

std::string Optimizer::implementation() const { return mode_name(impl_); }

void Optimizer::zero_grad() {
  for (auto& s : params_) s.param.mutable_grad() = torch::Tensor();
  if (sharded_)
    for (auto& s : update_) s.param.mutable_grad() = torch::Tensor();
}

void Optimizer::shard(std::vector<ParamSlot> pieces, std::vector<size_t> owner, RankSum sum) {
  if (steps_ > 0 || state_bytes() > 0)
    throw std::logic_error("Optimizer::shard: the update is restricted before any state exists");
  if (owner.size() != pieces.size() || !sum) throw std::invalid_argument("Optimizer::shard: an owner per piece and a sum");
  update_ = std::move(pieces);
  sharded_ = true;
  rule_->set_sharding(std::move(owner), params_.size(), std::move(sum));
}

void Optimizer::allocate_state() { rule_->allocate_state(update_); }

void Optimizer::step(double lr) {
  // The scope torch.optim records its steps under: bench/profile_table.py classes the kernels in it.
  RECORD_USER_SCOPE(rule_->scope());
  allocate_state();  // may throw OOM: nothing has changed yet
  torch::NoGradGuard no_grad;
  if (impl_ == OptimImpl::kFused) step_fused(lr);
  else if (impl_ == OptimImpl::kForeach) rule_->step_foreach(update_, lr, steps_ + 1);
  else rule_->step_plain(update_, lr, steps_ + 1);
  ++steps_;
}

void Optimizer::step_unless(double lr, const torch::Tensor& skip) {
  if (impl_ != OptimImpl::kFused) throw std::logic_error("Optimizer::step_unless: needs optim.implementation fused");
  RECORD_USER_SCOPE(rule_->scope());
  allocate_state();  // may throw OOM: nothing has changed yet
  torch::NoGradGuard no_grad;
  step_fused(lr, skip);
}

void Optimizer::set_device_scalars(double lr) {
  if (impl_ != OptimImpl::kFused) throw std::logic_error("Optimizer::set_device_scalars: needs optim.implementation fused");
  const auto device = params_.empty() ? torch::Device(torch::kCPU) : params_.front().param.device();
  const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(device);
  if (!device_lr_.defined() || device_lr_.device() != device) device_lr_ = torch::zeros({1}, opts);
  if (!fused_step_.defined() || fused_step_.device() != device) fused_step_ = torch::zeros({}, opts);
  device_lr_.fill_(lr);
  fused_step_.fill_(static_cast<double>(steps_ + 1));
}

void Optimizer::step_unless_device(const torch::Tensor& skip) {
  if (impl_ != OptimImpl::kFused || !device_lr_.defined())
    throw std::logic_error("Optimizer::step_unless_device: needs optim.implementation fused and set_device_scalars()");
  RECORD_USER_SCOPE(rule_->scope());
  allocate_state();
  torch::NoGradGuard no_grad;
  step_fused(0.0, skip, /*from_device=*/true);
}

// The rate is rounded to float32 on both paths: the kernels read a tensor rate as float32 and widen it to
// double, a scalar rate they take as double. Rounded alike, a step captured in a CUDA graph (the tensor,
// step_unless_device) and the same step run eagerly (the scalar) compute the same bits.
void Optimizer::step_fused(double lr, const torch::Tensor& skip, bool from_device) {
  FusedScalars s;
  s.lr = static_cast<double>(static_cast<float>(lr));
  s.t = steps_ + 1;
  s.from_device = from_device;
  s.device_lr = &device_lr_;
  s.step = &fused_step_;
  rule_->step_fused(update_, s, skip);
}

std::vector<std::pair<std::string, torch::Tensor>> Optimizer::state() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const StateBuffers& b : rule_->state_buffers())
    for (size_t i = 0; i < b.tensors->size(); ++i)
      if ((*b.tensors)[i].defined()) out.emplace_back(b.prefix + update_[i].name, (*b.tensors)[i]);
  out.emplace_back("step", torch::tensor(steps_, torch::kInt64));
  return out;
}

int64_t Optimizer::state_bytes() const {
  int64_t total = 0;
  for (const StateBuffers& b : rule_->state_buffers())
    for (const torch::Tensor& t : *b.tensors)
      if (t.defined()) total += t.numel() * static_cast<int64_t>(t.element_size());
  return total;
}

std::string Optimizer::load_state(const std::map<std::string, torch::Tensor>& state) {
  auto it = state.find("step");
  if (it == state.end()) throw std::runtime_error("optimizer state: missing entry 'step'");
  steps_ = it->second.item<int64_t>();
  for (const StateBuffers& b : rule_->state_buffers()) b.tensors->clear();
  if (steps_ == 0) return "";
  allocate_state();
  return rule_->load_state(state, update_);
}

void Optimizer::use_bfloat16_weights(bool stochastic) {
  if (!rule_->updates_bfloat16_weights())
    throw std::invalid_argument("model.param_dtype: bfloat16 weights are updated by AdamW in float32 and rounded back; " +
                                rule_->name() + " has no such update");
  rule_->set_stochastic_rounding(stochastic);
  impl_ = OptimImpl::kPlain;  // the block loop (adamw.cpp)
}

std::string Optimizer::convert_state(const OptimConfig& cfg) {
  if (cfg.name == OptimKind::kSgd || cfg.state_dtype == StateDtype::kFloat32)
    throw std::invalid_argument("convert_state: moments in fewer bytes are AdamW's and LAMB's (got " +
                                mode_name(cfg.name) + ", " + mode_name(cfg.state_dtype) + ")");
  const std::string what = rule_->convert_state(cfg.state_dtype, update_);
  impl_ = OptimImpl::kPlain;  // low-precision moments run their own block update
  return what;
}

torch::Tensor clip_grad_norm(const std::vector<ParamSlot>& params, double max_norm, std::optional<bool> foreach) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  for (const auto& s : params)
    if (s.param.grad().defined()) grads.push_back(s.param.grad());
  if (grads.empty()) return torch::zeros({});
  const bool multi = foreach.value_or(grads.front().is_cuda());
  std::vector<torch::Tensor> norms;
  if (multi) {
    norms = at::_foreach_norm(grads, 2);
    for (auto& n : norms) n = n.to(torch::kFloat);
  } else {
    for (const auto& g : grads) norms.push_back(g.norm(2).to(torch::kFloat));
  }
  torch::Tensor total = torch::stack(norms).norm(2);
  if (max_norm > 0) {
    // As PyTorch: multiply by min(1, max_norm / (norm + 1e-6)), without a host sync.
    torch::Tensor coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
    if (multi) {
      compat::foreach_mul_(grads, coef);
    } else {
      for (auto& g : grads) g.mul_(coef.to(g.dtype()));
    }
  }
  return total;
}

double learning_rate(const ScheduleConfig& schedule, double peak_lr, int64_t step, int64_t total_steps,
                     int64_t warmup_steps) {
  if (step < warmup_steps) return peak_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (schedule.name == ScheduleKind::kCosine) {
    int64_t span = std::max<int64_t>(1, total_steps - warmup_steps);
    double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / static_cast<double>(span));
    return schedule.min_lr + (peak_lr - schedule.min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
  }
  if (schedule.name == ScheduleKind::kStep) {
    double lr = peak_lr;
    for (int64_t m : schedule.milestones)
      if (step >= m) lr *= schedule.gamma;
    return lr;
  }
  return peak_lr;  // constant
}

}  // namespace trainer
