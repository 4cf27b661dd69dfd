// transformers' model families, one place each: what a `config.json` says in our options, and our
// options as a `config.json` that transformers' from_pretrained reads with no code of ours.
//
// | family | model_type (architectures)                         | ours              | read                 | written        |
// |--------|----------------------------------------------------|-------------------|----------------------|----------------|
// | GPT-2  | gpt2 (GPT2LMHeadModel)                             | models::GPTOptions| gpt2_from_json       | gpt2_to_json   |
// | Llama  | llama (LlamaForCausalLM), qwen2 (Qwen2ForCausalLM),| models::LlamaOptions | llama_from_json   | llama_to_json  |
// |        | mistral (MistralForCausalLM)                       |                   |                      |                |
//
// The weights' names need no table for the Llama family: models/llama.h uses transformers' own names. The
// one difference, a tied lm_head.weight that transformers may write beside model.embed_tokens.weight, is
// trainer/checkpoint/weights.cpp's, with GPT-2's Conv1D transposes.
//
// Both forms of config.json are read: transformers 4.x (`rope_theta` and `rope_scaling` at the top) and
// 5.x (`rope_parameters`). A config.json that asks for a size past the bounds below, for something this
// trainer does not compute (another activation, o_proj or MLP biases, a rope type other than default and
// llama3), or that contradicts the weights beside it, is one line naming the file and the key.
#pragma once

#include "models/gpt.h"
#include "models/llama.h"
#include "trainer/checkpoint/state_dict.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace trainer::hf {

/// The bounds a config.json is held to (far past every published model: Llama 3.1 405B has hidden 16384,
/// 126 layers, intermediate 53248, vocabulary 128256).
constexpr int64_t kMaxVocab = int64_t{1} << 24;
constexpr int64_t kMaxHidden = int64_t{1} << 16;
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxHeads = 1024;
constexpr int64_t kMaxIntermediate = int64_t{1} << 19;
constexpr int64_t kMaxContext = int64_t{1} << 24;

/// The config.json of a weights path: `path` itself when it names a .json file, `path`/config.json for a
/// folder, else the config.json beside the file.
std::string config_json_of(const std::string& path);

/// Reads a JSON object from `path` (at most 1 MiB). Throws std::runtime_error "PATH: ..." for a missing,
/// oversized or malformed file, or one that is not an object.
nlohmann::json read_config_json(const std::string& path);

/// The family a config.json's model_type names: "gpt2", "llama" (llama, qwen2, mistral), or "" for
/// another (or none).
std::string family_of(const nlohmann::json& config);

/// What a config.json of the Llama family says.
struct LlamaConfig {
  models::LlamaOptions options;
  std::string model_type;          ///< llama, qwen2 or mistral
  std::vector<std::string> notes;  ///< what was read with a caveat, one line each, for the log
};

/// Reads a config.json of the Llama family (transformers 4.x or 5.x). `source` names it in errors.
/// Throws std::runtime_error "SOURCE: KEY ..." for a missing or mistyped key, a size past the bounds, or
/// what is not computed here (hidden_act other than silu, attention_bias on llama (o_proj's bias), mlp_bias,
/// rope types other than default and llama3, pretraining_tp > 1). Mistral's sliding window: full attention
/// is the same function for sequences within the window, so the context is limited to the window (a note).
LlamaConfig llama_from_json(const nlohmann::json& config, const std::string& source);

/// `options` as transformers 5.x writes a config.json (rope_parameters, with rope_theta and rope_scaling
/// also at the top, so that 4.x reads it too): model_type qwen2 for a model with q/k/v biases (Qwen2's
/// attention has them always), else llama. `bos` and `eos` are the tokenizer's ids (-1: none).
nlohmann::json llama_to_json(const models::LlamaOptions& options, int64_t bos = -1, int64_t eos = -1);

/// Checks the shapes of a weights file (our names: transformers' for the Llama family) against `options`:
/// the embedding's rows and width, the number of layers, q/k/v/o and the MLP's shapes, lm_head's presence.
/// Throws std::runtime_error "SOURCE: config.json says ..., but TENSOR is ..." at the first contradiction.
void check_llama_weights(const models::LlamaOptions& options, const NamedTensors& weights, const std::string& source);

/// Reads a GPT-2 config.json (GPT2Config: n_positions or n_ctx, n_embd, n_layer, n_head, vocab_size),
/// held to the bounds above. Throws std::runtime_error "SOURCE: KEY ..." otherwise.
models::GPTOptions gpt2_from_json(const nlohmann::json& config, const std::string& source);

/// transformers' GPT2Config for our GPT: GPT-2's own settings (gelu_new = tanh GELU, LayerNorm eps 1e-5,
/// 1/sqrt(head size) attention scaling, tied embeddings); the sizes from `options` (vocab_size the real
/// vocabulary, without model.vocab_multiple's padding).
nlohmann::json gpt2_to_json(const models::GPTOptions& options);

}  // namespace trainer::hf
