// AdamW with decoupled weight decay: PyTorch's torch.optim.AdamW (no amsgrad), three ways (optim_rule.h).
#include "trainer/numerics/optim_rule.h"

#include <cmath>

#include "common/compat.h"
#include "trainer/numerics/optim.h"

namespace trainer {

namespace {

class AdamW : public OptimizerRule {
 public:
  using OptimizerRule::OptimizerRule;
  const char* scope() const override { return "Optimizer.step#AdamW.step"; }

  void allocate_state(const std::vector<ParamSlot>& params) override {
    // Zero moments are PyTorch's initial state.
    allocate_like(exp_avg_, params);
    allocate_like(exp_avg_sq_, params);
  }

  void step_plain(const std::vector<ParamSlot>& params, double lr, int64_t t) override {
    const double b1 = cfg_.beta1, b2 = cfg_.beta2, wd = cfg_.weight_decay;
    const double bc1 = 1 - std::pow(b1, static_cast<double>(t));
    const double bc2_sqrt = std::sqrt(1 - std::pow(b2, static_cast<double>(t)));
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i].param;
      torch::Tensor g = p.grad();
      if (!g.defined()) continue;
      if (wd != 0 && params[i].decay) p.mul_(1 - lr * wd);
      exp_avg_[i].mul_(b1).add_(g, 1 - b1);
      exp_avg_sq_[i].mul_(b2).addcmul_(g, g, 1 - b2);
      // The gradient is no longer needed: it becomes the denominator, so nothing is allocated.
      g.copy_(exp_avg_sq_[i]).sqrt_().div_(bc2_sqrt).add_(cfg_.eps);
      p.addcdiv_(exp_avg_[i], g, -lr / bc1);
    }
  }

  // The plain loop's update, op for op, each op over all tensors at once.
  void step_foreach(const std::vector<ParamSlot>& params, double lr, int64_t t) override {
    const std::vector<size_t> live = with_gradient(params);
    if (live.empty()) return;
    std::vector<torch::Tensor> p, g, p_decay;
    for (size_t i : live) {
      p.push_back(params[i].param);
      g.push_back(params[i].param.grad());
      if (params[i].decay) p_decay.push_back(params[i].param);
    }
    const auto m1 = pick(exp_avg_, live), m2 = pick(exp_avg_sq_, live);
    const double b1 = cfg_.beta1, b2 = cfg_.beta2, wd = cfg_.weight_decay;
    const double bc1 = 1 - std::pow(b1, static_cast<double>(t));
    const double bc2_sqrt = std::sqrt(1 - std::pow(b2, static_cast<double>(t)));
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

  void step_fused(const std::vector<ParamSlot>& params, const FusedScalars& s, const torch::Tensor& skip) override {
    for (const FusedGroup& grp : fused_groups(params)) {
      std::vector<torch::Tensor> p, g;
      for (size_t i : grp.index) p.push_back(params[i].param), g.push_back(params[i].param.grad());
      const auto m1 = pick(exp_avg_, grp.index), m2 = pick(exp_avg_sq_, grp.index);
      const double wd = grp.decays ? cfg_.weight_decay : 0.0;
      // The kernel reads the step count from a float32 tensor per parameter (torch.optim increments its
      // own before the call); one tensor, filled once per step, serves them all: the kernel only reads it.
      // From the device, set_device_scalars() filled it before the replay.
      torch::Tensor& step = *s.step;
      if (!s.from_device) {
        if (!step.defined() || step.device() != grp.device)
          step = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat).device(grp.device));
        step.fill_(static_cast<double>(s.t));
      }
      const std::vector<torch::Tensor> steps(p.size(), step);
      if (s.from_device)
        compat::fused_adamw_(p, g, m1, m2, steps, *s.device_lr, cfg_.beta1, cfg_.beta2, wd, cfg_.eps, skip);
      else compat::fused_adamw_(p, g, m1, m2, steps, s.lr, cfg_.beta1, cfg_.beta2, wd, cfg_.eps, skip);
    }
  }

  std::vector<StateBuffers> state_buffers() override {
    return {{"exp_avg.", &exp_avg_}, {"exp_avg_sq.", &exp_avg_sq_}};
  }

 private:
  std::vector<torch::Tensor> exp_avg_, exp_avg_sq_;
};

}  // namespace

std::unique_ptr<OptimizerRule> make_adamw(const OptimConfig& cfg) { return std::make_unique<AdamW>(cfg); }

}  // namespace trainer
