// model.lora in a run, and in every command that rebuilds a run's model (eval, sample, export): the
// adapters added to the base, the base's fingerprint, and the weights file of a checkpoint.
//
// A LoRA run's checkpoint holds the adapters only (model.pt: `<layer>.lora_A.weight`, `<layer>.lora_B.weight`),
// their optimizer state, and in state.json the fingerprint of the frozen base they were trained on: the
// weights' file names (model.init_from's, or "initialized from seed N") and a CRC32 over every base
// tensor's bytes. The base itself is rebuilt as the run first built it (model.init_from, or the seed), and
// a resume, eval, sample or export whose base has another fingerprint is refused in one line.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <string>

#include "models/lora.h"
#include "trainer/checkpoint/store.h"
#include "trainer/config/config.h"

namespace trainer {

/// model.lora's options, its targets defaulted to peft's for the model (default_lora_targets).
models::LoraOptions lora_options(const Config& cfg);

/// The fingerprint of `model`'s base: {"files": [...], "crc32": "xxxxxxxx", "tensors": N, "values": N}. Every
/// parameter and buffer that is not an adapter, in state-dict order, in the dtype it has now (call it
/// before the weights move to bfloat16, as apply_lora does).
nlohmann::json base_fingerprint(const torch::nn::Module& model, const Config& cfg);

/// model.lora.rank > 0: after model.init_from's weights are in, adds the adapters (every other weight
/// frozen), loads model.lora_init_from's (with init_adapters: a checkpoint's adapters replace them), and returns the base's fingerprint; null json when LoRA is off.
/// Logs the trainable parameters. Throws ConfigError (one line) for targets or a rank the model does not
/// have, and std::runtime_error for a PEFT folder that does not fit.
nlohmann::json apply_lora(torch::nn::Module& model, const Config& cfg, bool init_adapters = true);

/// The weights of a run's model (built by build_model) for eval, sample and export: without a checkpoint,
/// model.init_from's (and with LoRA fresh or model.lora_init_from's adapters); from checkpoint `ck`, its
/// file `file` (model.pt or ema.pt), with LoRA onto the base rebuilt from model.init_from (or the seed)
/// after check_lora_base.
void load_run_weights(torch::nn::Module& model, const Config& cfg, int64_t vocab, const LoadedCheckpoint* ck,
                      const std::string& file);

/// The bytes of a checkpoint's model.pt: the whole state dict, or with LoRA the adapters alone.
std::string model_file_bytes(const torch::nn::Module& model);

/// Loads a checkpoint's model.pt (or ema.pt) into `model` (built with build_model, model.init_from loaded,
/// apply_lora applied): strictly, every key and shape; with LoRA, the file holds the adapters and exactly
/// them. `source` names the file in errors.
void load_model_file(torch::nn::Module& model, const std::string& bytes, const std::string& source);

/// Refuses (std::runtime_error, one line naming `checkpoint`) a base whose fingerprint differs from the
/// one the checkpoint's state.json records (`saved_state`); nothing when the checkpoint has no LoRA.
void check_lora_base(const nlohmann::json& saved_state, const nlohmann::json& fingerprint, const std::string& checkpoint);

}  // namespace trainer
