// `trainer sample`: text from a GPT (nanoGPT's sample.py), decoded and printed.
//
//   the weights      the latest checkpoint of a run folder, a chosen checkpoint folder, or a weights file
//                    (--init-from: safetensors or torch.save, our names or transformers' GPT-2, as
//                    model.init_from reads them). The model's shape is the run's config; for a weights file
//                    without a run, the config.json beside it (transformers' save_pretrained and
//                    `trainer export --layout hf` write one).
//   the tokenizer    --tokenizer FILE, else the one the run's token file records (data.train's
//                    tokenizer_path), else bytes (token = byte, for the byte-level models of convert-text;
//                    a model whose vocabulary is over 256 needs --tokenizer)
//   the prompt       encoded by the tokenizer; empty means `<|endoftext|>` where the tokenizer has it. A
//                    prompt longer than the model's context is refused (exit 2), not cropped.
//   each sample      printed as the prompt and its continuation, decoded (invalid UTF-8 as U+FFFD), then a
//                    line of dashes; it stops early at `<|endoftext|>` (not printed) where the tokenizer
//                    has it. The speed goes to stderr; --json FILE writes every token and the speed.
//   decoding         trainer/numerics/generate.h: temperature (0 = greedy), top-k, a generator seeded by --seed, the
//                    key-value cache (--no-kv-cache runs the whole window per token)
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/numerics/generate.h"

namespace trainer {

/// The command line of `trainer sample`.
struct SampleCommand {
  std::string run_dir;                 ///< the run's latest checkpoint (and its config)
  std::string checkpoint;              ///< or this checkpoint folder
  std::string init_from;               ///< or this weights file (with --run-dir: the run's config, these weights)
  std::string lora;                    ///< with init_from alone: a peft LoRA adapter folder on those weights
  std::string tokenizer;               ///< a tokenizer file; "" = the run's, or bytes
  std::vector<std::string> overrides;  ///< --set assignments on the run's config (or the defaults: train.threads)
  std::string device;                  ///< "" = the config's train.device (auto)
  std::string prompt;                  ///< the text the samples continue
  int64_t num_samples = 1;             ///< samples, one after the other
  GenerateOptions generate;            ///< tokens, temperature, top-k, seed, cache
  std::string json;                    ///< write the samples' tokens and the speed here ("" = no file)
};

/// What `trainer sample` made: the texts to print, the line for stderr, the JSON of --json.
struct SampleResult {
  std::vector<std::string> texts;  ///< one per sample: prompt + continuation, decoded, printable
  std::string speed_line;          ///< "sample: N tokens in S s, R tokens/s (...)"
  nlohmann::json json;             ///< schema trainer-sample/1
};

/// Loads the model and the tokenizer, encodes the prompt, generates and decodes. Throws
/// std::runtime_error (or ConfigError) with one line for bad input: nothing to sample from, no
/// checkpoint, a model that is not a GPT, a prompt longer than the context or outside the vocabulary, a
/// vocabulary the byte tokenizer cannot decode, bad numbers (tokens, temperature, top-k, samples).
SampleResult run_sample_command(const SampleCommand& cmd);

}  // namespace trainer
