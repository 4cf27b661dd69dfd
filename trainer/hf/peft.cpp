#include "trainer/hf/peft.h"

#include "common/files.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/hf/families.h"

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <stdexcept>
#include <vector>

namespace fs = std::filesystem;

namespace trainer::hf {
// A named namespace around the helpers: the unity build compiles this file with families.cpp, whose
// anonymous namespace has helpers of the same short names.
namespace peft_files {
namespace {

constexpr const char* kPrefix = "base_model.model.";
// The peft release whose save_pretrained the written adapter_config.json follows.
constexpr const char* kPeftVersion = "0.21.0";

[[noreturn]] void refuse(const std::string& source, const std::string& what) {
  throw std::runtime_error(source + ": " + what);
}

std::string joined(const std::set<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s.empty() ? "none" : s;
}

std::string last_component(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string shape_of(const torch::Tensor& t) {
  std::string s;
  for (const auto d : t.sizes()) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return "[" + s + "]";
}

// A key that peft reads as "asked for": not null, not false, not an empty list or dict. 0 counts as set
// (layers_to_transform: 0 is layer 0).
bool is_set(const nlohmann::json& c, const std::string& key) {
  if (!c.contains(key)) return false;
  const auto& v = c[key];
  if (v.is_null() || (v.is_boolean() && !v.get<bool>())) return false;
  return !((v.is_array() || v.is_object() || v.is_string()) && v.empty());
}

std::string shown(const nlohmann::json& v) {
  const std::string s = v.dump();
  return s.size() <= 60 ? s : s.substr(0, 57) + "...";
}

// LoraConfig keys (peft 0.21) that change what the adapted model computes, or which layers carry adapters,
// beyond the plain y = W x + B A x * scaling on every targeted layer. The others are accepted: fan_in_fan_out
// (GPT-2's Conv1D keeps W transposed; A and B have the same shapes either way), init_lora_weights and the
// init-only configs (eva, corda, loftq, lora_ga: how A and B started, not how they compute; "mica" only
// freezes B in training), megatron_* (the same product on another layer class), inference_mode.
const std::vector<std::pair<std::string, std::string>>& variant_keys() {
  static const std::vector<std::pair<std::string, std::string>> keys = {
      {"use_dora", "DoRA is not computed here"},
      {"lora_bias", "a bias on lora_B is not computed here"},
      {"use_qalora", "QA-LoRA is not computed here"},
      {"velora_config", "VeLoRA is not computed here"},
      {"alora_invocation_tokens", "activated LoRA (aLoRA) is not computed here"},
      {"monteclora_config", "MonteCLoRA is not computed here"},
      {"use_bdlora", "block-diagonal LoRA is not computed here"},
      {"arrow_config", "Arrow routing is not computed here"},
      {"kasa_config", "KaSA is not computed here"},
      {"rank_pattern", "per-layer ranks are not read here (one r for every layer)"},
      {"alpha_pattern", "per-layer alphas are not read here (one lora_alpha for every layer)"},
      {"modules_to_save", "fully trained modules beside the adapters are not read here"},
      {"trainable_token_indices", "trained token embeddings are not read here"},
      {"layers_to_transform", "adapters on some layers only are not read here"},
      {"exclude_modules", "adapters on some layers only are not read here"},
      {"layer_replication", "replicated layers are not built here"},
      {"target_parameters", "adapters on parameters (rather than Linear layers) are not read here"},
  };
  return keys;
}

void refuse_variants(const nlohmann::json& c, const std::string& source) {
  if (!c.contains("peft_type") || !c["peft_type"].is_string()) refuse(source, "has no peft_type (not a peft adapter?)");
  const std::string type = c["peft_type"].get<std::string>();
  if (type != "LORA") refuse(source, "peft_type " + type + ": a " + type + " adapter; only LoRA is read");
  for (const auto& [key, why] : variant_keys())
    if (is_set(c, key)) refuse(source, key + " is " + shown(c[key]) + ": " + why + "; only plain LoRA is read");
  if (c.contains("bias") && !c["bias"].is_null() && c["bias"] != "none")
    refuse(source, "bias is " + shown(c["bias"]) + ": trained biases are not read here (only bias \"none\")");
}

// target_modules as layer names. peft matches a list's entry against a layer's full name or its ending
// ("q_proj", "self_attn.q_proj"): the last component is the layer name, and load_peft_adapter checks that
// the file's tensors are exactly the model's adapters. A string is a regular expression matched against
// full names, which is read only when it is one plain name.
std::vector<std::string> read_targets(const nlohmann::json& c, const std::string& source) {
  if (!c.contains("target_modules") || c["target_modules"].is_null()) refuse(source, "has no target_modules");
  const auto& t = c["target_modules"];
  std::set<std::string> names;
  if (t.is_string()) {
    const std::string s = t.get<std::string>();
    const bool plain = !s.empty() && std::all_of(s.begin(), s.end(), [](char ch) {
      return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_';
    });
    if (!plain)
      refuse(source, "target_modules is the pattern " + shown(t) + ": a regular expression is not read here; list the "
                     "layer names instead (e.g. [\"q_proj\", \"v_proj\"])");
    names.insert(s);
  } else if (t.is_array() && !t.empty()) {
    for (const auto& e : t) {
      if (!e.is_string() || e.get<std::string>().empty())
        refuse(source, "target_modules holds " + shown(e) + ", not a layer name");
      names.insert(last_component(e.get<std::string>()));
    }
  } else {
    refuse(source, "target_modules is " + shown(t) + ", not a list of layer names");
  }
  return {names.begin(), names.end()};
}

double number_in(const nlohmann::json& c, const std::string& key, double fallback, double lo, double hi,
                 const std::string& source) {
  if (!c.contains(key) || c[key].is_null()) return fallback;
  if (!c[key].is_number()) refuse(source, key + " is " + shown(c[key]) + ", not a number");
  const double x = c[key].get<double>();
  if (!std::isfinite(x) || x < lo || x > hi)
    refuse(source, key + " " + shown(c[key]) + " is outside [" + nlohmann::json(lo).dump() + ", " +
                       nlohmann::json(hi).dump() + "]");
  return x;
}

models::LoraOptions read_options(const nlohmann::json& c, const std::string& source) {
  models::LoraOptions o;
  if (!c.contains("r") || !c["r"].is_number_integer())
    refuse(source, "r is " + (c.contains("r") ? shown(c["r"]) : "missing") + ", not an integer");
  o.rank = c["r"].get<int64_t>();
  if (o.rank < 1 || o.rank > (int64_t{1} << 16))
    refuse(source, "r " + std::to_string(o.rank) + " is outside [1, 65536]");
  o.alpha = number_in(c, "lora_alpha", 8.0, 1e-30, 1e30, source);  // peft's default 8
  o.dropout = number_in(c, "lora_dropout", 0.0, 0.0, 0.999999, source);
  if (c.contains("use_rslora") && !c["use_rslora"].is_null()) {
    if (!c["use_rslora"].is_boolean())
      refuse(source, "use_rslora is " + shown(c["use_rslora"]) + ", not true or false");
    o.use_rslora = c["use_rslora"].get<bool>();
  }
  o.targets = read_targets(c, source);
  return o;
}

// The adapter's weights file and its tensors: safetensors first, as peft's load_peft_weights looks for them.
std::pair<std::string, NamedTensors> read_adapter_tensors(const fs::path& dir) {
  const auto st = dir / "adapter_model.safetensors", bin = dir / "adapter_model.bin";
  std::error_code ec;
  if (fs::exists(st, ec)) return {st.string(), read_safetensors(st.string()).tensors};
  if (fs::exists(bin, ec)) return {bin.string(), read_tensors(bin.string())};
  refuse(dir.string(), "no adapter_model.safetensors or adapter_model.bin (not a peft adapter folder?)");
}

// Our names for the file's tensors, each one an adapter's A or B of the config's rank, in pairs.
NamedTensors our_tensors(const NamedTensors& file, int64_t rank, const std::string& source) {
  NamedTensors out;
  std::map<std::string, int> halves;  // layer -> 1 (A), 2 (B), 3 (both)
  const std::string prefix = kPrefix;
  for (const auto& [name, t] : file) {
    if (name.rfind(prefix, 0) != 0) refuse(source, name + " is not under " + prefix + " (not a peft adapter file?)");
    const std::string ours = name.substr(prefix.size());
    if (ours.find("lora_magnitude_vector") != std::string::npos)
      refuse(source, name + " is DoRA's magnitude vector: DoRA is not computed here");
    if (ours.find("lora_embedding_") != std::string::npos)
      refuse(source, name + " adapts an embedding: only Linear layers' adapters are read");
    const bool a = ends_with(ours, ".lora_A.weight"), b = ends_with(ours, ".lora_B.weight");
    if (!a && !b)
      refuse(source, name + " is not a LoRA adapter's tensor (only *.lora_A.weight and *.lora_B.weight are read)");
    if (t.dim() != 2 || !t.is_floating_point())
      refuse(source, name + " is " + shape_of(t) + " " + std::string(c10::toString(t.scalar_type())) +
                         ", not a 2-D float matrix");
    if ((a ? t.size(0) : t.size(1)) != rank)
      refuse(source, name + " is " + shape_of(t) + ", but r is " + std::to_string(rank));
    const std::string layer = ours.substr(0, ours.size() - std::string(".lora_A.weight").size());
    halves[layer] |= a ? 1 : 2;
    out.emplace_back(ours, t);
  }
  if (out.empty()) refuse(source, "holds no adapter tensors");
  for (const auto& [layer, h] : halves)
    if (h != 3) refuse(source, layer + " has " + (h == 1 ? "lora_A but no lora_B" : "lora_B but no lora_A"));
  return out;
}

// The model's adapted layers' last name components.
std::set<std::string> adapted_names(const std::vector<std::pair<std::string, models::LinearImpl*>>& layers) {
  std::set<std::string> names;
  for (const auto& l : layers) names.insert(last_component(l.first));
  return names;
}

}  // namespace
}  // namespace peft_files

PeftAdapter read_peft_adapter(const std::string& dir) {
  using namespace peft_files;
  const auto config_path = (fs::path(dir) / "adapter_config.json").string();
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    refuse(dir, "no such folder (a peft adapter folder: adapter_config.json and adapter_model.safetensors)");
  if (!fs::exists(config_path, ec)) refuse(config_path, "no such file (not a peft adapter folder?)");
  const nlohmann::json c = read_config_json(config_path);
  refuse_variants(c, config_path);
  PeftAdapter adapter;
  adapter.options = read_options(c, config_path);
  if (c.contains("base_model_name_or_path") && c["base_model_name_or_path"].is_string())
    adapter.base_model = c["base_model_name_or_path"].get<std::string>();
  const auto [weights, file] = read_adapter_tensors(dir);
  adapter.tensors = our_tensors(file, adapter.options.rank, weights);
  return adapter;
}

void load_peft_adapter(torch::nn::Module& model, const PeftAdapter& adapter, const models::LoraOptions& options,
                       const std::string& source) {
  using namespace peft_files;
  const auto layers = models::lora_layers(model);
  if (layers.empty()) refuse(source, "the model has no LoRA adapters to load into (model.lora.rank is 0)");
  const int64_t rank = layers.front().second->lora_A->weight.size(0);
  if (adapter.options.rank != rank)
    refuse(source, "rank " + std::to_string(adapter.options.rank) + ", but model.lora.rank is " + std::to_string(rank));
  const std::set<std::string> file_targets(adapter.options.targets.begin(), adapter.options.targets.end());
  const std::set<std::string> want(options.targets.begin(), options.targets.end());
  const auto model_targets = adapted_names(layers);
  if (file_targets != (want.empty() ? model_targets : want))
    refuse(source, "target_modules " + joined(file_targets) + ", but model.lora.targets is " +
                       joined(want.empty() ? model_targets : want));
  if (model_targets != file_targets)
    refuse(source, "target_modules " + joined(file_targets) + ", but the model adapts " + joined(model_targets));
  // The scaling is the run's: a different alpha (or rsLoRA) is a choice for the training that follows.
  if (adapter.options.alpha != options.alpha || adapter.options.use_rslora != options.use_rslora)
    spdlog::warn("{}: the adapter was trained with lora_alpha {}{}; model.lora.alpha {}{} is used", source,
                 adapter.options.alpha, adapter.options.use_rslora ? " (rsLoRA)" : "", options.alpha,
                 options.use_rslora ? " (rsLoRA)" : "");
  std::map<std::string, torch::Tensor> file(adapter.tensors.begin(), adapter.tensors.end());
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;  // (model's, file's): all checked before any copy
  for (const auto& [name, layer] : layers) {
    const std::pair<const char*, torch::Tensor> halves[] = {{".lora_A.weight", layer->lora_A->weight},
                                                            {".lora_B.weight", layer->lora_B->weight}};
    for (const auto& [half, dst] : halves) {
      const auto it = file.find(name + half);
      if (it == file.end()) refuse(source, "the adapter has no " + name + half + " (the model adapts " + name + ")");
      if (!it->second.sizes().equals(dst.sizes()))
        refuse(source, name + half + " is " + shape_of(it->second) + " in the adapter, but " + shape_of(dst) +
                           " in the model");
      copies.emplace_back(dst, it->second);
      file.erase(it);
    }
  }
  if (!file.empty()) refuse(source, file.begin()->first + " is in the adapter, but the model has no such adapter");
  torch::NoGradGuard no_grad;  // in place: the optimizer's references to the adapters stay valid
  for (auto& [dst, src] : copies) dst.copy_(src.to(dst.device(), dst.scalar_type()));
}

void write_peft_adapter(const NamedTensors& adapters, const models::LoraOptions& options, const std::string& dir,
                        const std::string& base_model, bool gpt2) {
  using namespace peft_files;
  std::set<std::string> targets;
  NamedTensors file;
  for (const auto& [name, t] : adapters) {
    const bool a = ends_with(name, ".lora_A.weight"), b = ends_with(name, ".lora_B.weight");
    if (!a && !b) throw std::runtime_error("write_peft_adapter: " + name + " is not an adapter's tensor");
    if (a && t.size(0) != options.rank)
      throw std::runtime_error("write_peft_adapter: " + name + " is " + shape_of(t) + ", but the rank is " +
                               std::to_string(options.rank));
    // The target is the layer's own name, the component before lora_A / lora_B.
    targets.insert(last_component(name.substr(0, name.size() - std::string(".lora_A.weight").size())));
    file.emplace_back(kPrefix + name, t.detach().to(torch::kCPU, torch::kFloat).contiguous());
  }
  if (file.empty()) throw std::runtime_error("write_peft_adapter: no adapters to write to " + dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) refuse(dir, "cannot create the folder (" + ec.message() + ")");
  write_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), file, {{"format", "pt"}});
  // The keys of peft 0.21's save_pretrained that say what is computed and on which layers; the keys of
  // variants and init schemes not used here are left out (peft fills in their defaults). lora_alpha is an
  // integer where it is whole, as peft's LoraConfig types it.
  const double alpha = options.alpha;
  nlohmann::json c = {
      {"peft_type", "LORA"}, {"task_type", "CAUSAL_LM"}, {"peft_version", kPeftVersion}, {"r", options.rank},
      {"lora_dropout", options.dropout}, {"target_modules", std::vector<std::string>(targets.begin(), targets.end())},
      {"use_rslora", options.use_rslora}, {"use_dora", false}, {"bias", "none"}, {"fan_in_fan_out", gpt2},
      {"init_lora_weights", true}, {"inference_mode", true}, {"modules_to_save", nullptr}, {"revision", nullptr},
      {"layers_to_transform", nullptr}, {"layers_pattern", nullptr}, {"rank_pattern", nlohmann::json::object()},
      {"alpha_pattern", nlohmann::json::object()}};
  const bool whole = alpha == std::floor(alpha) && std::abs(alpha) < 1e15;
  c["lora_alpha"] = whole ? nlohmann::json(static_cast<int64_t>(alpha)) : nlohmann::json(alpha);
  c["base_model_name_or_path"] = base_model.empty() ? nlohmann::json(nullptr) : nlohmann::json(base_model);
  write_file_atomically((fs::path(dir) / "adapter_config.json").string(), c.dump(2) + "\n", "adapter_config.json");
}

}  // namespace trainer::hf
