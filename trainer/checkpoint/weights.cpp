#include "trainer/checkpoint/weights.h"

#include "common/files.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace trainer {
namespace {

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// "transformer.h.3.attn.c_attn.weight" -> the part after "h.3." (or "" when it is not a block's name).
std::string block_rest(const std::string& name, const std::string& blocks_prefix) {
  if (!starts_with(name, blocks_prefix)) return "";
  const size_t dot = name.find('.', blocks_prefix.size());
  if (dot == std::string::npos || dot == blocks_prefix.size()) return "";
  for (size_t i = blocks_prefix.size(); i < dot; ++i)
    if (name[i] < '0' || name[i] > '9') return "";
  return name.substr(dot + 1);
}

// GPT-2's Conv1D layers: stored [in, out], nn.Linear's weight is [out, in].
bool is_conv1d_weight(const std::string& name, const std::string& blocks_prefix) {
  const std::string rest = block_rest(name, blocks_prefix);
  return rest == "attn.c_attn.weight" || rest == "attn.c_proj.weight" || rest == "mlp.c_fc.weight" ||
         rest == "mlp.c_proj.weight";
}

// ---- GPT: Hugging Face GPT2LMHeadModel / GPT2Model <-> ours ------------------------------------------------

Translated gpt_from_file(const NamedTensors& file, const std::string& source) {
  Translated out;
  bool has_prefix = false, bare = false;
  for (const auto& [k, t] : file) {
    has_prefix |= starts_with(k, "transformer.");
    bare |= k == "wte.weight";
  }
  // GPT2Model (the Hub's openai-community/gpt2 file) has no `transformer.` in front of its names.
  const bool add_prefix = !has_prefix && bare;
  auto ours = [&](const std::string& k) { return add_prefix && k != "lm_head.weight" ? "transformer." + k : k; };

  // Conv1D or nn.Linear: told by c_attn's orientation, [C, 3C] against [3C, C] (C is never 3C).
  bool conv1d = false;
  for (const auto& [k, t] : file) {
    if (ends_with(ours(k), ".attn.c_attn.weight") && t.dim() == 2) {
      conv1d = t.size(1) == 3 * t.size(0);
      break;
    }
  }
  const torch::Tensor* wte = nullptr;
  for (const auto& [k, t] : file)
    if (ours(k) == "transformer.wte.weight") wte = &t;

  int64_t masks = 0;
  for (const auto& [k, t] : file) {
    const std::string name = ours(k);
    if (starts_with(name, "transformer.h.") && (ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias"))) {
      ++masks;  // the causal mask and its fill value: buffers this model computes, not weights
      continue;
    }
    if (name == "lm_head.weight") {
      if (wte == nullptr || !wte->sizes().equals(t.sizes()) || !torch::equal(*wte, t))
        throw std::runtime_error(source + ": lm_head.weight " +
                                 (wte == nullptr ? std::string("is there but transformer.wte.weight is not")
                                                 : "differs from transformer.wte.weight") +
                                 "; this GPT ties its output projection to the token embedding, and the file's model "
                                 "does not (tie_word_embeddings: false); it cannot be loaded here");
      out.notes.push_back("lm_head.weight: equal to transformer.wte.weight (tied), not loaded twice");
      continue;
    }
    out.tensors.emplace_back(name, conv1d && is_conv1d_weight(name, "transformer.h.") && t.dim() == 2 ? t.t() : t);
  }
  if (masks) out.notes.push_back(std::to_string(masks) + " attn.bias/attn.masked_bias buffers (the causal mask) dropped");
  const bool hf_only = conv1d || add_prefix || masks > 0 ||
                       std::any_of(file.begin(), file.end(), [](const auto& kv) { return kv.first == "lm_head.weight"; });
  if (!hf_only) {
    out.layout = "ours (nn.Linear weights)";
  } else {
    out.layout = std::string("Hugging Face ") + (add_prefix ? "GPT2Model (names without transformer.)" : "GPT2LMHeadModel");
    if (conv1d) out.layout += ", Conv1D weights transposed";
  }
  return out;
}

// ---- Llama family: transformers' LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM <-> ours -------------

// The names are transformers' own (models/llama.h). A tied model has no lm_head: a file that still holds
// lm_head.weight (some writers keep both) loads when it equals the embedding.
Translated llama_from_file(const NamedTensors& file, const NamedTensors& own, const std::string& source) {
  Translated out;
  out.layout = "Hugging Face Llama family (transformers' names)";
  const bool tied = std::none_of(own.begin(), own.end(), [](const auto& kv) { return kv.first == "lm_head.weight"; });
  const torch::Tensor* embed = nullptr;
  for (const auto& [k, t] : file)
    if (k == "model.embed_tokens.weight") embed = &t;
  for (const auto& [k, t] : file) {
    if (k == "lm_head.weight" && tied) {
      if (embed == nullptr || !embed->sizes().equals(t.sizes()) || !torch::equal(*embed, t))
        throw std::runtime_error(source + ": lm_head.weight differs from model.embed_tokens.weight, but the model ties "
                                 "them (tie_word_embeddings: true); the file's model does not");
      out.notes.push_back("lm_head.weight: equal to model.embed_tokens.weight (tied), not loaded twice");
      continue;
    }
    out.tensors.emplace_back(k, t);
  }
  return out;
}

// ---- ViT: timm <-> ours ----------------------------------------------------------------------------------

// timm name part -> ours, inside blocks.N. and at the top level.
const std::vector<std::pair<std::string, std::string>>& vit_block_names() {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"norm1.", "ln_1."},         {"attn.qkv.", "attn.c_attn."}, {"attn.proj.", "attn.c_proj."},
      {"norm2.", "ln_2."},         {"mlp.fc1.", "mlp.c_fc."},     {"mlp.fc2.", "mlp.c_proj."}};
  return names;
}
const std::vector<std::pair<std::string, std::string>>& vit_top_names() {
  static const std::vector<std::pair<std::string, std::string>> names = {{"patch_embed.proj.", "patch_embed."},
                                                                          {"norm.", "ln_f."}};
  return names;
}

// Renames `name` by the first table entry whose `from` side starts it (inside blocks.N. for block names).
std::string vit_rename(const std::string& name, bool to_ours) {
  const std::string rest = block_rest(name, "blocks.");
  const auto& table = rest.empty() ? vit_top_names() : vit_block_names();
  const std::string head = rest.empty() ? "" : name.substr(0, name.size() - rest.size());
  const std::string& tail = rest.empty() ? name : rest;
  for (const auto& [timm, ours] : table) {
    const std::string& from = to_ours ? timm : ours;
    const std::string& to = to_ours ? ours : timm;
    if (starts_with(tail, from)) return head + to + tail.substr(from.size());
  }
  return name;
}

Translated vit_from_file(const NamedTensors& file) {
  Translated out;
  bool timm = false;
  for (const auto& [k, t] : file)
    timm |= starts_with(k, "patch_embed.proj.") || starts_with(k, "norm.") ||
            block_rest(k, "blocks.").rfind("norm1.", 0) == 0 || block_rest(k, "blocks.").rfind("attn.qkv.", 0) == 0;
  out.layout = timm ? "timm VisionTransformer" : "ours";
  for (const auto& [k, t] : file) out.tensors.emplace_back(timm ? vit_rename(k, true) : k, t);
  return out;
}

// transformers' sharded form: model.safetensors.index.json maps every tensor to one of the shards beside it.
// Each shard is read once; a tensor the index names must be in its shard, and a shard must be a plain file
// name in the same folder (no path in it).
WeightsFile read_sharded(const std::string& index_path) {
  require_regular_file(index_path, "weights index");
  std::error_code ec;
  if (std::filesystem::file_size(index_path, ec) > (64u << 20))  // a 405B model's index is about 0.1 MiB
    throw std::runtime_error(index_path + ": over 64 MiB; a safetensors index is a small JSON file");
  std::ifstream f(index_path, std::ios::binary);
  const auto index = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw std::runtime_error(index_path + ": not a safetensors index (a JSON object with a weight_map)");
  std::map<std::string, std::vector<std::string>> shards;  // shard file -> the tensors the index puts there
  for (const auto& [name, shard] : index["weight_map"].items()) {
    const std::string file = shard.is_string() ? shard.get<std::string>() : "";
    if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
      throw std::runtime_error(index_path + ": weight_map[" + name + "] is " + shard.dump() + ", not a file name beside the index");
    shards[file].push_back(name);
  }
  const std::string folder = std::filesystem::path(index_path).parent_path().string();
  WeightsFile w;
  w.format = "safetensors";
  for (const auto& [file, names] : shards) {
    const std::string shard_path = (folder.empty() ? file : folder + "/" + file);
    SafetensorsContents c = read_safetensors(shard_path);
    std::unordered_set<std::string> present;
    for (auto& [k, t] : c.tensors) present.insert(k);
    for (const auto& name : names)
      if (!present.count(name)) throw std::runtime_error(index_path + ": " + name + " is not in " + shard_path + ", where the index puts it");
    for (auto& kv : c.tensors) w.tensors.push_back(std::move(kv));
  }
  return w;
}

}  // namespace

WeightsFile read_weights(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    // A Hub folder: one model.safetensors, or the sharded form.
    const std::string single = path + "/model.safetensors", index = path + "/model.safetensors.index.json";
    if (std::filesystem::exists(single, ec)) return read_weights(single);
    if (std::filesystem::exists(index, ec)) return read_sharded(index);
    throw std::runtime_error(path + ": a folder with neither model.safetensors nor model.safetensors.index.json");
  }
  if (ends_with(path, ".index.json")) return read_sharded(path);
  require_regular_file(path, "weights file");
  std::string prefix(16, '\0');
  {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error(path + ": cannot open the weights file: " + std::strerror(errno));
    f.read(&prefix[0], static_cast<std::streamsize>(prefix.size()));
    prefix.resize(static_cast<size_t>(f.gcount()));
  }
  WeightsFile w;
  if (looks_like_safetensors(prefix)) {
    SafetensorsContents c = read_safetensors(path);
    w.tensors = std::move(c.tensors);
    w.metadata = std::move(c.metadata);
    w.format = "safetensors";
    return w;
  }
  if (prefix.size() >= 4 && prefix.compare(0, 4, "PK\x03\x04") == 0) {
    w.tensors = read_tensors(path);
    w.format = "torch.save";
    return w;
  }
  if (prefix.size() >= 2 && static_cast<uint8_t>(prefix[0]) == 0x80) return {read_tensors(path), "torch.save", {}};  // its legacy-format error
  if (ends_with(path, ".safetensors")) return {read_safetensors(path).tensors, "safetensors", {}};  // its own error
  throw std::runtime_error(path + " is neither a safetensors file nor a torch.save archive (" +
                           (prefix.empty() ? std::string("empty") : "its first bytes are neither a header length and '{' nor 'PK'") + ")");
}

std::string to_string(Layout layout) {
  switch (layout) {
    case Layout::ours: return "ours";
    case Layout::hf: return "hf";
    case Layout::timm: return "timm";
  }
  return "?";
}

Layout parse_layout(const std::string& name) {
  if (name == "ours") return Layout::ours;
  if (name == "hf") return Layout::hf;
  if (name == "timm") return Layout::timm;
  throw std::invalid_argument("layout '" + name + "' is not one of: ours, hf, timm");
}

Family family_of(const NamedTensors& own) {
  std::unordered_set<std::string> names;
  for (const auto& [k, t] : own) names.insert(k);
  if (names.count("transformer.wte.weight")) return Family::gpt;
  if (names.count("model.embed_tokens.weight")) return Family::llama;
  if (names.count("cls_token") && names.count("pos_embed")) return Family::vit;
  if (names.count("conv1.weight") && names.count("bn1.weight") && names.count("fc.weight")) return Family::resnet;
  return Family::other;
}

Translated to_our_layout(const NamedTensors& file, const NamedTensors& own, const std::string& source) {
  Translated out;
  switch (family_of(own)) {
    case Family::gpt: out = gpt_from_file(file, source); break;
    case Family::llama: out = llama_from_file(file, own, source); break;
    case Family::vit: out = vit_from_file(file); break;
    case Family::resnet:
      out.tensors = file;
      out.layout = "torchvision / timm (the same names)";
      break;
    case Family::other:
      out.tensors = file;
      out.layout = "ours";
      break;
  }
  // BatchNorm's step counter: torchvision's published weights predate it; PyTorch fills in 0.
  std::unordered_set<std::string> present;
  for (const auto& [k, t] : out.tensors) present.insert(k);
  int64_t filled = 0;
  for (const auto& [k, t] : own) {
    if (ends_with(k, ".num_batches_tracked") && !present.count(k)) {
      out.tensors.emplace_back(k, torch::zeros_like(t, at::TensorOptions().device(at::kCPU)));
      ++filled;
    }
  }
  if (filled) out.notes.push_back(std::to_string(filled) + " BatchNorm num_batches_tracked counters not in the file, set to 0");
  return out;
}

NamedTensors from_our_layout(const NamedTensors& own, Layout layout) {
  const Family family = family_of(own);
  if (layout == Layout::ours) return own;
  NamedTensors out;
  if (layout == Layout::hf) {
    if (family == Family::llama) return own;  // transformers' names already
    if (family != Family::gpt)
      throw std::invalid_argument("layout hf (transformers' GPT2LMHeadModel, LlamaForCausalLM) is for language models; for "
                                  "ResNets and ViTs use ours or timm");
    for (const auto& [k, t] : own)
      out.emplace_back(k, is_conv1d_weight(k, "transformer.h.") && t.dim() == 2 ? t.t() : t);
    return out;
  }
  // timm
  if (family == Family::resnet) return own;
  if (family != Family::vit)
    throw std::invalid_argument(std::string("layout timm is for ResNets and ViTs; ") +
                                (family == Family::gpt     ? "for a GPT use hf (transformers) or ours"
                                 : family == Family::llama ? "for a Llama-family model use hf (transformers) or ours"
                                                           : "use ours"));
  for (const auto& [k, t] : own) out.emplace_back(vit_rename(k, false), t);
  return out;
}

namespace {

constexpr const char* kWte = "transformer.wte.weight";

torch::Tensor* find_tensor(NamedTensors& tensors, const std::string& name) {
  for (auto& [k, t] : tensors)
    if (k == name) return &t;
  return nullptr;
}

}  // namespace

NamedTensors without_vocab_padding(NamedTensors tensors, int64_t vocab) {
  if (torch::Tensor* wte = find_tensor(tensors, kWte); wte != nullptr && vocab > 0 && wte->size(0) > vocab)
    *wte = wte->narrow(0, 0, vocab).contiguous();
  return tensors;
}

LoadedWeights load_weights(torch::nn::Module& module, const std::string& path, const std::vector<std::string>& skip,
                           int64_t vocab) {
  WeightsFile file = read_weights(path);
  NamedTensors own = named_state(module);
  Translated t = to_our_layout(file.tensors, own, path);
  // A padded model (model.vocab_multiple) from a file of the real vocabulary: the padding rows are zeros.
  torch::Tensor* mine = find_tensor(own, kWte);
  torch::Tensor* theirs = find_tensor(t.tensors, kWte);
  if (vocab > 0 && mine != nullptr && theirs != nullptr && theirs->dim() == 2 && theirs->size(0) == vocab &&
      mine->size(0) > vocab && theirs->size(1) == mine->size(1)) {
    const int64_t rows = mine->size(0);
    *theirs = torch::cat({*theirs, torch::zeros({rows - vocab, theirs->size(1)}, theirs->options())});
    t.notes.push_back(std::string(kWte) + ": " + std::to_string(vocab) + " rows, padded with zero rows to " +
                      std::to_string(rows) + " (model.vocab_multiple)");
  }
  LoadedWeights r;
  r.format = file.format;
  r.layout = t.layout;
  r.notes = std::move(t.notes);
  try {
    r.skipped_keys = load_state_dict(module, t.tensors, /*strict=*/true, path, skip).skipped_keys;
  } catch (const std::runtime_error& e) {
    // The same line, with the layout that was recognised: "unexpected keys" then says which names were read.
    throw std::runtime_error(std::string(e.what()) + " (" + file.format + ", read as the " + t.layout + " layout)");
  }
  return r;
}

}  // namespace trainer
