#include "models/lora.h"

#include <algorithm>
#include <cmath>
#include <set>

namespace models {
namespace {

namespace nn = torch::nn;

std::string last_component(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

void check_options(const LoraOptions& o) {
  if (o.rank < 1) throw LoraError("model.lora.rank: must be at least 1, got " + std::to_string(o.rank));
  if (!(o.alpha > 0)) throw LoraError("model.lora.alpha: must be positive, got " + std::to_string(o.alpha));
  if (!(o.dropout >= 0 && o.dropout < 1))
    throw LoraError("model.lora.dropout: must be in [0, 1), got " + std::to_string(o.dropout));
  if (o.targets.empty()) throw LoraError("model.lora.targets: names no layer");
}

// PyTorch's Module.state_dict order, as trainer/checkpoint/state_dict.cpp walks it: own parameters, own
// buffers, then each child. An adapted layer contributes its merged weight and its bias, not its adapters.
void collect_merged(const nn::Module& module, const std::string& prefix,
                    std::vector<std::pair<std::string, torch::Tensor>>& out) {
  const auto* adapted = dynamic_cast<const LinearImpl*>(&module);
  const bool merge = adapted && adapted->has_lora();
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    if (!p.value().defined()) continue;
    torch::Tensor t = p.value().detach();
    if (merge && p.key() == "weight") t = (t.to(torch::kFloat) + adapted->delta_weight()).to(t.scalar_type());
    else t = t.clone();
    out.emplace_back(prefix + p.key(), t);
  }
  for (const auto& b : module.named_buffers(/*recurse=*/false))
    if (b.value().defined()) out.emplace_back(prefix + b.key(), b.value().detach().clone());
  for (const auto& c : module.named_children()) {
    if (merge && (c.key() == "lora_A" || c.key() == "lora_B")) continue;
    collect_merged(*c.value(), prefix + c.key() + ".", out);
  }
}

}  // namespace

double LoraOptions::scaling() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

// ---------------------------------------------------------------------------------------------------------
torch::Tensor LinearImpl::forward(const torch::Tensor& x) { return add_lora(x, nn::LinearImpl::forward(x)); }

torch::Tensor LinearImpl::add_lora(const torch::Tensor& x, const torch::Tensor& y) {
  if (lora_A.is_empty()) return y;
  // peft's Linear.forward: the input in the adapters' dtype (float32 beside a bfloat16 base), the sum in
  // the wider of the two, then back to the base output's dtype.
  auto h = x.to(lora_A->weight.scalar_type());
  if (dropout > 0) h = torch::dropout(h, dropout, is_training());
  auto delta = torch::linear(torch::linear(h, lora_A->weight), lora_B->weight) * scaling;  // (..., in) -> (..., out)
  return (y + delta).to(y.scalar_type());
}

void LinearImpl::attach(const LoraOptions& o) {
  const int64_t in = weight.size(1), out = weight.size(0);
  if (o.rank > std::min(in, out))
    throw LoraError("model.lora.rank: " + std::to_string(o.rank) + " is larger than a targeted layer (" +
                    std::to_string(in) + " -> " + std::to_string(out) + ")");
  const auto device = weight.device();
  // nn::Linear's own initialization of A is peft's: kaiming_uniform_(a = sqrt(5)).
  lora_A = register_module("lora_A", nn::Linear(nn::LinearOptions(in, o.rank).bias(false)));
  lora_B = register_module("lora_B", nn::Linear(nn::LinearOptions(o.rank, out).bias(false)));
  {
    torch::NoGradGuard no_grad;
    lora_B->weight.zero_();
  }
  lora_A->to(device);
  lora_B->to(device);
  scaling = o.scaling();
  dropout = o.dropout;
  weight.requires_grad_(false);
  if (bias.defined()) bias.requires_grad_(false);
}

torch::Tensor LinearImpl::delta_weight() const {
  TORCH_CHECK(has_lora(), "LinearImpl::delta_weight: the layer has no adapter");
  torch::NoGradGuard no_grad;
  return torch::matmul(lora_B->weight.to(torch::kFloat), lora_A->weight.to(torch::kFloat)) * scaling;  // (out, in)
}

// ---------------------------------------------------------------------------------------------------------
std::vector<std::string> default_lora_targets(const std::string& model_name) {
  if (model_name.rfind("llama", 0) == 0) return {"q_proj", "v_proj"};
  if (model_name.rfind("gpt", 0) == 0) return {"c_attn"};
  return {};
}

std::vector<std::string> lora_target_names(const nn::Module& model) {
  std::vector<std::string> names;
  for (const auto& m : model.named_modules("", /*include_self=*/false)) {
    if (!dynamic_cast<const LinearImpl*>(m.value().get())) continue;
    const std::string leaf = last_component(m.key());
    if (std::find(names.begin(), names.end(), leaf) == names.end()) names.push_back(leaf);
  }
  return names;
}

std::vector<std::string> add_lora(nn::Module& model, const LoraOptions& options) {
  check_options(options);
  if (has_lora(model)) throw LoraError("model.lora: the model already has adapters");
  const auto known = lora_target_names(model);
  for (const auto& t : options.targets) {
    if (std::find(known.begin(), known.end(), t) != known.end()) continue;
    throw LoraError("model.lora.targets: '" + t + "' is not a Linear layer of this model (its Linear layers: " +
                    (known.empty() ? std::string("none") : join(known)) + ")");
  }
  const std::set<std::string> wanted(options.targets.begin(), options.targets.end());
  std::vector<LinearImpl*> layers;
  std::vector<std::string> names;
  for (const auto& m : model.named_modules("", /*include_self=*/false)) {
    auto* linear = dynamic_cast<LinearImpl*>(m.value().get());
    if (!linear || !wanted.count(last_component(m.key()))) continue;
    const int64_t smaller = std::min(linear->weight.size(0), linear->weight.size(1));
    if (options.rank > smaller)
      throw LoraError("model.lora.rank: " + std::to_string(options.rank) + " is larger than " + m.key() + " (" +
                      std::to_string(linear->weight.size(1)) + " -> " + std::to_string(linear->weight.size(0)) +
                      "): at most " + std::to_string(smaller));
    layers.push_back(linear);
    names.push_back(m.key());
  }
  for (auto& p : model.parameters()) p.requires_grad_(false);
  // Layer after layer in the model's order, A drawn from the global generator: the same seed gives the
  // same adapters.
  for (auto* linear : layers) linear->attach(options);
  return names;
}

bool has_lora(const nn::Module& model) { return !lora_layers(model).empty(); }

std::vector<std::pair<std::string, LinearImpl*>> lora_layers(const nn::Module& model) {
  std::vector<std::pair<std::string, LinearImpl*>> out;
  for (const auto& m : model.named_modules("", /*include_self=*/false)) {
    auto* linear = dynamic_cast<LinearImpl*>(m.value().get());
    if (linear && linear->has_lora()) out.emplace_back(m.key(), linear);
  }
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> lora_state(const nn::Module& model) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& [name, linear] : lora_layers(model)) {
    out.emplace_back(name + ".lora_A.weight", linear->lora_A->weight);
    out.emplace_back(name + ".lora_B.weight", linear->lora_B->weight);
  }
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> merged_state(const nn::Module& model) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  collect_merged(model, "", out);
  return out;
}

int64_t trainable_parameters(const nn::Module& model) {
  int64_t n = 0;
  for (const auto& p : model.parameters())
    if (p.requires_grad()) n += p.numel();
  return n;
}

}  // namespace models
