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
    : params_(std::move(params)), cfg_(cfg) {
  TORCH_CHECK(cfg_.name == "sgd" || cfg_.name == "adamw" || cfg_.name == "lamb", "optim.name: unknown optimizer '",
              cfg_.name, "'");
  const std::string& impl = cfg_.implementation;
  if (cfg_.name == "lamb") {
    // No fused LAMB kernel in LibTorch; the multi-tensor ops would allocate their results mid-step.
    if (foreach.value_or(false) || (!foreach && impl != "auto" && impl != "plain"))
      throw std::invalid_argument("optim.implementation: " + (foreach ? std::string("foreach") : impl) +
                                  " has no lamb version (lamb runs plain); use auto or plain");
    impl_ = Impl::plain;
    return;
  }
  if (foreach) impl_ = *foreach ? Impl::foreach : Impl::plain;
  // auto: the fused kernels on CUDA where LibTorch has them (1.035x GPT-2's step on an H200, 1.014x
  // ResNet-50's: docs/BENCHMARKS.md), else the multi-tensor ops; on the CPU the plain loop.
  else if (impl == "auto")
    impl_ = !on_cuda(params_) ? Impl::plain : compat::kHasFusedOptimizers ? Impl::fused : Impl::foreach;
  else if (impl == "plain") impl_ = Impl::plain;
  else if (impl == "foreach") impl_ = Impl::foreach;
  else if (impl == "fused") impl_ = Impl::fused;
  else
    throw std::invalid_argument("optim.implementation: unknown value '" + impl + "'; use auto, plain, foreach or fused");
  if (impl_ == Impl::fused && !compat::kHasFusedOptimizers)
    throw std::invalid_argument("optim.implementation: fused needs LibTorch 2.4 or later (this is " +
                                compat::torch_version() + "); use auto, plain or foreach");
}

std::string Optimizer::implementation() const {
  return impl_ == Impl::fused ? "fused" : impl_ == Impl::foreach ? "foreach" : "plain";
}

const char* Optimizer::scope_name() const {
  return cfg_.name == "sgd" ? "Optimizer.step#SGD.step" : cfg_.name == "lamb" ? "Optimizer.step#Lamb.step"
                                                                             : "Optimizer.step#AdamW.step";
}

void Optimizer::zero_grad() {
  for (auto& s : params_) s.param.mutable_grad() = torch::Tensor();
}

void Optimizer::allocate_state() {
  // State is allocated zero-filled: a zero momentum buffer gives PyTorch's first-step value
  // (buf = grad) under buf = momentum * buf + grad, and zero Adam moments are PyTorch's initial state.
  bool sgd = cfg_.name == "sgd";
  bool need1 = !sgd || cfg_.momentum > 0;
  bool need2 = !sgd;
  if (need1 && buf1_.size() != params_.size()) {
    std::vector<torch::Tensor> b;
    for (auto& s : params_) b.push_back(torch::zeros_like(s.param, at::MemoryFormat::Preserve));
    buf1_ = std::move(b);
  }
  if (need2 && buf2_.size() != params_.size()) {
    std::vector<torch::Tensor> b;
    for (auto& s : params_) b.push_back(torch::zeros_like(s.param, at::MemoryFormat::Preserve));
    buf2_ = std::move(b);
  }
  const int64_t n = static_cast<int64_t>(params_.size());
  if (cfg_.name == "lamb" && (!lamb_work_.defined() || lamb_work_.numel() != 4 * n + 2)) {
    const auto device = params_.empty() ? torch::Device(torch::kCPU) : params_.front().param.device();
    lamb_work_ = torch::zeros({4 * n + 2}, torch::TensorOptions().dtype(torch::kFloat).device(device));
    lamb_mask_ = torch::zeros({n}, torch::TensorOptions().dtype(torch::kBool).device(device));
  }
}

void Optimizer::step(double lr) {
  // The scope torch.optim records its steps under: bench/profile_table.py classes the kernels in it.
  RECORD_USER_SCOPE(scope_name());
  allocate_state();  // may throw OOM: nothing has changed yet
  torch::NoGradGuard no_grad;
  if (cfg_.name == "lamb") {
    step_lamb(lr);
    ++steps_;
    return;
  }
  if (impl_ != Impl::plain) {
    if (impl_ == Impl::fused) step_fused(lr);
    else step_foreach(lr);
    ++steps_;
    return;
  }
  const double wd = cfg_.weight_decay;
  if (cfg_.name == "sgd") {
    const double m = cfg_.momentum;
    for (size_t i = 0; i < params_.size(); ++i) {
      auto& p = params_[i].param;
      torch::Tensor g = p.grad();
      if (!g.defined()) continue;
      if (wd != 0 && params_[i].decay) g.add_(p, wd);
      if (m > 0) {
        auto& buf = buf1_[i];
        buf.mul_(m).add_(g);
        if (cfg_.nesterov) g.add_(buf, m);
        else g = buf;
      }
      p.add_(g, -lr);
    }
  } else {  // adamw
    const double b1 = cfg_.beta1, b2 = cfg_.beta2;
    const double t = static_cast<double>(steps_ + 1);
    const double bc1 = 1 - std::pow(b1, t);
    const double bc2_sqrt = std::sqrt(1 - std::pow(b2, t));
    for (size_t i = 0; i < params_.size(); ++i) {
      auto& p = params_[i].param;
      torch::Tensor g = p.grad();
      if (!g.defined()) continue;
      if (wd != 0 && params_[i].decay) p.mul_(1 - lr * wd);
      buf1_[i].mul_(b1).add_(g, 1 - b1);
      buf2_[i].mul_(b2).addcmul_(g, g, 1 - b2);
      // The gradient is no longer needed: it becomes the denominator, so nothing is allocated.
      g.copy_(buf2_[i]).sqrt_().div_(bc2_sqrt).add_(cfg_.eps);
      p.addcdiv_(buf1_[i], g, -lr / bc1);
    }
  }
  ++steps_;
}

namespace {

// The L2 norm of `t` into the 0-dim float32 `out` (no allocation: the out= variant), as torch.linalg.vector_norm.
void norm_into(torch::Tensor out, const torch::Tensor& t) {
  const auto dtype = t.scalar_type() == torch::kFloat ? c10::optional<at::ScalarType>() : torch::kFloat;
  at::linalg_vector_norm_out(out, t, 2, at::OptionalIntArrayRef(), false, dtype);
}

}  // namespace

torch::Tensor Optimizer::lamb_clip_divisor(const std::vector<size_t>& live) {
  // timm: global = vector_norm(stack(per-tensor norms)); divisor = (global / max_grad_norm).clamp_(min=1).
  // The norms in the order of timm's param groups (param_groups_weight_decay: the tensors without decay,
  // then those with; one group when weight_decay is 0), so that their sum rounds as timm's.
  const int64_t n = static_cast<int64_t>(params_.size()), k = static_cast<int64_t>(live.size());
  const torch::Tensor norms = lamb_work_.narrow(0, 0, n);
  std::vector<size_t> order;
  for (int pass = 0; pass < 2; ++pass)
    for (size_t i : live)
      if (cfg_.weight_decay == 0 ? pass == 0 : params_[i].decay == (pass == 1)) order.push_back(i);
  for (int64_t j = 0; j < k; ++j) norm_into(norms[j], params_[order[j]].param.grad());
  const torch::Tensor global = lamb_work_[4 * n], divisor = lamb_work_[4 * n + 1];
  norm_into(global, norms.narrow(0, 0, k));
  divisor.copy_(global).div_(cfg_.lamb_max_grad_norm).clamp_min_(1.0);
  return divisor;
}

// timm's _multi_tensor_lamb op for op, one tensor at a time, in place: the gradient becomes the denominator,
// then the update; the norms and trust ratios go to the workspace. Nothing is allocated (see optim.h).
void Optimizer::step_lamb(double lr) {
  std::vector<size_t> live;  // the tensors that have a gradient
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].param.grad().defined()) live.push_back(i);
  if (live.empty()) return;
  const int64_t n = static_cast<int64_t>(params_.size()), k = static_cast<int64_t>(live.size());
  const torch::Tensor divisor = cfg_.lamb_max_grad_norm > 0 ? lamb_clip_divisor(live) : torch::Tensor();
  const double b1 = cfg_.beta1, b2 = cfg_.beta2, wd = cfg_.weight_decay;
  const double t = static_cast<double>(steps_ + 1);
  const double bc1 = 1 - std::pow(b1, t);
  const double bc2_sqrt = std::pow(1 - std::pow(b2, t), 0.5);  // Python's `bc2 ** 0.5`: the same libm call
  const double scale = bc2_sqrt / bc1;  // the bias corrections, folded into scalars as timm does
  torch::Tensor w_norm = lamb_work_.narrow(0, n, k), u_norm = lamb_work_.narrow(0, 2 * n, k);
  torch::Tensor ratio = lamb_work_.narrow(0, 3 * n, k), mask = lamb_mask_.narrow(0, 0, k);
  std::vector<bool> adapt(k);
  for (int64_t j = 0; j < k; ++j) {
    const ParamSlot& s = params_[live[j]];
    torch::Tensor g = s.param.grad();
    auto& m = buf1_[live[j]];
    auto& v = buf2_[live[j]];
    if (divisor.defined()) g.div_(divisor);
    m.lerp_(g, 1 - b1);
    v.mul_(b2).addcmul_(g, g, 1 - b2);
    g.copy_(v).sqrt_().add_(cfg_.eps * bc2_sqrt);
    at::div_out(g, m, g);  // the update, unscaled: m / (sqrt(v) + eps sqrt(bc2))
    const bool decays = s.decay && wd != 0;
    if (decays) g.add_(s.param, wd / scale);
    adapt[j] = decays || cfg_.always_adapt;
    if (adapt[j]) {
      norm_into(w_norm[j], s.param);
      norm_into(u_norm[j], g);
    }
  }
  // The trust ratios of all tensors at once (timm: _lamb_trust_ratio(w, u * scale) * (-lr * scale)); the
  // entries of tensors that do not adapt are computed too, and not read.
  u_norm.mul_(scale);
  at::div_out(ratio, w_norm, u_norm);
  at::gt_out(mask, u_norm, 0).logical_not_();
  ratio.masked_fill_(mask, 1.0);
  at::gt_out(mask, w_norm, 0).logical_not_();
  ratio.masked_fill_(mask, 1.0);
  if (cfg_.trust_clip) ratio.clamp_max_(1.0);
  ratio.mul_(-lr * scale);
  for (int64_t j = 0; j < k; ++j) {
    auto& p = params_[live[j]].param;
    if (adapt[j]) p.addcmul_(p.grad(), ratio[j]);
    else p.add_(p.grad(), -lr * scale);
  }
}

void Optimizer::step_unless(double lr, const torch::Tensor& skip) {
  if (impl_ != Impl::fused) throw std::logic_error("Optimizer::step_unless: needs optim.implementation fused");
  RECORD_USER_SCOPE(scope_name());
  allocate_state();  // may throw OOM: nothing has changed yet
  torch::NoGradGuard no_grad;
  step_fused(lr, skip);
}

// The same update as the plain loop above, op for op, each op over all tensors at once.
void Optimizer::step_foreach(double lr) {
  std::vector<torch::Tensor> p, g, m1, m2, p_decay, g_decay;  // the tensors that have a gradient
  for (size_t i = 0; i < params_.size(); ++i) {
    const torch::Tensor grad = params_[i].param.grad();
    if (!grad.defined()) continue;
    p.push_back(params_[i].param);
    g.push_back(grad);
    if (!buf1_.empty()) m1.push_back(buf1_[i]);
    if (!buf2_.empty()) m2.push_back(buf2_[i]);
    if (params_[i].decay) {
      p_decay.push_back(params_[i].param);
      g_decay.push_back(grad);
    }
  }
  if (p.empty()) return;
  const double wd = cfg_.weight_decay;
  if (cfg_.name == "sgd") {
    const double m = cfg_.momentum;
    if (wd != 0 && !p_decay.empty()) at::_foreach_add_(g_decay, p_decay, wd);
    const std::vector<torch::Tensor>* update = &g;
    if (m > 0) {
      at::_foreach_mul_(m1, m);
      at::_foreach_add_(m1, g);
      if (cfg_.nesterov) at::_foreach_add_(g, m1, m);
      else update = &m1;
    }
    at::_foreach_add_(p, *update, -lr);
  } else {  // adamw
    const double b1 = cfg_.beta1, b2 = cfg_.beta2;
    const double t = static_cast<double>(steps_ + 1);
    const double bc1 = 1 - std::pow(b1, t);
    const double bc2_sqrt = std::sqrt(1 - std::pow(b2, t));
    if (wd != 0 && !p_decay.empty()) at::_foreach_mul_(p_decay, 1 - lr * wd);
    at::_foreach_mul_(m1, b1);
    at::_foreach_add_(m1, g, 1 - b1);
    at::_foreach_mul_(m2, b2);
    at::_foreach_addcmul_(m2, g, g, 1 - b2);
    compat::foreach_copy_(g, m2);  // the gradients become the denominators
    at::_foreach_sqrt_(g);
    at::_foreach_div_(g, bc2_sqrt);
    at::_foreach_add_(g, cfg_.eps);
    at::_foreach_addcdiv_(p, m1, g, -lr / bc1);
  }
}

void Optimizer::set_device_scalars(double lr) {
  if (impl_ != Impl::fused) throw std::logic_error("Optimizer::set_device_scalars: needs optim.implementation fused");
  const auto device = params_.empty() ? torch::Device(torch::kCPU) : params_.front().param.device();
  const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(device);
  if (!device_lr_.defined() || device_lr_.device() != device) device_lr_ = torch::zeros({1}, opts);
  if (!fused_step_.defined() || fused_step_.device() != device) fused_step_ = torch::zeros({}, opts);
  device_lr_.fill_(lr);
  fused_step_.fill_(static_cast<double>(steps_ + 1));
}

void Optimizer::step_unless_device(const torch::Tensor& skip) {
  if (impl_ != Impl::fused || !device_lr_.defined())
    throw std::logic_error("Optimizer::step_unless_device: needs optim.implementation fused and set_device_scalars()");
  RECORD_USER_SCOPE(scope_name());
  allocate_state();
  torch::NoGradGuard no_grad;
  step_fused(0.0, skip, /*from_device=*/true);
}

// The same update in one fused kernel per (device, dtype) group and weight-decay setting (the kernels
// take one weight decay for all their tensors).
//
// The rate is rounded to float32 on both paths: the kernels read a tensor rate as float32 and widen it to
// double, a scalar rate they take as double. Rounded alike, a step captured in a CUDA graph (the tensor,
// step_unless_device) and the same step run eagerly (the scalar) compute the same bits.
void Optimizer::step_fused(double lr, const torch::Tensor& skip, bool from_device) {
  lr = static_cast<double>(static_cast<float>(lr));
  struct Group {
    std::vector<torch::Tensor> p, g, m1, m2;
  };
  // (device, dtype, decays) -> tensors that have a gradient
  std::vector<std::pair<std::tuple<c10::Device, at::ScalarType, bool>, Group>> groups;
  for (size_t i = 0; i < params_.size(); ++i) {
    const torch::Tensor grad = params_[i].param.grad();
    if (!grad.defined()) continue;
    const auto& p = params_[i].param;
    const std::tuple<c10::Device, at::ScalarType, bool> key{p.device(), p.scalar_type(), params_[i].decay};
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& e) { return e.first == key; });
    if (it == groups.end()) it = groups.insert(groups.end(), {key, {}});
    it->second.p.push_back(p);
    it->second.g.push_back(grad);
    if (!buf1_.empty()) it->second.m1.push_back(buf1_[i]);
    if (!buf2_.empty()) it->second.m2.push_back(buf2_[i]);
  }
  for (auto& [key, grp] : groups) {
    const double wd = std::get<2>(key) ? cfg_.weight_decay : 0.0;
    if (cfg_.name == "sgd") {
      if (from_device) compat::fused_sgd_(grp.p, grp.g, grp.m1, wd, cfg_.momentum, device_lr_, cfg_.nesterov, skip);
      else compat::fused_sgd_(grp.p, grp.g, grp.m1, wd, cfg_.momentum, lr, cfg_.nesterov, skip);
    } else {
      // The kernel reads the step count from a float32 tensor per parameter (torch.optim increments its
      // own before the call); one tensor, filled once per step, serves them all: the kernel only reads it.
      // From the device, set_device_scalars() filled it before the replay.
      const auto& device = std::get<0>(key);
      if (!from_device) {
        if (!fused_step_.defined() || fused_step_.device() != device)
          fused_step_ = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat).device(device));
        fused_step_.fill_(static_cast<double>(steps_ + 1));
      }
      const std::vector<torch::Tensor> steps(grp.p.size(), fused_step_);
      if (from_device)
        compat::fused_adamw_(grp.p, grp.g, grp.m1, grp.m2, steps, device_lr_, cfg_.beta1, cfg_.beta2, wd, cfg_.eps, skip);
      else compat::fused_adamw_(grp.p, grp.g, grp.m1, grp.m2, steps, lr, cfg_.beta1, cfg_.beta2, wd, cfg_.eps, skip);
    }
  }
}

std::vector<std::pair<std::string, torch::Tensor>> Optimizer::state() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  const char* n1 = cfg_.name == "sgd" ? "momentum_buffer." : "exp_avg.";  // adamw, lamb
  for (size_t i = 0; i < buf1_.size(); ++i) out.emplace_back(n1 + params_[i].name, buf1_[i]);
  for (size_t i = 0; i < buf2_.size(); ++i) out.emplace_back("exp_avg_sq." + params_[i].name, buf2_[i]);
  out.emplace_back("step", torch::tensor(steps_, torch::kInt64));
  return out;
}

void Optimizer::load_state(const std::map<std::string, torch::Tensor>& state) {
  auto get = [&](const std::string& key) -> const torch::Tensor& {
    auto it = state.find(key);
    if (it == state.end()) throw std::runtime_error("optimizer state: missing entry '" + key + "'");
    return it->second;
  };
  steps_ = get("step").item<int64_t>();
  buf1_.clear();
  buf2_.clear();
  if (steps_ == 0) return;
  allocate_state();
  torch::NoGradGuard no_grad;
  auto fill = [&](std::vector<torch::Tensor>& bufs, const std::string& prefix) {
    for (size_t i = 0; i < bufs.size(); ++i) {
      const auto& src = get(prefix + params_[i].name);
      if (src.sizes() != bufs[i].sizes())
        throw std::runtime_error("optimizer state: '" + prefix + params_[i].name + "' has shape " +
                                 c10::str(src.sizes()) + ", the parameter has " + c10::str(bufs[i].sizes()));
      bufs[i].copy_(src);
    }
  };
  if (!buf1_.empty()) fill(buf1_, cfg_.name == "sgd" ? "momentum_buffer." : "exp_avg.");
  if (!buf2_.empty()) fill(buf2_, "exp_avg_sq.");
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
  if (schedule.name == "cosine") {
    int64_t span = std::max<int64_t>(1, total_steps - warmup_steps);
    double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / static_cast<double>(span));
    return schedule.min_lr + (peak_lr - schedule.min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
  }
  if (schedule.name == "step") {
    double lr = peak_lr;
    for (int64_t m : schedule.milestones)
      if (step >= m) lr *= schedule.gamma;
    return lr;
  }
  return peak_lr;  // constant
}

}  // namespace trainer
