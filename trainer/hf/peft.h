// peft's LoRA adapter folders, both ways: `adapter_config.json` and `adapter_model.safetensors`, as
// `PeftModel.save_pretrained` writes them and `PeftModel.from_pretrained(base, DIR)` reads them.
//
// The adapters' names in the file are peft's: ours (models/lora.h) behind `base_model.model.`, e.g.
// `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`. Only plain LoRA is read: a folder of
// another method (peft_type other than LORA), of a variant this trainer does not compute (DoRA, lora_bias,
// QA-LoRA, aLoRA, ..., bias other than "none"), or with adapters on only some of the targeted layers or
// other trained tensors beside them (rank_pattern / alpha_pattern, layers_to_transform, exclude_modules,
// modules_to_save, trainable_token_indices, a target_modules regular expression) is one line naming the
// file and what it asks for.
//
// How A and B started (init_lora_weights: gaussian, eva, pissa, olora, corda, loftq, ...) makes no
// difference to what they compute, and is read. PiSSA, OLoRA, CorDA and LoftQ also change the base weights
// at init: such a folder fits the changed base it was trained on, unless peft converted it to a plain one
// (save_pretrained's path_initial_model_for_weight_conversion, which writes init_lora_weights true).
#pragma once

#include "models/lora.h"
#include "trainer/checkpoint/state_dict.h"

#include <string>

namespace trainer::hf {

/// An adapter folder read back.
struct PeftAdapter {
  models::LoraOptions options;  ///< r, lora_alpha, lora_dropout, target_modules, use_rslora
  std::string base_model;       ///< base_model_name_or_path ("" when absent)
  NamedTensors tensors;         ///< our names (the `base_model.model.` prefix removed), the file's dtypes
};

/// Reads `dir`/adapter_config.json and `dir`/adapter_model.safetensors (or adapter_model.bin). Throws
/// std::runtime_error, one line naming the file: missing files, malformed JSON, a method or variant not
/// computed here, a tensor name that is not an adapter's (DoRA's lora_magnitude_vector, an embedding's
/// lora_embedding_A, a module saved whole), an A or B without its other half or not of rank r.
PeftAdapter read_peft_adapter(const std::string& dir);

/// Loads `adapter` into `model`, whose adapters (add_lora) must be the folder's: the same rank, the same
/// targets (as sets), every adapted layer's A and B present with the model's shapes, and nothing else.
/// `options` are the run's (model.lora.*): targets, when set, must be the folder's too; alpha, dropout and
/// use_rslora are the run's, and a file's alpha or use_rslora that differs is logged, not refused (it is a
/// training choice). Throws std::runtime_error, one line naming `source` and the first mismatch
/// ("SOURCE: rank 8, but model.lora.rank is 16"); nothing is copied then. The tensors are copied in place
/// (the optimizer's references stay valid), converted to the adapters' dtype and device.
void load_peft_adapter(torch::nn::Module& model, const PeftAdapter& adapter, const models::LoraOptions& options,
                       const std::string& source);

/// Writes `adapters` (our names, models::lora_state's: `<layer>.lora_A.weight`, `<layer>.lora_B.weight`) to
/// `dir` (created if missing) as peft does: adapter_model.safetensors with peft's names, in float32 as
/// trained, and adapter_config.json (peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, lora_dropout,
/// target_modules: the adapted layers' names, sorted, use_rslora, bias "none", fan_in_fan_out: true for
/// GPT-2, whose layers transformers keeps as Conv1D, base_model_name_or_path: null when ""). Each file is
/// written atomically. Throws std::runtime_error naming the file that could not be written.
void write_peft_adapter(const NamedTensors& adapters, const models::LoraOptions& options, const std::string& dir,
                        const std::string& base_model, bool gpt2);

}  // namespace trainer::hf
