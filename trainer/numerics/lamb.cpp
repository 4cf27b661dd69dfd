// LAMB: timm's Lamb (timm/optim/lamb.py), plain only (optim.h says what it computes; optim_rule.h how a
// rule sits behind Optimizer).
#include "trainer/numerics/optim_rule.h"

#include <cmath>
#include <stdexcept>

#include "trainer/numerics/moments.h"
#include "trainer/numerics/optim.h"

namespace trainer {

namespace {

// The L2 norm of `t` into the 0-dim float32 `out` (no allocation: the out= variant), as torch.linalg.vector_norm.
void norm_into(torch::Tensor out, const torch::Tensor& t) {
  const auto dtype = t.scalar_type() == torch::kFloat ? c10::optional<at::ScalarType>() : torch::kFloat;
  at::linalg_vector_norm_out(out, t, 2, at::OptionalIntArrayRef(), false, dtype);
}

class Lamb : public MomentsRule {
 public:
  explicit Lamb(const OptimConfig& cfg) : MomentsRule(cfg) {}
  const char* scope() const override { return "Optimizer.step#Lamb.step"; }
  // No fused LAMB kernel in LibTorch; the multi-tensor ops would allocate their results mid-step.
  bool has_foreach() const override { return false; }
  bool has_fused() const override { return false; }

  void allocate_state(const std::vector<ParamSlot>& params) override {
    MomentsRule::allocate_state(params);
    const int64_t n = static_cast<int64_t>(params.size());
    if (work_.defined() && work_.numel() == 4 * n + 2) return;
    const auto device = params.empty() ? torch::Device(torch::kCPU) : params.front().param.device();
    work_ = torch::zeros({4 * n + 2}, torch::TensorOptions().dtype(torch::kFloat).device(device));
    mask_ = torch::zeros({n}, torch::TensorOptions().dtype(torch::kBool).device(device));
  }

  // timm's _multi_tensor_lamb op for op, one tensor at a time, in place: the gradient becomes the
  // denominator, then the update; the norms and trust ratios go to the workspace. Nothing is allocated.
  void step_plain(const std::vector<ParamSlot>& params, double lr, int64_t t) override {
    const std::vector<size_t> live = with_gradient(params);
    if (live.empty() && !sharded()) return;  // sharded: the norms' sums are collectives, also without pieces
    const int64_t n = static_cast<int64_t>(params.size()), k = static_cast<int64_t>(live.size());
    const torch::Tensor divisor = cfg_.lamb_max_grad_norm > 0 ? clip_divisor(params, live) : torch::Tensor();
    const double b1 = cfg_.beta1, b2 = cfg_.beta2, wd = cfg_.weight_decay;
    const double bc1 = 1 - std::pow(b1, static_cast<double>(t));
    const double bc2_sqrt = std::pow(1 - std::pow(b2, static_cast<double>(t)), 0.5);  // Python's `bc2 ** 0.5`
    const double scale = bc2_sqrt / bc1;  // the bias corrections, folded into scalars as timm does
    torch::Tensor w_norm = work_.narrow(0, n, k), u_norm = work_.narrow(0, 2 * n, k);
    std::vector<bool> adapt(k);
    for (int64_t j = 0; j < k; ++j) {
      const ParamSlot& s = params[live[j]];
      torch::Tensor g = s.param.grad();
      if (divisor.defined()) g.div_(divisor);
      const bool decays = s.decay && wd != 0;
      if (moments_.float32()) {
        auto& m = moments_.exp_avg()[live[j]];
        auto& v = moments_.exp_avg_sq()[live[j]];
        m.lerp_(g, 1 - b1);
        v.mul_(b2).addcmul_(g, g, 1 - b2);
        g.copy_(v).sqrt_().add_(cfg_.eps * bc2_sqrt);
        at::div_out(g, m, g);  // the update, unscaled: m / (sqrt(v) + eps sqrt(bc2))
        if (decays) g.add_(s.param, wd / scale);
      } else {
        update_low_precision(live[j], s, decays, bc2_sqrt, scale);
      }
      adapt[j] = decays || cfg_.always_adapt;
      if (adapt[j]) {
        norm_into(w_norm[j], s.param);
        norm_into(u_norm[j], g);
      }
    }
    if (sharded()) whole_tensor_norms(live, adapt, w_norm, u_norm);
    if (live.empty()) return;
    apply(params, live, adapt, lr, scale);
  }


 private:
  // The float32 ops above, element by element per block of moments.h, the update left in the gradient: m =
  // lerp(m, g, 1 - b1) (fused, as LibTorch's vectorized lerp); v = b2 v + (1 - b2) g g; u = m / (sqrt(v) +
  // eps sqrt(bc2)), plus wd / s p where the tensor decays (fused, as LibTorch's vectorized add with alpha).
  void update_low_precision(size_t i, const ParamSlot& s, bool decays, double bc2_sqrt, double scale) {
    const torch::Tensor& p = s.param;
    const torch::Tensor g = p.grad();
    if (g.strides() != p.strides() || p.scalar_type() != torch::kFloat || g.scalar_type() != torch::kFloat)
      throw std::logic_error("Lamb: low-precision state needs float32 gradients laid out as their parameters");
    const float w1 = static_cast<float>(1 - cfg_.beta1), b2 = static_cast<float>(cfg_.beta2);
    const float w2 = static_cast<float>(1 - cfg_.beta2), eps = static_cast<float>(cfg_.eps * bc2_sqrt);
    const float decay = static_cast<float>(cfg_.weight_decay / scale);
    const float* pp = p.data_ptr<float>();
    float* gp = g.data_ptr<float>();
    moments_.update(i, [&](float* m, float* v, int64_t begin, int64_t n) {
      for (int64_t k = 0; k < n; ++k) {
        const float gk = gp[begin + k];
        m[k] = std::fma(w1, gk - m[k], m[k]);
        v[k] = v[k] * b2 + w2 * gk * gk;
        float u = m[k] / (std::sqrt(v[k]) + eps);
        if (decays) u = std::fma(pp[begin + k], decay, u);
        gp[begin + k] = u;
      }
    });
  }

  // Sharded (dist.shard): each piece's weight and update norms become its whole tensor's, the square root of
  // the sum over the ranks of its pieces' squares (one collective for all; the order of the sums differs
  // from a whole tensor's norm, in the last bits).
  void whole_tensor_norms(const std::vector<size_t>& live, const std::vector<bool>& adapt, torch::Tensor& w_norm,
                          torch::Tensor& u_norm) {
    const size_t n = owner_count_;
    std::vector<double> squares(2 * n, 0.0);
    for (size_t j = 0; j < live.size(); ++j) {
      if (!adapt[j]) continue;
      const double w = w_norm[j].item<double>(), u = u_norm[j].item<double>();
      squares[owner_[live[j]]] += w * w;
      squares[n + owner_[live[j]]] += u * u;
    }
    rank_sum_(squares);
    for (size_t j = 0; j < live.size(); ++j) {
      if (!adapt[j]) continue;
      w_norm[j].fill_(std::sqrt(squares[owner_[live[j]]]));
      u_norm[j].fill_(std::sqrt(squares[n + owner_[live[j]]]));
    }
  }

  // LAMB's gradient clip: writes max(1, global gradient norm / lamb_max_grad_norm) into the workspace.
  torch::Tensor clip_divisor(const std::vector<ParamSlot>& params, const std::vector<size_t>& live) {
    // timm: global = vector_norm(stack(per-tensor norms)); divisor = (global / max_grad_norm).clamp_(min=1).
    // The norms in the order of timm's param groups (param_groups_weight_decay: the tensors without decay,
    // then those with; one group when weight_decay is 0), so that their sum rounds as timm's.
    const int64_t n = static_cast<int64_t>(params.size()), k = static_cast<int64_t>(live.size());
    const torch::Tensor norms = work_.narrow(0, 0, n);
    std::vector<size_t> order;
    for (int pass = 0; pass < 2; ++pass)
      for (size_t i : live)
        if (cfg_.weight_decay == 0 ? pass == 0 : params[i].decay == (pass == 1)) order.push_back(i);
    for (int64_t j = 0; j < k; ++j) norm_into(norms[j], params[order[j]].param.grad());
    const torch::Tensor global = work_[4 * n], divisor = work_[4 * n + 1];
    if (sharded()) {  // the global norm from every rank's pieces: the square root of the summed squares
      std::vector<double> squares{0.0};
      for (int64_t j = 0; j < k; ++j) squares[0] += std::pow(norms[j].item<double>(), 2);
      rank_sum_(squares);
      global.fill_(std::sqrt(squares[0]));
    } else {
      norm_into(global, norms.narrow(0, 0, k));
    }
    divisor.copy_(global).div_(cfg_.lamb_max_grad_norm).clamp_min_(1.0);
    return divisor;
  }

  // The trust ratios of all tensors at once (timm: _lamb_trust_ratio(w, u * scale) * (-lr * scale)), then
  // the updates; the entries of tensors that do not adapt are computed too, and not read.
  void apply(const std::vector<ParamSlot>& params, const std::vector<size_t>& live, const std::vector<bool>& adapt,
             double lr, double scale) {
    const int64_t n = static_cast<int64_t>(params.size()), k = static_cast<int64_t>(live.size());
    torch::Tensor w_norm = work_.narrow(0, n, k), u_norm = work_.narrow(0, 2 * n, k);
    torch::Tensor ratio = work_.narrow(0, 3 * n, k), mask = mask_.narrow(0, 0, k);
    u_norm.mul_(scale);
    at::div_out(ratio, w_norm, u_norm);
    at::gt_out(mask, u_norm, 0).logical_not_();
    ratio.masked_fill_(mask, 1.0);
    at::gt_out(mask, w_norm, 0).logical_not_();
    ratio.masked_fill_(mask, 1.0);
    if (cfg_.trust_clip) ratio.clamp_max_(1.0);
    ratio.mul_(-lr * scale);
    for (int64_t j = 0; j < k; ++j) {
      const auto& p = params[live[j]].param;
      if (adapt[j]) p.addcmul_(p.grad(), ratio[j]);
      else p.add_(p.grad(), -lr * scale);
    }
  }

  // float32 (4 N + 2) on the parameters' device: N gradient norms, N weight norms, N update norms, N trust
  // ratios, the global gradient norm, the clip divisor; and a bool (N) for the ratios' masks. Not state:
  // every step writes it before it reads it.
  torch::Tensor work_;
  torch::Tensor mask_;
};

}  // namespace

std::unique_ptr<OptimizerRule> make_lamb(const OptimConfig& cfg) { return std::make_unique<Lamb>(cfg); }

}  // namespace trainer
