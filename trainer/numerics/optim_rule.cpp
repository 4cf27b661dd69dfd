// What the optimizer rules share (optim_rule.h), and the choice of one by optim.name.
#include "trainer/numerics/optim_rule.h"

#include <algorithm>
#include <stdexcept>
#include <tuple>

#include "trainer/numerics/optim.h"

namespace trainer {

std::unique_ptr<OptimizerRule> make_optimizer_rule(const OptimConfig& cfg) {
  switch (cfg.name) {
    case OptimKind::kSgd: return make_sgd(cfg);
    case OptimKind::kAdamW: return make_adamw(cfg);
    case OptimKind::kLamb: return make_lamb(cfg);
  }
  throw std::logic_error("make_optimizer_rule: an optim.name out of range");
}

void OptimizerRule::step_foreach(const std::vector<ParamSlot>&, double, int64_t) {
  throw std::logic_error("optimizer " + name() + " has no foreach implementation");
}

void OptimizerRule::step_fused(const std::vector<ParamSlot>&, const FusedScalars&, const torch::Tensor&) {
  throw std::logic_error("optimizer " + name() + " has no fused implementation");
}

std::string OptimizerRule::convert_state(StateDtype dtype, const std::vector<ParamSlot>&) {
  throw std::invalid_argument("optim.state_dtype " + mode_name(dtype) + " applies to AdamW's and LAMB's moments");
}

std::string OptimizerRule::load_state(const std::map<std::string, torch::Tensor>& state, const std::vector<ParamSlot>& params) {
  torch::NoGradGuard no_grad;
  for (const StateBuffers& b : state_buffers()) {
    std::vector<torch::Tensor>& bufs = *b.tensors;
    for (size_t i = 0; i < bufs.size(); ++i) {
      if (!bufs[i].defined()) continue;
      const std::string key = b.prefix + params[i].name;
      auto it = state.find(key);
      if (it == state.end()) throw std::runtime_error("optimizer state: missing entry '" + key + "'");
      const torch::Tensor& src = it->second;
      if (src.sizes() != bufs[i].sizes())
        throw std::runtime_error("optimizer state: '" + key + "' has shape " + c10::str(src.sizes()) +
                                 ", the parameter has " + c10::str(bufs[i].sizes()));
      bufs[i].copy_(src);
    }
  }
  return "";
}

std::vector<size_t> with_gradient(const std::vector<ParamSlot>& params) {
  std::vector<size_t> out;
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].param.grad().defined()) out.push_back(i);
  return out;
}

std::vector<FusedGroup> fused_groups(const std::vector<ParamSlot>& params) {
  std::vector<std::tuple<c10::Device, at::ScalarType, bool>> keys;
  std::vector<FusedGroup> groups;
  for (size_t i : with_gradient(params)) {
    const auto& p = params[i].param;
    const std::tuple<c10::Device, at::ScalarType, bool> key{p.device(), p.scalar_type(), params[i].decay};
    const size_t g = static_cast<size_t>(std::find(keys.begin(), keys.end(), key) - keys.begin());
    if (g == keys.size()) {
      keys.push_back(key);
      groups.push_back({params[i].decay, p.device(), {}});
    }
    groups[g].index.push_back(i);
  }
  return groups;
}

void allocate_like(std::vector<torch::Tensor>& tensors, const std::vector<ParamSlot>& params) {
  if (tensors.size() == params.size()) return;
  std::vector<torch::Tensor> t;
  for (const auto& s : params) t.push_back(torch::zeros_like(s.param, at::MemoryFormat::Preserve));
  tensors = std::move(t);
}

std::vector<torch::Tensor> pick(const std::vector<torch::Tensor>& from, const std::vector<size_t>& index) {
  std::vector<torch::Tensor> out;
  if (from.empty()) return out;  // a state the rule does not keep (SGD without momentum)
  for (size_t i : index) out.push_back(from[i]);
  return out;
}

}  // namespace trainer
