#include "trainer/hf/families.h"

#include "common/files.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>

namespace fs = std::filesystem;

namespace trainer::hf {
namespace {

[[noreturn]] void bad(const std::string& source, const std::string& what) { throw std::runtime_error(source + ": " + what); }

// config[key] as an integer in [lo, hi]; `fallback` when the key is absent or null (none: required).
int64_t integer(const nlohmann::json& c, const std::string& key, int64_t lo, int64_t hi, const std::string& source,
                std::optional<int64_t> fallback = std::nullopt) {
  if (!c.contains(key) || c[key].is_null()) {
    if (fallback) return *fallback;
    bad(source, "has no " + key);
  }
  const auto& v = c[key];
  if (!v.is_number_integer()) bad(source, key + " is " + v.dump() + ", not an integer");
  const int64_t n = v.get<int64_t>();
  if (n < lo || n > hi)
    bad(source, key + " " + std::to_string(n) + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) +
                    "]" + (n > hi ? " (past any published model: a corrupt or hostile file?)" : ""));
  return n;
}

double number(const nlohmann::json& c, const std::string& key, double fallback, const std::string& source) {
  if (!c.contains(key) || c[key].is_null()) return fallback;
  const auto& v = c[key];
  if (!v.is_number()) bad(source, key + " is " + v.dump() + ", not a number");
  const double x = v.get<double>();
  if (!std::isfinite(x) || x <= 0) bad(source, key + " must be a positive number, got " + v.dump());
  return x;
}

bool boolean(const nlohmann::json& c, const std::string& key, bool fallback, const std::string& source) {
  if (!c.contains(key) || c[key].is_null()) return fallback;
  if (!c[key].is_boolean()) bad(source, key + " is " + c[key].dump() + ", not true or false");
  return c[key].get<bool>();
}

std::string text(const nlohmann::json& c, const std::string& key, const std::string& fallback) {
  return c.contains(key) && c[key].is_string() ? c[key].get<std::string>() : fallback;
}

// rope_theta and the scaling, as transformers 5.23 reads them (PreTrainedConfig.convert_rope_params_to_dict):
// 4.x's rope_scaling, when it is a non-empty object, replaces 5.x's rope_parameters whole, even beside it
// (a note says so); the chosen object's own rope_theta comes first, then the top-level rope_theta, then
// 10000. The type is rope_type, once spelled `type`. A factor below 1 (transformers only warns) is refused.
void read_rope(const nlohmann::json& c, const std::string& source, LlamaConfig& r) {
  if (c.contains("rope_scaling") && !c["rope_scaling"].is_null() && !c["rope_scaling"].is_object())
    bad(source, "rope_scaling is " + c["rope_scaling"].dump() + ", not an object");
  const bool v4 = c.contains("rope_scaling") && c["rope_scaling"].is_object() && !c["rope_scaling"].empty();
  const bool v5 = c.contains("rope_parameters") && c["rope_parameters"].is_object();
  const nlohmann::json rope = v4 ? c["rope_scaling"] : v5 ? c["rope_parameters"] : nlohmann::json::object();
  const std::string where = v4 ? "rope_scaling." : "rope_parameters.";
  const bool mixed = v4 && v5 && c["rope_parameters"] != c["rope_scaling"];
  const std::string over = mixed ? "; transformers 5 reads rope_scaling over rope_parameters" : "";
  if (mixed) r.notes.push_back("rope_scaling and rope_parameters differ: rope_scaling is read, as transformers 5 reads it");
  auto& o = r.options;
  o.rope_theta(number(rope, "rope_theta", number(c, "rope_theta", 10000.0, source), source));
  if (rope.contains("factor") && rope["factor"].is_number() && rope["factor"].get<double>() < 1)
    bad(source, where + "factor " + rope["factor"].dump() + " is below 1 (a rope scaling's factor is at least 1)" + over);
  const std::string type = text(rope, "rope_type", text(rope, "type", "default"));
  if (type == "default") return;
  if (type != "llama3")
    bad(source, where + "rope_type '" + type + "' is not computed here (default and llama3 are)" + over);
  models::RopeScaling s;
  s.type("llama3")
      .factor(number(rope, "factor", 1.0, source))
      .low_freq_factor(number(rope, "low_freq_factor", 1.0, source))
      .high_freq_factor(number(rope, "high_freq_factor", 4.0, source))
      .original_context(integer(rope, "original_max_position_embeddings", 1, kMaxContext, source + " " + where, 8192));
  o.rope_scaling(s);
}

// What the Llama family's config.json may ask that models::Llama does not compute.
void refuse_unsupported(const nlohmann::json& c, const std::string& type, const std::string& source) {
  const std::string act = text(c, "hidden_act", "silu");
  if (act != "silu") bad(source, "hidden_act '" + act + "' is not computed here (the Llama family's is silu)");
  if (type == "llama" && boolean(c, "attention_bias", false, source))
    bad(source, "attention_bias: true (a bias on o_proj too) is not computed here; Qwen2's q/k/v biases are");
  if (boolean(c, "mlp_bias", false, source)) bad(source, "mlp_bias: true is not computed here");
  if (integer(c, "pretraining_tp", 1, 64, source, 1) != 1) bad(source, "pretraining_tp other than 1 is not computed here");
}

}  // namespace

std::string config_json_of(const std::string& path) {
  std::error_code ec;
  const fs::path p(path);
  if (p.extension() == ".json" && p.filename() != "model.safetensors.index.json") return path;
  if (fs::is_directory(p, ec)) return (p / "config.json").string();
  return (p.parent_path().empty() ? fs::path("config.json") : p.parent_path() / "config.json").string();
}

nlohmann::json read_config_json(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) bad(path, "no such file (the model's shape is read from it)");
  require_regular_file(path, "config.json");
  const auto size = fs::file_size(path, ec);
  if (ec) bad(path, "cannot read its size: " + ec.message());
  if (size > (1u << 20)) bad(path, std::to_string(size) + " bytes; a config.json is at most 1 MiB");
  std::ifstream f(path, std::ios::binary);
  std::stringstream buffer;
  buffer << f.rdbuf();
  const auto j = nlohmann::json::parse(buffer.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) bad(path, "not valid JSON");
  if (!j.is_object()) bad(path, "not a JSON object");
  return j;
}

std::string family_of(const nlohmann::json& config) {
  const std::string type = text(config, "model_type", "");
  if (type == "gpt2") return "gpt2";
  if (type == "llama" || type == "qwen2" || type == "mistral") return "llama";
  return "";
}

LlamaConfig llama_from_json(const nlohmann::json& c, const std::string& source) {
  LlamaConfig r;
  r.model_type = text(c, "model_type", "");
  if (family_of(c) != "llama")
    bad(source, "model_type " + (c.contains("model_type") ? c["model_type"].dump() : std::string("missing")) +
                    " is not of the Llama family (llama, qwen2, mistral)");
  refuse_unsupported(c, r.model_type, source);
  auto& o = r.options;
  o.vocab_size(integer(c, "vocab_size", 1, kMaxVocab, source))
      .n_embd(integer(c, "hidden_size", 1, kMaxHidden, source))
      .n_layer(integer(c, "num_hidden_layers", 1, kMaxLayers, source))
      .n_head(integer(c, "num_attention_heads", 1, kMaxHeads, source))
      .intermediate_size(integer(c, "intermediate_size", 1, kMaxIntermediate, source))
      .context(integer(c, "max_position_embeddings", 1, kMaxContext, source, 2048));
  o.n_kv_head(integer(c, "num_key_value_heads", 1, kMaxHeads, source, o.n_head()));
  o.head_dim(integer(c, "head_dim", 1, 4096, source, 0));
  o.rms_norm_eps(number(c, "rms_norm_eps", 1e-6, source));
  o.dropout(c.contains("attention_dropout") && c["attention_dropout"].is_number() ? c["attention_dropout"].get<double>() : 0.0);
  o.tie_embeddings(boolean(c, "tie_word_embeddings", false, source));  // transformers' default for all three
  o.qkv_bias(r.model_type == "qwen2");  // transformers' Qwen2Attention has them always
  read_rope(c, source, r);
  if (r.model_type == "mistral" && c.contains("sliding_window") && c["sliding_window"].is_number_integer()) {
    const int64_t window = integer(c, "sliding_window", 1, kMaxContext, source);
    if (window < o.context()) {
      r.notes.push_back("sliding_window " + std::to_string(window) + ": sequences are limited to it (max_position_embeddings " +
                        std::to_string(o.context()) + "), where full attention computes the same");
      o.context(window);
    }
  }
  try {
    models::check(o);
  } catch (const c10::Error& e) {
    bad(source, e.msg());
  }
  return r;
}

nlohmann::json llama_to_json(const models::LlamaOptions& o, int64_t bos, int64_t eos) {
  const bool qwen = o.qkv_bias();
  nlohmann::json rope = {{"rope_theta", o.rope_theta()}, {"rope_type", o.rope_scaling().type()}};
  if (o.rope_scaling().type() == "llama3") {
    rope["factor"] = o.rope_scaling().factor();
    rope["low_freq_factor"] = o.rope_scaling().low_freq_factor();
    rope["high_freq_factor"] = o.rope_scaling().high_freq_factor();
    rope["original_max_position_embeddings"] = o.rope_scaling().original_context();
  }
  const auto id = [](int64_t v) { return v >= 0 ? nlohmann::json(v) : nlohmann::json(nullptr); };
  nlohmann::json j = {{"architectures", {qwen ? "Qwen2ForCausalLM" : "LlamaForCausalLM"}},
                      {"model_type", qwen ? "qwen2" : "llama"},
                      {"vocab_size", o.vocab_size()},
                      {"hidden_size", o.n_embd()},
                      {"intermediate_size", o.intermediate_size()},
                      {"num_hidden_layers", o.n_layer()},
                      {"num_attention_heads", o.n_head()},
                      {"num_key_value_heads", o.kv_heads()},
                      {"head_dim", o.head_size()},
                      {"max_position_embeddings", o.context()},
                      {"hidden_act", "silu"},
                      {"rms_norm_eps", o.rms_norm_eps()},
                      {"attention_dropout", o.dropout()},
                      {"initializer_range", 0.02},
                      {"tie_word_embeddings", o.tie_embeddings()},
                      {"rope_parameters", rope},
                      {"rope_theta", o.rope_theta()},
                      {"rope_scaling", o.rope_scaling().type() == "llama3" ? rope : nlohmann::json(nullptr)},
                      {"bos_token_id", id(bos)},
                      {"eos_token_id", id(eos)}};
  if (!qwen) j["attention_bias"] = false, j["mlp_bias"] = false;
  return j;
}

void check_llama_weights(const models::LlamaOptions& o, const NamedTensors& weights, const std::string& source) {
  auto find = [&](const std::string& name) -> const torch::Tensor* {
    for (const auto& [k, t] : weights)
      if (k == name) return &t;
    return nullptr;
  };
  auto expect = [&](const std::string& name, std::vector<int64_t> shape, const std::string& from) {
    const torch::Tensor* t = find(name);
    if (t != nullptr && !t->sizes().equals(shape))
      bad(source, "config.json says " + from + ", so " + name + " would be " + c10::str(c10::IntArrayRef(shape)) +
                      ", but the weights' is " + c10::str(t->sizes()));
  };
  const int64_t C = o.n_embd(), hd = o.head_size(), I = o.intermediate_size();
  expect("model.embed_tokens.weight", {o.vocab_size(), C}, "vocab_size " + std::to_string(o.vocab_size()) + ", hidden_size " + std::to_string(C));
  const std::string heads = "num_attention_heads " + std::to_string(o.n_head()) + ", num_key_value_heads " +
                            std::to_string(o.kv_heads()) + ", head_dim " + std::to_string(hd);
  expect("model.layers.0.self_attn.q_proj.weight", {o.n_head() * hd, C}, heads);
  expect("model.layers.0.self_attn.k_proj.weight", {o.kv_heads() * hd, C}, heads);
  expect("model.layers.0.mlp.gate_proj.weight", {I, C}, "intermediate_size " + std::to_string(I));
  if (find("model.layers." + std::to_string(o.n_layer()) + ".input_layernorm.weight") != nullptr)
    bad(source, "config.json says num_hidden_layers " + std::to_string(o.n_layer()) + ", but the weights have model.layers." +
                    std::to_string(o.n_layer()));
  if (!find("model.embed_tokens.weight")) return;  // not this family's file: load_state_dict names what is missing
  if (find("model.layers." + std::to_string(o.n_layer() - 1) + ".input_layernorm.weight") == nullptr)
    bad(source, "config.json says num_hidden_layers " + std::to_string(o.n_layer()) + ", but the weights have no model.layers." +
                    std::to_string(o.n_layer() - 1));
  if (!o.tie_embeddings() && find("lm_head.weight") == nullptr)
    bad(source, "config.json says tie_word_embeddings: false, but the weights have no lm_head.weight");
}

models::GPTOptions gpt2_from_json(const nlohmann::json& c, const std::string& source) {
  if (family_of(c) != "gpt2" && c.contains("model_type"))
    bad(source, "model_type " + c["model_type"].dump() + " is not gpt2");
  const std::string ctx = c.contains("n_positions") ? "n_positions" : "n_ctx";
  models::GPTOptions o;
  o.vocab_size(integer(c, "vocab_size", 1, kMaxVocab, source))
      .context(integer(c, ctx, 1, kMaxContext, source))
      .n_layer(integer(c, "n_layer", 1, kMaxLayers, source))
      .n_head(integer(c, "n_head", 1, kMaxHeads, source))
      .n_embd(integer(c, "n_embd", 1, kMaxHidden, source));
  if (o.n_embd() % o.n_head() != 0)
    bad(source, "n_embd " + std::to_string(o.n_embd()) + " is not a multiple of n_head " + std::to_string(o.n_head()));
  return o;
}

nlohmann::json gpt2_to_json(const models::GPTOptions& o) {
  // GPT-2's <|endoftext|> is 50256; a smaller vocabulary (byte tokens) has no such token.
  const nlohmann::json eot = o.vocab_size() > 50256 ? nlohmann::json(50256) : nlohmann::json(nullptr);
  return {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"vocab_size", o.vocab_size()},
          {"n_positions", o.context()},
          {"n_embd", o.n_embd()},
          {"n_layer", o.n_layer()},
          {"n_head", o.n_head()},
          {"n_inner", nullptr},
          {"activation_function", "gelu_new"},
          {"resid_pdrop", o.dropout()},
          {"embd_pdrop", o.dropout()},
          {"attn_pdrop", o.dropout()},
          {"layer_norm_epsilon", 1e-5},
          {"initializer_range", 0.02},
          {"scale_attn_weights", true},
          {"tie_word_embeddings", true},
          {"bos_token_id", eot},
          {"eos_token_id", eot}};
}

}  // namespace trainer::hf
