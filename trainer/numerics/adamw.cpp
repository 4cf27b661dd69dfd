// AdamW with decoupled weight decay: PyTorch's torch.optim.AdamW (no amsgrad), three ways (optim_rule.h);
// with bfloat16 or int8 moments (optim.state_dtype: moments.h), or bfloat16 weights (model.param_dtype),
// torchao's AdamW8bit / _AdamW arithmetic.
#include "trainer/numerics/optim_rule.h"

#include <cmath>
#include <stdexcept>

#include "common/compat.h"
#include "trainer/numerics/moments.h"
#include "trainer/numerics/optim.h"
#include "trainer/numerics/stochastic_round.h"

namespace trainer {

namespace {

bool bfloat16_weights(const std::vector<ParamSlot>& params) {
  return !params.empty() && params.front().param.scalar_type() == torch::kBFloat16;
}

class AdamW : public MomentsRule {
 public:
  const char* scope() const override { return "Optimizer.step#AdamW.step"; }

  explicit AdamW(const OptimConfig& cfg) : MomentsRule(cfg) {}

  // Zero moments are PyTorch's initial state.

  bool updates_bfloat16_weights() const override { return true; }

  void step_plain(const std::vector<ParamSlot>& params, double lr, int64_t t) override {
    if (!moments_.float32() || bfloat16_weights(params)) return step_low_precision(params, lr, t);
    auto& exp_avg = moments_.exp_avg();
    auto& exp_avg_sq = moments_.exp_avg_sq();
    const double b1 = cfg_.beta1, b2 = cfg_.beta2, wd = cfg_.weight_decay;
    const double bc1 = 1 - std::pow(b1, static_cast<double>(t));
    const double bc2_sqrt = std::sqrt(1 - std::pow(b2, static_cast<double>(t)));
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i].param;
      torch::Tensor g = p.grad();
      if (!g.defined()) continue;
      if (wd != 0 && params[i].decay) p.mul_(1 - lr * wd);
      exp_avg[i].mul_(b1).add_(g, 1 - b1);
      exp_avg_sq[i].mul_(b2).addcmul_(g, g, 1 - b2);
      // The gradient is no longer needed: it becomes the denominator, so nothing is allocated.
      g.copy_(exp_avg_sq[i]).sqrt_().div_(bc2_sqrt).add_(cfg_.eps);
      p.addcdiv_(exp_avg[i], g, -lr / bc1);
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
    const auto m1 = pick(moments_.exp_avg(), live), m2 = pick(moments_.exp_avg_sq(), live);
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
      const auto m1 = pick(moments_.exp_avg(), grp.index), m2 = pick(moments_.exp_avg_sq(), grp.index);
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


 private:
  // torchao's single_param_adam (AdamW8bit, and _AdamW with bfloat16 state or weights), op for op in float32,
  // per block of moments.h: p -= lr wd p; m = lerp(m, g, 1 - b1); v = lerp(v, g^2, 1 - b2); p -= lr (m / bc1)
  // / (sqrt(v) / sqrt(bc2) + eps), with the bias corrections computed in float32 from a float32 step count and
  // the lerps fused (fma) as LibTorch's vectorized lerp computes them. bfloat16 weights and gradients are
  // read as float32, and the updated weight rounded back: to nearest even (torchao's p.copy_(p_f32)), or
  // stochastically (optim.stochastic_rounding: torchao's _fp32_to_bf16_sr) with bits from (seed, step,
  // tensor, index).
  void step_low_precision(const std::vector<ParamSlot>& params, double lr, int64_t t) {
    const float lr_f = static_cast<float>(lr), tf = static_cast<float>(t);
    const float bc1 = 1.0f - powf(static_cast<float>(cfg_.beta1), tf);
    const float bc2_sqrt = std::sqrt(1.0f - powf(static_cast<float>(cfg_.beta2), tf));
    const float w1 = static_cast<float>(1 - cfg_.beta1), w2 = static_cast<float>(1 - cfg_.beta2);
    const float eps = static_cast<float>(cfg_.eps);
    for (size_t i = 0; i < params.size(); ++i) {
      const torch::Tensor& p = params[i].param;
      const torch::Tensor g = p.grad();
      if (!g.defined()) continue;
      const auto dtype = p.scalar_type();
      if (g.strides() != p.strides() || g.scalar_type() != dtype || (dtype != torch::kFloat && dtype != torch::kBFloat16))
        throw std::logic_error("AdamW: the block update needs float32 or bfloat16 parameters with gradients of their "
                               "dtype and layout");
      const bool decays = cfg_.weight_decay != 0 && params[i].decay;
      const float decay = lr_f * static_cast<float>(cfg_.weight_decay);
      // The updated weight from its old value x and gradient g, with the moments m and v in and out.
      const auto update = [&](float x, float g, float& m, float& v) {
        if (decays) x = x - decay * x;
        m = std::fma(w1, g - m, m);
        v = std::fma(w2, g * g - v, v);
        const float denom = std::sqrt(v) / bc2_sqrt + eps;
        return x - lr_f * (m / bc1) / denom;
      };
      if (dtype == torch::kFloat) {
        float* pp = p.data_ptr<float>();
        const float* gp = g.data_ptr<float>();
        moments_.update(i, [&](float* m, float* v, int64_t begin, int64_t n) {
          for (int64_t j = 0; j < n; ++j) pp[begin + j] = update(pp[begin + j], gp[begin + j], m[j], v[j]);
        });
        continue;
      }
      auto* pp = p.data_ptr<c10::BFloat16>();
      const auto* gp = g.data_ptr<c10::BFloat16>();
      const bool stochastic = cfg_.stochastic_rounding;
      const uint64_t key = stochastic_key(rounding_seed_, t, static_cast<int64_t>(i));
      moments_.update(i, [&](float* m, float* v, int64_t begin, int64_t n) {
        for (int64_t j = 0; j < n; ++j) {
          const int64_t k = begin + j;
          const float x = update(static_cast<float>(pp[k]), static_cast<float>(gp[k]), m[j], v[j]);
          pp[k] = stochastic ? round_stochastic(x, random16(key, k)) : c10::BFloat16(x);
        }
      });
    }
  }

};

}  // namespace

std::unique_ptr<OptimizerRule> make_adamw(const OptimConfig& cfg) { return std::make_unique<AdamW>(cfg); }

}  // namespace trainer
