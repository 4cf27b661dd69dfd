#include "trainer/commands/eval_command.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <spdlog/spdlog.h>

#include "common/clock.h"
#include "common/compat.h"
#include "common/files.h"
#include "common/run_lock.h"
#include "data/files/image_h5.h"
#include "data/files/token_h5.h"
#include "data/samples/dataset.h"
#include "models/registry.h"
#include "trainer/checkpoint/state_dict.h"
#include "trainer/checkpoint/store.h"
#include "trainer/memory/resources.h"
#include "trainer/numerics/amp.h"
#include "trainer/run/from_config.h"
#include "trainer/run/lora.h"

namespace fs = std::filesystem;

namespace trainer {
namespace {

std::optional<LoadedCheckpoint> find_weights(const EvalCommand& c) {
  if (!c.checkpoint.empty()) return CheckpointStore::load(c.checkpoint);
  if (c.run_dir.empty()) return std::nullopt;
  auto ck = CheckpointStore(c.run_dir, 0).load_latest();
  if (!ck) throw std::runtime_error("eval: " + c.run_dir + " has no checkpoint to score");
  return ck;
}

// defaults < the config (the checkpoint's own unless --config names one) < --set, then validate.
Config eval_config(const EvalCommand& c, const std::optional<LoadedCheckpoint>& ck) {
  if (!ck || !c.config_path.empty()) return load_config(c.config_path, c.overrides);
  Config cfg;
  apply_yaml_text(cfg, ck->file("config.yaml"), ck->path + "/config.yaml");
  for (const auto& o : c.overrides) apply_override(cfg, o);
  validate(cfg);
  return cfg;
}

std::string split_path(const Config& cfg, const std::string& split) {
  if (split != "test" && split != "train") return split;
  if (cfg.data.kind == DataKind::kSynthetic)
    throw ConfigError("eval: data.kind synthetic has no " + split + " split; give --split FILE");
  const std::string& path = split == "test" ? cfg.data.test : cfg.data.train;
  if (path.empty()) throw ConfigError("eval: data." + split + " is empty; give --split train or --split FILE");
  return path;
}

// The vocabulary the scored model was built with: vocab_size(cfg), which reads the training file;
// where that file is not at hand, the split's.
int64_t model_vocab(const Config& cfg, const data::TokenSource& split) {
  std::error_code ec;
  if (cfg.data.kind == DataKind::kTokens && cfg.model.vocab_size == 0 && !fs::exists(cfg.data.train, ec)) return split.vocab_size();
  return vocab_size(cfg);
}

// The device, the threads and the memory cap, before any tensor exists (the cap counts every one).
void setup_device(EvalTarget& t) {
  t.device = resolve_device(t.cfg.train.device);
  validate_amp(t.cfg.amp.enabled, t.cfg.amp.dtype, false, t.device.type());
  apply_cpu_threads(cpu_threads(t.cfg, 1));
  t.memory = make_memory_backend(t.device);
  const AutoLimitOptions o = auto_limit_options(t.cfg, t.device.is_cuda());
  t.memory->set_limit(resolve_memory_limit(t.cfg.memory.limit, *t.memory, o));
}

// packed_images and image_folder: the split decoded with the eval transform (resize, center crop) and
// normalized, as the run's own evaluation was, with the training split's mean and std. Those come from
// data.train where it can be opened (a packed file's header; an image folder's sample of 1000 files), else
// from the scored split itself, with a warning.
void open_encoded_split(EvalTarget& t) {
  const int threads = t.cfg.data.workers > 0 ? static_cast<int>(t.cfg.data.workers) : at::get_num_threads();
  std::shared_ptr<data::ImageDataset> train, split;
  std::error_code ec;
  if (t.split_path == t.cfg.data.train || (!t.cfg.data.train.empty() && fs::exists(t.cfg.data.train, ec))) {
    train = encoded_image_dataset(t.cfg, t.cfg.data.train, /*train=*/true, nullptr, threads);
    split = encoded_image_dataset(t.cfg, t.split_path, /*train=*/false, &train->meta(), threads);
  } else {  // the split opens first: a split that is not there is the one line, with no warning before it
    split = encoded_image_dataset(t.cfg, t.split_path, /*train=*/false, nullptr, threads);
    spdlog::warn("eval: data.train ({}) is not at hand; normalizing with the mean and std of {} itself",
                 t.cfg.data.train.empty() ? "empty" : t.cfg.data.train, t.split_path);
  }
  t.input_stats = train ? train->meta() : split->meta();
  t.split = std::make_shared<data::ImageEvalSource>(split);
}

}  // namespace

std::string weights_file(const std::string& choice, bool has_ema, const std::string& what) {
  if (choice != "auto" && choice != "ema" && choice != "raw")
    throw ConfigError(what + ": --weights '" + choice + "' is not one of: ema, raw, auto");
  if (choice == "ema" && !has_ema)
    throw ConfigError(what + " has no averaged weights for --weights ema (ema.pt: a checkpoint of a run with "
                      "train.ema_decay > 0); use --weights raw");
  return choice == "raw" || !has_ema ? "model.pt" : "ema.pt";
}

namespace {

void build_scored_model(EvalTarget& t, const std::optional<LoadedCheckpoint>& ck) {
  std::vector<int64_t> shape;
  if (t.tokens) {
    shape = sample_shape(t.cfg);
    t.vocab_size = model_vocab(t.cfg, *static_cast<const data::TokenEvalSource&>(*t.split).dataset());
  } else {
    const auto s = static_cast<const data::ImageEvalSource&>(*t.split).dataset()->sample_shape();
    shape = {s[0], s[1], s[2]};
  }
  torch::manual_seed(t.cfg.seed);
  t.model = build_model(t.cfg, shape, t.vocab_size);
  const std::string file = t.weight_set == "ema" ? "ema.pt" : "model.pt";
  load_run_weights(*t.model, t.cfg, t.vocab_size, ck ? &*ck : nullptr, file);
  t.model->to(t.device);
  if (t.cfg.model.channels_last && !t.tokens) models::to_channels_last(*t.model);
  t.model->eval();
}

}  // namespace

EvalTarget prepare_eval(const EvalCommand& cmd) {
  const std::optional<LoadedCheckpoint> ck = find_weights(cmd);
  EvalTarget t;
  t.cfg = eval_config(cmd, ck);
  if (!ck && t.cfg.model.init_from.empty())
    throw ConfigError("eval: nothing to score; give --run-dir, --checkpoint, or weights as --set model.init_from=FILE");
  t.weights = ck ? ck->path : t.cfg.model.init_from;
  if (ck) t.step = ck->step;
  const bool has_ema = ck && ck->files.count("ema.pt") > 0;
  t.weight_set = weights_file(cmd.weights, has_ema, "eval: " + t.weights) == "ema.pt" ? "ema" : "raw";
  t.tokens = token_job(t.cfg);
  t.split_path = split_path(t.cfg, cmd.split);
  setup_device(t);
  if (encoded_image_job(t.cfg)) {
    open_encoded_split(t);
  } else {
    check_data_file(t.cfg, t.split_path, t.cfg.data.in_memory);
    if (t.tokens)
      t.split = std::make_shared<data::TokenEvalSource>(std::make_shared<data::TokenDataset>(t.split_path, t.cfg.data.in_memory));
    else
      t.split = std::make_shared<data::ImageEvalSource>(std::make_shared<data::ImageH5Dataset>(t.split_path, t.cfg.data.in_memory));
  }
  build_scored_model(t, ck);
  return t;
}

nlohmann::json score(EvalTarget& t) {
  const auto t0 = std::chrono::steady_clock::now();
  int64_t micro_batch = t.cfg.train.eval_batch, backoffs = 0;
  EvalHooks hooks;
  hooks.backoff = [&](int64_t, int64_t) { ++backoffs; };
  EvalSettings settings = eval_settings(t.cfg, t.device);
  if (t.input_stats) set_input_normalization(settings.forward, *t.input_stats, t.cfg.data.normalize, t.device);
  const EvalResult r = evaluate_split(*t.model, *t.split, settings, *t.memory, micro_batch, nullptr, hooks);
  nlohmann::json j = {{"schema", "trainer-eval/1"},
                      {"weights", t.weights},
                      {"weight_set", t.weight_set},
                      {"step", t.step ? nlohmann::json(*t.step) : nlohmann::json(nullptr)},
                      {"model", t.cfg.model.name},
                      {"kind", t.tokens ? "tokens" : "images"},
                      {"split", t.split_path},
                      {"loss", r.loss},
                      {"top1", r.top1},
                      {"top5", r.top5},
                      {"samples", r.samples},
                      {"eval_batch", t.cfg.train.eval_batch},
                      {"eval_batches", t.cfg.train.eval_batches},
                      {"micro_batch", micro_batch},
                      {"backoffs", backoffs},
                      {"device", t.device.str()},
                      {"seconds", seconds_since(t0)},
                      {"trainer", TRAINER_VERSION},
                      {"torch", compat::torch_version()}};
  if (t.tokens) {
    j["context"] = t.cfg.model.context;
    j["vocab_size"] = t.vocab_size;
    j["bits_per_token"] = r.loss / std::log(2.0);
    if (t.vocab_size == 256) j["bits_per_byte"] = r.loss / std::log(2.0);  // byte tokens (convert-text)
  }
  return j;
}

std::string eval_line(const nlohmann::json& j, const std::string& out) {
  char numbers[160];
  if (j["kind"] == "tokens") {
    const bool bytes = j.contains("bits_per_byte");
    std::snprintf(numbers, sizeof numbers, "loss %.4f nats/token, %.4f bits/%s, top1 %.2f%% over %lld tokens",
                  j["loss"].get<double>(), j["bits_per_token"].get<double>(), bytes ? "byte" : "token",
                  100 * j["top1"].get<double>(), static_cast<long long>(j["samples"].get<int64_t>()));
  } else {
    std::snprintf(numbers, sizeof numbers, "loss %.4f, top1 %.2f%%, top5 %.2f%% over %lld images",
                  j["loss"].get<double>(), 100 * j["top1"].get<double>(), 100 * j["top5"].get<double>(),
                  static_cast<long long>(j["samples"].get<int64_t>()));
  }
  const std::string what = j["step"].is_null() ? j["weights"].get<std::string>()
                                               : "step " + std::to_string(j["step"].get<int64_t>()) + " (" +
                                                     j["weights"].get<std::string>() + ")";
  const std::string set = j.value("weight_set", "raw") == "ema" ? ", averaged weights" : "";
  return "eval " + what + set + " on " + j["split"].get<std::string>() + ": " + numbers + " -> " + out;
}

namespace {

// eval reads a run folder that a trainer holds (its checkpoints are written atomically), but never
// writes into one: not into the folder of the output file, nor any folder above it.
void check_not_in_held_folder(const std::string& out) {
  std::error_code ec;
  for (fs::path dir = fs::weakly_canonical(fs::absolute(out, ec), ec).parent_path(); !dir.empty();
       dir = dir.parent_path()) {
    if (auto holder = RunFolderLock::held_by_other(dir.string()))
      throw std::runtime_error("eval: " + dir.string() + ": the run folder is in use by " + holder->describe() +
                               "; eval reads its checkpoints but writes nothing into it: give --out FILE elsewhere");
    if (dir == dir.root_path()) break;
  }
}

}  // namespace

std::pair<nlohmann::json, std::string> run_eval_command(const EvalCommand& cmd) {
  const std::string out = !cmd.out.empty() ? cmd.out : cmd.run_dir.empty() ? "eval.json" : cmd.run_dir + "/eval.json";
  check_not_in_held_folder(out);  // before the scoring, which may take minutes
  EvalTarget target = prepare_eval(cmd);
  const nlohmann::json result = score(target);
  write_file_atomically(out, result.dump(2) + "\n", "eval");
  return {result, eval_line(result, out)};
}

}  // namespace trainer
