// model.lora in a run (lora.h).
#include "trainer/run/lora.h"

#include <spdlog/spdlog.h>
#include <zlib.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "models/summary.h"
#include "trainer/checkpoint/state_dict.h"
#include "trainer/hf/peft.h"
#include "trainer/run/from_config.h"

namespace trainer {

namespace fs = std::filesystem;

namespace {

bool is_adapter(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

// The weight files the base came from: model.init_from's file, or a Hub folder's weight files.
nlohmann::json base_files(const Config& cfg) {
  nlohmann::json files = nlohmann::json::array();
  const std::string& from = cfg.model.init_from;
  if (from.empty()) {
    files.push_back("initialized from seed " + std::to_string(cfg.seed));
    return files;
  }
  std::error_code ec;
  if (!fs::is_directory(from, ec)) {
    files.push_back(fs::path(from).filename().string());
    return files;
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(from, ec)) {
    const std::string ext = e.path().extension().string();
    if (ext == ".safetensors" || ext == ".bin" || ext == ".pt") names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  for (const auto& n : names) files.push_back(n);
  return files;
}

std::string hex32(uLong crc) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08lx", static_cast<unsigned long>(crc & 0xffffffffUL));
  return buf;
}

}  // namespace

models::LoraOptions lora_options(const Config& cfg) {
  models::LoraOptions o;
  const auto& l = cfg.model.lora;
  o.rank = l.rank;
  o.alpha = l.alpha;
  o.dropout = l.dropout;
  o.use_rslora = l.use_rslora;
  o.targets = l.targets.empty() ? models::default_lora_targets(cfg.model.name) : l.targets;
  return o;
}

nlohmann::json base_fingerprint(const torch::nn::Module& model, const Config& cfg) {
  uLong crc = crc32(0L, Z_NULL, 0);
  int64_t tensors = 0, values = 0;
  for (const auto& [name, t] : named_state(model)) {
    if (is_adapter(name)) continue;
    // The name too: the same numbers under other names are another model.
    crc = crc32(crc, reinterpret_cast<const Bytef*>(name.data()), static_cast<uInt>(name.size()));
    const torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
    const auto* p = static_cast<const char*>(c.data_ptr());
    for (size_t left = c.nbytes(); left > 0;) {  // zlib takes a 32-bit length
      const uInt n = static_cast<uInt>(std::min<size_t>(left, 1u << 30));
      crc = crc32(crc, reinterpret_cast<const Bytef*>(p), n);
      p += n;
      left -= n;
    }
    ++tensors;
    values += t.numel();
  }
  return {{"files", base_files(cfg)}, {"crc32", hex32(crc)}, {"tensors", tensors}, {"values", values}};
}

nlohmann::json apply_lora(torch::nn::Module& model, const Config& cfg, bool init_adapters) {
  if (cfg.model.lora.rank == 0) return nullptr;
  const nlohmann::json fingerprint = base_fingerprint(model, cfg);
  const models::LoraOptions o = lora_options(cfg);
  std::vector<std::string> layers;
  try {
    layers = models::add_lora(model, o);
  } catch (const models::LoraError& e) {
    throw ConfigError(std::string("config: ") + e.what());
  }
  if (init_adapters && !cfg.model.lora_init_from.empty()) {
    const hf::PeftAdapter adapter = hf::read_peft_adapter(cfg.model.lora_init_from);
    hf::load_peft_adapter(model, adapter, o, "model.lora_init_from " + cfg.model.lora_init_from);
    spdlog::info("lora: adapters from {} ({} tensors)", cfg.model.lora_init_from, adapter.tensors.size());
  }
  const int64_t total = models::count_parameters(model), trainable = models::trainable_parameters(model);
  std::string targets;
  for (const auto& t : o.targets) targets += (targets.empty() ? "" : ", ") + t;
  spdlog::info("lora: rank {}, alpha {} (scaling {:.4g}{}), on {} layers ({}): {} trainable parameters of {} ({:.3f}%); "
               "base {} values, crc32 {}",
               o.rank, o.alpha, o.scaling(), o.use_rslora ? ", rsLoRA" : "", layers.size(), targets, trainable, total,
               100.0 * static_cast<double>(trainable) / static_cast<double>(std::max<int64_t>(total, 1)),
               fingerprint["values"].get<int64_t>(), fingerprint["crc32"].get<std::string>());
  return fingerprint;
}

std::string model_file_bytes(const torch::nn::Module& model) {
  if (!models::has_lora(model)) return state_dict_bytes(model);
  return tensors_to_bytes(models::lora_state(model));
}

void load_model_file(torch::nn::Module& model, const std::string& bytes, const std::string& source) {
  if (!models::has_lora(model)) {
    load_state_dict_bytes(model, bytes, /*strict=*/true, source);
    return;
  }
  const NamedTensors file = tensors_from_bytes(bytes, source);
  std::set<std::string> wanted, found;
  for (const auto& [name, t] : models::lora_state(model)) wanted.insert(name);
  for (const auto& [name, t] : file) found.insert(name);
  for (const auto& name : found)
    if (!wanted.count(name))
      throw std::runtime_error(source + ": holds '" + name + "', which is not an adapter of this model.lora (" +
                               (is_adapter(name) ? "another rank or targets" : "a checkpoint of a run without LoRA") + ")");
  for (const auto& name : wanted)
    if (!found.count(name)) throw std::runtime_error(source + ": has no '" + name + "' (adapters of other targets)");
  load_state_dict(model, file, /*strict=*/false, source);
}

void load_run_weights(torch::nn::Module& model, const Config& cfg, int64_t vocab, const LoadedCheckpoint* ck,
                      const std::string& file) {
  if (!ck) {
    load_init_weights(model, cfg, vocab);
    apply_lora(model, cfg);
    return;
  }
  const std::string source = ck->path + "/" + file;
  if (cfg.model.lora.rank == 0) {
    load_model_file(model, ck->file(file), source);
    return;
  }
  // The checkpoint holds the adapters; the base is rebuilt as the run built it, and must be the same one.
  if (!cfg.model.init_from.empty()) load_init_weights(model, cfg, vocab);
  const nlohmann::json fingerprint = apply_lora(model, cfg, /*init_adapters=*/false);
  check_lora_base(nlohmann::json::parse(ck->file("state.json"), nullptr, /*allow_exceptions=*/false), fingerprint,
                  ck->path);
  load_model_file(model, ck->file(file), source);
}

void check_lora_base(const nlohmann::json& saved_state, const nlohmann::json& fingerprint, const std::string& checkpoint) {
  const bool saved_lora = saved_state.is_object() && saved_state.contains("lora_base");
  if (!saved_lora && fingerprint.is_null()) return;
  if (!saved_lora || fingerprint.is_null())
    throw std::runtime_error(checkpoint + ": " + (saved_lora ? "holds LoRA adapters, but model.lora.rank is 0"
                                                             : "holds a whole model, but model.lora is set"));
  const nlohmann::json& saved = saved_state["lora_base"];
  if (saved.value("crc32", "") == fingerprint.value("crc32", "")) return;
  throw std::runtime_error(checkpoint + ": its adapters were trained on another base (" + saved["files"].dump() +
                           ", crc32 " + saved.value("crc32", "?") + "); this base is " + fingerprint["files"].dump() +
                           ", crc32 " + fingerprint.value("crc32", "?") + " (model.init_from)");
}

}  // namespace trainer
