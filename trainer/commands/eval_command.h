// `trainer eval`: scores weights on a split with the training run's own evaluation (trainer/step/evaluate.h)
// and reports the result as one JSON file and one line.
//
//   what is scored   the latest checkpoint of a run folder, a chosen checkpoint folder, or the
//                    model.init_from weights of a config (a state dict saved by Python's torch.save)
//   the config       the checkpoint's own (its config.yaml), or --config FILE; --set on top of either
//   the split        test (data.test), train (data.train), or a file (or, for image_folder, a folder) of
//                    the kind the model reads; packed_images and image_folder splits are decoded with the
//                    eval transform and normalized with the training split's mean and std
//   which weights    --weights ema | raw | auto: a checkpoint of a run with train.ema_decay holds the trained
//                    weights (model.pt) and their average (ema.pt); auto (the default) scores the average
//                    where the checkpoint has one, else the trained weights
//   the numbers      images: loss (nats per image), top-1, top-5; tokens: loss (nats per token), bits per
//                    token (= bits per byte for byte tokens, vocabulary 256), top-1, top-5 of the next token
#pragma once

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "models/model.h"
#include "trainer/config/config.h"
#include "trainer/memory/backend.h"
#include "trainer/step/evaluate.h"

namespace trainer {

/// The command line of `trainer eval`.
struct EvalCommand {
  std::string run_dir;                 ///< score this run's latest checkpoint
  std::string checkpoint;              ///< or this checkpoint folder
  std::string config_path;             ///< the config; "" = the checkpoint's own (or the built-in job)
  std::vector<std::string> overrides;  ///< --set assignments, on top of the config
  std::string split = "test";          ///< test | train | a file path
  std::string out;                     ///< the JSON file; "" = <run_dir>/eval.json, or eval.json here
  std::string weights = "auto";        ///< ema | raw | auto (ema where the checkpoint has ema.pt, else raw)
};

/// The checkpoint file `--weights` names: "ema.pt" or "model.pt". `choice` is ema, raw or auto; `has_ema`
/// whether the checkpoint holds ema.pt. Throws ConfigError with one line for another choice, or for ema
/// where there is no average (`what` names the command and the checkpoint).
std::string weights_file(const std::string& choice, bool has_ema, const std::string& what);

/// What is scored, ready to run: the model carries its weights, on its device, in eval mode.
struct EvalTarget {
  Config cfg;
  torch::Device device{torch::kCPU};
  std::unique_ptr<MemoryBackend> memory;  ///< under memory.limit; installed before the model was built
  models::Model model;
  bool tokens = false;                    ///< a language model on a token split
  int64_t vocab_size = 0;                 ///< the language model's vocabulary
  std::shared_ptr<const data::EvalSource> split;  ///< the scored split (data/samples/source.h)
  std::string split_path;
  std::string weights;                    ///< the checkpoint folder or the init_from file
  std::string weight_set = "raw";         ///< "ema" (the checkpoint's ema.pt) or "raw" (model.pt, init_from)
  std::optional<int64_t> step;            ///< the checkpoint's step (none for init_from weights)
  std::optional<data::ImageMeta> input_stats;  ///< decoded images: the mean/std they are normalized with
};

/// Resolves `cmd` into a target. Throws std::runtime_error or ConfigError with one line for bad input:
/// no checkpoint in the run folder, nothing to score, a split the config does not have, a weights file
/// that does not fit the model (names the keys and shapes).
EvalTarget prepare_eval(const EvalCommand& cmd);

/// The evaluation of `target` (train.eval_batch at a time, halved on OOM) as the JSON object
/// `trainer eval` writes (docs/TRANSFORMERS.md, "trainer eval").
nlohmann::json score(EvalTarget& target);

/// The one line for `result`, naming where the JSON went.
std::string eval_line(const nlohmann::json& result, const std::string& out);

/// prepare_eval, score, and the JSON written to the output file (atomically); returns {result, line}.
std::pair<nlohmann::json, std::string> run_eval_command(const EvalCommand& cmd);

}  // namespace trainer
