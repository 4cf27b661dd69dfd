#include "trainer/numerics/ema.h"

#include <cmath>
#include <map>
#include <set>
#include <stdexcept>
#include <unordered_map>

#include "common/compat.h"

namespace trainer {
namespace {

using Named = std::vector<std::pair<std::string, torch::Tensor>>;

// PyTorch's Module.state_dict walk: own parameters, own buffers, then each child with "child." prepended
// (trainer/checkpoint/state_dict.h's named_state, which this component cannot see). A frozen parameter
// (LoRA's base) never changes, so its average would be a copy of it: the average leaves it out, and under
// LoRA holds the adapters, as the checkpoint's model.pt does.
void collect(const torch::nn::Module& module, const std::string& prefix, Named& out) {
  for (const auto& p : module.named_parameters(/*recurse=*/false))
    if (p.value().defined() && p.value().requires_grad()) out.emplace_back(prefix + p.key(), p.value());
  for (const auto& b : module.named_buffers(/*recurse=*/false))
    if (b.value().defined()) out.emplace_back(prefix + b.key(), b.value());
  for (const auto& c : module.named_children()) collect(*c.value(), prefix + c.key() + ".", out);
}

Named state_of(const torch::nn::Module& module) {
  Named out;
  collect(module, "", out);
  return out;
}

std::string shape_str(at::IntArrayRef s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

}  // namespace

double ema_decay(const EmaOptions& o, int64_t step) {
  // ModelEmaV3.get_decay: step = max(0, step - update_after_step - 1); 0 at and before the first update.
  const int64_t s = std::max<int64_t>(0, step - 1);
  if (s <= 0) return 0.0;
  if (!o.warmup) return o.decay;
  const double d = 1 - std::pow(1 + static_cast<double>(s) / o.warmup_gamma, -o.warmup_power);
  return std::max(std::min(d, o.decay), o.min_decay);
}

ModelEma::ModelEma(const torch::nn::Module& model, EmaOptions options) : options_(options) {
  if (!(options_.decay > 0 && options_.decay < 1))
    throw std::invalid_argument("ema: decay " + std::to_string(options_.decay) + " is outside (0, 1)");
  if (options_.every < 1) throw std::invalid_argument("ema: every must be at least 1");
  torch::NoGradGuard no_grad;
  std::unordered_map<const void*, int64_t> first;  // a model tensor registered under two names is one average
  for (auto& [name, t] : state_of(model)) {
    const auto [it, fresh] = first.emplace(t.unsafeGetTensorImpl(), static_cast<int64_t>(entries_.size()));
    if (!fresh) {
      entries_.push_back({name, entries_[it->second].value, it->second});
      continue;
    }
    entries_.push_back({name, t.detach().clone(), -1});  // clone keeps the memory format (channels_last)
    if (t.is_floating_point()) lerped_.push_back(entries_.back().value);
  }
}

double ModelEma::update(const torch::nn::Module& model, int64_t step) {
  if (!due(step)) return -1;
  torch::NoGradGuard no_grad;
  const double decay = ema_decay(options_, step);
  const Named now = state_of(model);
  TORCH_CHECK(now.size() == entries_.size(), "ema: the model has ", now.size(), " state tensors, the average ",
              entries_.size());
  std::vector<torch::Tensor> ends;
  ends.reserve(lerped_.size());
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    if (e.alias_of >= 0) continue;
    if (e.value.is_floating_point()) ends.push_back(now[i].second);
    else e.value.copy_(now[i].second);  // num_batches_tracked: copied, as ModelEmaV3 copies integer entries
  }
  // ModelEmaV3.apply_update_: torch._foreach_lerp_(ema, model, weight=1 - decay).
  compat::foreach_lerp_(lerped_, ends, 1.0 - decay);
  return decay;
}

void ModelEma::set(const torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  const Named now = state_of(model);
  TORCH_CHECK(now.size() == entries_.size(), "ema: the model has ", now.size(), " state tensors, the average ",
              entries_.size());
  for (size_t i = 0; i < entries_.size(); ++i)
    if (entries_[i].alias_of < 0) entries_[i].value.copy_(now[i].second);
}

std::vector<std::pair<std::string, torch::Tensor>> ModelEma::state() const {
  Named out;
  out.reserve(entries_.size());
  for (const auto& e : entries_) out.emplace_back(e.name, e.value);
  return out;
}

void ModelEma::load(const Named& tensors, const std::string& source) {
  std::map<std::string, torch::Tensor> by_name(tensors.begin(), tensors.end());
  std::string problems;
  auto problem = [&](const std::string& p) { problems += (problems.empty() ? "" : "; ") + p; };
  for (const auto& e : entries_) {
    const auto it = by_name.find(e.name);
    if (it == by_name.end()) problem("missing " + e.name);
    else if (it->second.sizes() != e.value.sizes())
      problem(e.name + " has shape " + shape_str(it->second.sizes()) + ", the model " + shape_str(e.value.sizes()));
  }
  std::set<std::string> known;
  for (const auto& e : entries_) known.insert(e.name);
  for (const auto& kv : by_name)
    if (!known.count(kv.first)) problem("unexpected " + kv.first);
  if (!problems.empty()) throw std::runtime_error(source + ": the averaged weights do not fit the model: " + problems);
  torch::NoGradGuard no_grad;
  for (auto& e : entries_)
    if (e.alias_of < 0) e.value.copy_(by_name.at(e.name));
}

void ModelEma::swap(torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  Named now = state_of(model);
  TORCH_CHECK(now.size() == entries_.size(), "ema: the model has ", now.size(), " state tensors, the average ",
              entries_.size());
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (entries_[i].alias_of >= 0) continue;
    torch::Tensor& m = now[i].second;  // the model's own tensor object (a parameter the optimizer holds)
    torch::Tensor& e = entries_[i].value;
    // set_data exchanges what the tensor objects point at, not the objects: no bytes move, and both sides
    // keep their identity (lerped_ and the optimizer stay valid). A 0-element tensor holds no memory.
    torch::Tensor held = torch::empty({0}, e.options());
    held.set_data(m);
    m.set_data(e);
    e.set_data(held);
  }
}

void ModelEma::copy_into(torch::nn::Module& model) const {
  torch::NoGradGuard no_grad;
  Named now = state_of(model);
  TORCH_CHECK(now.size() == entries_.size(), "ema: the model has ", now.size(), " state tensors, the average ",
              entries_.size());
  for (size_t i = 0; i < entries_.size(); ++i)
    if (entries_[i].alias_of < 0) now[i].second.copy_(entries_[i].value);
}

int64_t ModelEma::bytes() const {
  int64_t n = 0;
  for (const auto& e : entries_)
    if (e.alias_of < 0) n += static_cast<int64_t>(e.value.numel() * e.value.element_size());
  return n;
}

}  // namespace trainer
