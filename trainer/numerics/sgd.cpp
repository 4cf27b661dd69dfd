// SGD with momentum, Nesterov and L2 weight decay: PyTorch's torch.optim.SGD, three ways (optim_rule.h).
#include "trainer/numerics/optim_rule.h"

#include "common/compat.h"
#include "trainer/numerics/optim.h"

namespace trainer {

namespace {

class Sgd : public OptimizerRule {
 public:
  using OptimizerRule::OptimizerRule;
  const char* scope() const override { return "Optimizer.step#SGD.step"; }

  void allocate_state(const std::vector<ParamSlot>& params) override {
    // A zero momentum buffer gives PyTorch's first-step value (buf = grad) under buf = momentum * buf + grad.
    if (cfg_.momentum > 0) allocate_like(momentum_, params);
  }

  void step_plain(const std::vector<ParamSlot>& params, double lr, int64_t) override {
    const double wd = cfg_.weight_decay, m = cfg_.momentum;
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i].param;
      torch::Tensor g = p.grad();
      if (!g.defined()) continue;
      if (wd != 0 && params[i].decay) g.add_(p, wd);
      if (m > 0) {
        auto& buf = momentum_[i];
        buf.mul_(m).add_(g);
        if (cfg_.nesterov) g.add_(buf, m);
        else g = buf;
      }
      p.add_(g, -lr);
    }
  }

  // The plain loop's update, op for op, each op over all tensors at once.
  void step_foreach(const std::vector<ParamSlot>& params, double lr, int64_t) override {
    std::vector<torch::Tensor> p, g, buf, p_decay, g_decay;
    for (size_t i : with_gradient(params)) {
      p.push_back(params[i].param);
      g.push_back(params[i].param.grad());
      if (!momentum_.empty()) buf.push_back(momentum_[i]);
      if (params[i].decay) {
        p_decay.push_back(params[i].param);
        g_decay.push_back(params[i].param.grad());
      }
    }
    if (p.empty()) return;
    const double wd = cfg_.weight_decay, m = cfg_.momentum;
    if (wd != 0 && !p_decay.empty()) at::_foreach_add_(g_decay, p_decay, wd);
    const std::vector<torch::Tensor>* update = &g;
    if (m > 0) {
      at::_foreach_mul_(buf, m);
      at::_foreach_add_(buf, g);
      if (cfg_.nesterov) at::_foreach_add_(g, buf, m);
      else update = &buf;
    }
    at::_foreach_add_(p, *update, -lr);
  }

  void step_fused(const std::vector<ParamSlot>& params, const FusedScalars& s, const torch::Tensor& skip) override {
    for (const FusedGroup& grp : fused_groups(params)) {
      std::vector<torch::Tensor> p, g;
      for (size_t i : grp.index) p.push_back(params[i].param), g.push_back(params[i].param.grad());
      const auto buf = pick(momentum_, grp.index);
      const double wd = grp.decays ? cfg_.weight_decay : 0.0;
      if (s.from_device) compat::fused_sgd_(p, g, buf, wd, cfg_.momentum, *s.device_lr, cfg_.nesterov, skip);
      else compat::fused_sgd_(p, g, buf, wd, cfg_.momentum, s.lr, cfg_.nesterov, skip);
    }
  }

  std::vector<StateBuffers> state_buffers() override { return {{"momentum_buffer.", &momentum_}}; }

 private:
  std::vector<torch::Tensor> momentum_;  // with momentum > 0
};

}  // namespace

std::unique_ptr<OptimizerRule> make_sgd(const OptimConfig& cfg) { return std::make_unique<Sgd>(cfg); }

}  // namespace trainer
