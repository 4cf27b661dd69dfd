#include "trainer/config/config.h"

#include "common/compat.h"
#include "models/registry.h"
#include "trainer/config/default_config.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/resources.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <functional>
#include <set>
#include <sstream>
#include <variant>

namespace trainer {
namespace {

// A typed pointer into a Config: the one table below drives parsing, overrides and the dump.
using FieldRef = std::variant<int64_t*, uint64_t*, double*, bool*, std::string*, std::vector<int64_t>*,
                              std::vector<double>*, std::vector<std::string>*>;

struct Field {
  std::string key;    // dotted: "train.global_batch"
  FieldRef ref;
  bool allow_auto;    // integer keys that also take `auto` (stored as -1)
};

// The table, one function per section of the config; fields() joins them, in this order.
std::vector<Field> model_fields(Config& c) {  // the model
  return {
      {"model.name", &c.model.name, false},
      {"model.num_classes", &c.model.num_classes, false},
      {"model.zero_init_residual", &c.model.zero_init_residual, false},
      {"model.channels_last", &c.model.channels_last, false},
      {"model.init_from", &c.model.init_from, false},
      {"model.init_skip", &c.model.init_skip, false},
      {"model.context", &c.model.context, false},
      {"model.vocab_size", &c.model.vocab_size, false},
      {"model.vocab_multiple", &c.model.vocab_multiple, false},
      {"model.fused_bias", &c.model.fused_bias, false},
      {"model.dropout", &c.model.dropout, false},
      {"model.hf_config", &c.model.hf_config, false},
  };
}

std::vector<Field> data_fields(Config& c) {  // the data and its augmentation
  return {
      {"data.kind", &c.data.kind, false},
      {"data.train", &c.data.train, false},
      {"data.test", &c.data.test, false},
      {"data.in_memory", &c.data.in_memory, false},
      {"data.check_timeout_s", &c.data.check_timeout_s, false},
      {"data.shape", &c.data.shape, false},
      {"data.synthetic_size", &c.data.synthetic_size, false},
      {"data.workers", &c.data.workers, false},
      {"data.prefetch", &c.data.prefetch, false},
      {"data.crop_padding", &c.data.crop_padding, false},
      {"data.hflip", &c.data.hflip, false},
      {"data.normalize", &c.data.normalize, false},
      {"data.auto_augment", &c.data.auto_augment, false},
      {"data.randaugment_ops", &c.data.randaugment_ops, false},
      {"data.randaugment_magnitude", &c.data.randaugment_magnitude, false},
      {"data.random_erasing", &c.data.random_erasing, false},
      {"data.uint8_batches", &c.data.uint8_batches, false},
      {"data.fetch_ahead", &c.data.fetch_ahead, false},
      {"data.size", &c.data.size, false},
      {"data.eval_size", &c.data.eval_size, false},
      {"data.scale", &c.data.scale, false},
      {"data.ratio", &c.data.ratio, false},
      {"data.crop_pct", &c.data.crop_pct, false},
      {"data.max_image_pixels", &c.data.max_image_pixels, false},
  };
}

std::vector<Field> optim_fields(Config& c) {  // the optimizer
  return {
      {"optim.name", &c.optim.name, false},
      {"optim.lr", &c.optim.lr, false},
      {"optim.momentum", &c.optim.momentum, false},
      {"optim.nesterov", &c.optim.nesterov, false},
      {"optim.weight_decay", &c.optim.weight_decay, false},
      {"optim.decay_norm_and_bias", &c.optim.decay_norm_and_bias, false},
      {"optim.beta1", &c.optim.beta1, false},
      {"optim.beta2", &c.optim.beta2, false},
      {"optim.eps", &c.optim.eps, false},
      {"optim.grad_clip", &c.optim.grad_clip, false},
      {"optim.lamb_max_grad_norm", &c.optim.lamb_max_grad_norm, false},
      {"optim.trust_clip", &c.optim.trust_clip, false},
      {"optim.always_adapt", &c.optim.always_adapt, false},
      {"optim.implementation", &c.optim.implementation, false},
  };
}

std::vector<Field> schedule_fields(Config& c) {  // the learning-rate schedule
  return {
      {"schedule.name", &c.schedule.name, false},
      {"schedule.warmup_steps", &c.schedule.warmup_steps, false},
      {"schedule.warmup_epochs", &c.schedule.warmup_epochs, false},
      {"schedule.min_lr", &c.schedule.min_lr, false},
      {"schedule.milestones", &c.schedule.milestones, false},
      {"schedule.gamma", &c.schedule.gamma, false},
  };
}

std::vector<Field> train_fields(Config& c) {  // the loop
  return {
      {"train.global_batch", &c.train.global_batch, false},
      {"train.micro_batch", &c.train.micro_batch, true},
      {"train.steps", &c.train.steps, false},
      {"train.epochs", &c.train.epochs, false},
      {"train.eval_every", &c.train.eval_every, false},
      {"train.eval_batch", &c.train.eval_batch, false},
      {"train.eval_batches", &c.train.eval_batches, false},
      {"train.label_smoothing", &c.train.label_smoothing, false},
      {"train.loss", &c.train.loss, false},
      {"train.bce_target_threshold", &c.train.bce_target_threshold, false},
      {"train.bce_sum_classes", &c.train.bce_sum_classes, false},
      {"train.mixup_alpha", &c.train.mixup_alpha, false},
      {"train.cutmix_alpha", &c.train.cutmix_alpha, false},
      {"train.mix_prob", &c.train.mix_prob, false},
      {"train.mix_switch_prob", &c.train.mix_switch_prob, false},
      {"train.mix_mode", &c.train.mix_mode, false},
      {"train.fused_loss", &c.train.fused_loss, false},
      {"train.device", &c.train.device, false},
      {"train.threads", &c.train.threads, false},
      {"train.deterministic", &c.train.deterministic, false},
      {"train.snapshot", &c.train.snapshot, false},
      {"train.cuda_graph", &c.train.cuda_graph, false},
      {"train.sample_every", &c.train.sample_every, false},
      {"train.sample_tokens", &c.train.sample_tokens, false},
      {"train.sample_prompt", &c.train.sample_prompt, false},
      {"train.ema_decay", &c.train.ema_decay, false},
      {"train.ema_warmup", &c.train.ema_warmup, false},
      {"train.ema_every", &c.train.ema_every, false},
  };
}

std::vector<Field> amp_fields(Config& c) {  // mixed precision
  return {
      {"amp.enabled", &c.amp.enabled, false},
      {"amp.dtype", &c.amp.dtype, false},
      {"amp.scaler", &c.amp.scaler, false},
      {"amp.init_scale", &c.amp.init_scale, false},
      {"amp.growth_factor", &c.amp.growth_factor, false},
      {"amp.backoff_factor", &c.amp.backoff_factor, false},
      {"amp.growth_interval", &c.amp.growth_interval, false},
  };
}

std::vector<Field> memory_fields(Config& c) {  // memory: the cap, the ladder, the search, cuDNN
  return {
      {"memory.limit", &c.memory.limit, false},
      {"memory.auto_margin", &c.memory.auto_margin, false},
      {"memory.auto_reserve", &c.memory.auto_reserve, false},
      {"memory.curve", &c.memory.curve, false},
      {"memory.min_micro_batch", &c.memory.min_micro_batch, false},
      {"memory.activation_checkpointing", &c.memory.activation_checkpointing, false},
      {"memory.checkpoint_every_k", &c.memory.checkpoint_every_k, false},
      {"memory.ladder_checkpointing", &c.memory.ladder_checkpointing, false},
      {"memory.grow_after", &c.memory.grow_after, false},
      {"memory.headroom", &c.memory.headroom, false},
      {"memory.ladder_sizes", &c.memory.ladder_sizes, false},
      {"memory.auto_search", &c.memory.auto_search, false},
      {"memory.cudnn_policy", &c.memory.cudnn_policy, false},
      {"memory.cudnn_benchmark_limit", &c.memory.cudnn_benchmark_limit, false},
      {"memory.cudnn_empty_cache", &c.memory.cudnn_empty_cache, false},
  };
}

std::vector<Field> checkpoint_fields(Config& c) {  // checkpoints
  return {
      {"checkpoint.every_steps", &c.checkpoint.every_steps, false},
      {"checkpoint.every_seconds", &c.checkpoint.every_seconds, false},
      {"checkpoint.keep_last", &c.checkpoint.keep_last, false},
      {"checkpoint.async", &c.checkpoint.async, false},
      {"checkpoint.max_failures", &c.checkpoint.max_failures, false},
      {"checkpoint.final", &c.checkpoint.final, false},
  };
}

std::vector<Field> log_fields(Config& c) {  // logs and endpoints
  return {
      {"log.every", &c.log.every, false},
      {"log.level", &c.log.level, false},
      {"log.http_port", &c.log.http_port, false},
      {"log.http_host", &c.log.http_host, false},
      {"log.tensorboard", &c.log.tensorboard, false},
      {"log.mlflow", &c.log.mlflow, false},
      {"log.mlflow_experiment", &c.log.mlflow_experiment, false},
  };
}

std::vector<Field> dist_fields(Config& c) {  // data parallelism
  return {
      {"dist.backend", &c.dist.backend, false},
      {"dist.timeout_s", &c.dist.timeout_s, false},
      {"dist.bucket_mb", &c.dist.bucket_mb, false},
  };
}

std::vector<Field> fields(Config& c) {
  std::vector<Field> all;
  for (auto section : {model_fields, data_fields, optim_fields, schedule_fields, train_fields, amp_fields,
                       memory_fields, checkpoint_fields, log_fields, dist_fields})
    for (Field& f : section(c)) all.push_back(std::move(f));
  all.push_back({"seed", &c.seed, false});
  return all;
}

[[noreturn]] void fail(const std::string& source, const std::string& key, const std::string& what) {
  throw ConfigError(source + ": " + (key.empty() ? "" : "key '" + key + "': ") + what);
}

std::string describe(const YAML::Node& n) {
  if (n.IsScalar()) return "'" + n.Scalar() + "'";
  if (n.IsSequence()) return "a list";
  if (n.IsMap()) return "a mapping";
  return "nothing";
}

// Parses one scalar as T with yaml-cpp's own conversion, which rejects "12abc" for integers.
template <typename T>
T scalar_as(const YAML::Node& n, const std::string& source, const std::string& key, const char* type_name) {
  if (!n.IsScalar()) fail(source, key, std::string("expected ") + type_name + ", got " + describe(n));
  try {
    return n.as<T>();
  } catch (const YAML::Exception&) {
    fail(source, key, std::string("expected ") + type_name + ", got " + describe(n));
  }
}

void assign(Field& f, const YAML::Node& n, const std::string& source) {
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t>) {
          if (f.allow_auto && n.IsScalar() && n.Scalar() == "auto") *p = -1;
          else *p = scalar_as<int64_t>(n, source, f.key, f.allow_auto ? "an integer or 'auto'" : "an integer");
        } else if constexpr (std::is_same_v<T, uint64_t>) {
          *p = scalar_as<uint64_t>(n, source, f.key, "a non-negative integer");
        } else if constexpr (std::is_same_v<T, double>) {
          // YAML's .nan and .inf are numbers to yaml-cpp; no key means anything by them, and NaN slips
          // through range checks (every comparison with it is false).
          *p = scalar_as<double>(n, source, f.key, "a number");
          if (!std::isfinite(*p)) fail(source, f.key, "expected a finite number, got " + describe(n));
        } else if constexpr (std::is_same_v<T, bool>) {
          *p = scalar_as<bool>(n, source, f.key, "true or false");
        } else if constexpr (std::is_same_v<T, std::string>) {
          if (n.IsNull()) *p = "";
          else *p = scalar_as<std::string>(n, source, f.key, "a string");
        } else if constexpr (std::is_same_v<T, std::vector<double>>) {
          if (!n.IsSequence()) fail(source, f.key, "expected a list of numbers, got " + describe(n));
          std::vector<double> v;
          for (const auto& e : n) {
            v.push_back(scalar_as<double>(e, source, f.key, "a list of numbers"));
            if (!std::isfinite(v.back())) fail(source, f.key, "expected finite numbers, got " + describe(e));
          }
          *p = std::move(v);
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          if (!n.IsSequence()) fail(source, f.key, "expected a list of strings, got " + describe(n));
          std::vector<std::string> v;
          for (const auto& e : n) v.push_back(scalar_as<std::string>(e, source, f.key, "a list of strings"));
          *p = std::move(v);
        } else {  // std::vector<int64_t>
          if (!n.IsSequence()) fail(source, f.key, "expected a list of integers, got " + describe(n));
          std::vector<int64_t> v;
          for (const auto& e : n) v.push_back(scalar_as<int64_t>(e, source, f.key, "a list of integers"));
          *p = std::move(v);
        }
      },
      f.ref);
}

Field* find_field(std::vector<Field>& fs, const std::string& key) {
  for (auto& f : fs)
    if (f.key == key) return &f;
  return nullptr;
}

bool is_section(const std::vector<Field>& fs, const std::string& prefix) {
  return std::any_of(fs.begin(), fs.end(), [&](const Field& f) { return f.key.rfind(prefix + ".", 0) == 0; });
}

// The keys of one section, for "did you mean" help in errors.
std::string section_keys(const std::vector<Field>& fs, const std::string& key) {
  auto dot = key.rfind('.');
  std::string prefix = dot == std::string::npos ? "" : key.substr(0, dot + 1);
  std::string out;
  std::set<std::string> seen;
  for (const auto& f : fs) {
    if (f.key.rfind(prefix, 0) != 0) continue;
    std::string rest = f.key.substr(prefix.size());
    rest = rest.substr(0, rest.find('.'));
    if (seen.insert(rest).second) out += (out.empty() ? "" : ", ") + rest;
  }
  return out;
}

void apply_node(std::vector<Field>& fs, const YAML::Node& node, const std::string& prefix,
                const std::string& source) {
  std::set<std::string> seen;
  for (const auto& kv : node) {
    std::string k = kv.first.Scalar();
    std::string key = prefix.empty() ? k : prefix + "." + k;
    // yaml-cpp keeps both entries of a repeated key; which one counts would be an accident of order.
    if (!seen.insert(k).second) fail(source, key, "appears twice; keep one");
    if (Field* f = find_field(fs, key)) {
      assign(*f, kv.second, source);
    } else if (is_section(fs, key)) {
      if (!kv.second.IsMap()) fail(source, key, "expected a mapping of keys, got " + describe(kv.second));
      apply_node(fs, kv.second, key, source);
    } else {
      fail(source, key, "unknown key (known here: " + section_keys(fs, key) + ")");
    }
  }
}

// The shortest decimal text that reads back as exactly `v` (0.1 rather than 0.10000000000000001), so a
// resolved config both reads well and reproduces the run bit for bit.
std::string shortest(double v) {
  char buf[64];
  for (int prec = 6; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s = buf;
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // stays a float when read back
  return s;
}

}  // namespace

void apply_yaml_text(Config& cfg, const std::string& text, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    fail(source, "", std::string("malformed YAML: ") + e.what());
  }
  if (root.IsNull()) return;  // an empty file changes nothing
  if (!root.IsMap()) fail(source, "", "expected a mapping at the top level, got " + describe(root));
  auto fs = fields(cfg);
  apply_node(fs, root, "", source);
}

// Read once, as a stream: a named pipe works (`--config <(render-config)`) and waits for its writer, as a
// shell's pipe would (common/files.h has the readers that refuse one).
void apply_yaml_file(Config& cfg, const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError(path + ": cannot read the config file (missing or unreadable)");
  std::stringstream ss;
  ss << in.rdbuf();
  apply_yaml_text(cfg, ss.str(), path);
}

void apply_override(Config& cfg, const std::string& assignment) {
  const std::string source = "--set " + assignment;
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) fail(source, "", "expected key=value");
  std::string key = assignment.substr(0, eq);
  std::string value = assignment.substr(eq + 1);
  auto fs = fields(cfg);
  Field* f = find_field(fs, key);
  if (!f) fail(source, key, "unknown key (known here: " + section_keys(fs, key) + ")");
  YAML::Node n;
  try {
    n = YAML::Load(value);
  } catch (const YAML::Exception& e) {
    fail(source, key, std::string("malformed value: ") + e.what());
  }
  assign(*f, n, source);
}

namespace {

// Range and combination checks, one group per config section; each failure names its key.
struct Checks {
  const Config& c;
  void bad(const std::string& key, const std::string& what) const { fail("config", key, what); }
  void one_of(const std::string& key, const std::string& v, std::initializer_list<const char*> ok) const {
    std::string list;
    for (const char* o : ok) {
      if (v == o) return;
      list += (list.empty() ? "" : ", ") + std::string(o);
    }
    bad(key, "'" + v + "' is not one of: " + list);
  }

  void model_and_data() const {
    const auto names = models::model_names();
    if (std::find(names.begin(), names.end(), c.model.name) == names.end()) {
      std::string known;
      for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
      bad("model.name", "unknown model '" + c.model.name + "'; known models: " + known);
    }
    if (c.model.num_classes < 1 || c.model.num_classes > kMaxClasses)
      bad("model.num_classes", "must be in [1, " + std::to_string(kMaxClasses) + "], got " + std::to_string(c.model.num_classes));
    one_of("data.kind", c.data.kind, {"hdf5", "packed_images", "image_folder", "synthetic", "tokens"});
    // synthetic serves both: images of data.shape to an image model, tokens to a language model.
    const bool language_model = models::registered_vocab_size(c.model.name) > 0;
    const bool encoded_images = c.data.kind == "packed_images" || c.data.kind == "image_folder";
    if (language_model && (c.data.kind == "hdf5" || encoded_images))
      bad("model.name", "'" + c.model.name + "' is a language model and needs tokens, but data.kind is '" + c.data.kind +
                            "' (images); set data.kind: tokens or synthetic, or an image model");
    if (!language_model && c.data.kind == "tokens")
      bad("model.name", "'" + c.model.name + "' is an image model, but data.kind is 'tokens'; set data.kind: hdf5 "
                            "or synthetic, or a language model (gpt2, gpt_tiny)");
    sizes();
    if (c.data.kind != "synthetic" && c.data.train.empty()) bad("data.train", std::string(c.data.kind == "image_folder" ? "a folder" : "an HDF5 file") + " is required for data.kind " + c.data.kind);
    if (c.model.context < 0 || c.model.context > kMaxContext)
      bad("model.context", "must be in [0, " + std::to_string(kMaxContext) + "] (0 = the model's own)");
    if (c.model.vocab_size < 0 || c.model.vocab_size > INT32_MAX) bad("model.vocab_size", "must be in [0, 2^31) (0 = the data's)");
    if (c.model.vocab_multiple < 1 || c.model.vocab_multiple > 4096)
      bad("model.vocab_multiple", "must be in [1, 4096] (1 = no padding), got " + std::to_string(c.model.vocab_multiple));
    if (c.data.kind == "tokens" && c.model.context == 0) bad("model.context", "data.kind tokens needs the tokens per sample");
    if (c.model.dropout < 0 || c.model.dropout >= 1) bad("model.dropout", "must be in [0, 1)");
    if (!c.model.init_skip.empty() && c.model.init_from.empty())
      bad("model.init_skip", "names keys to leave out of model.init_from, which is not set");
    for (const auto& pattern : c.model.init_skip)
      if (pattern.empty()) bad("model.init_skip", "holds an empty pattern");
    if (c.model.name == "llama" && c.model.hf_config.empty() && c.model.init_from.empty())
      bad("model.name", "llama takes its shape from a transformers config.json: set model.init_from to a Hub folder (or "
                        "weights beside their config.json), or model.hf_config; or name a shape (llama_tiny, smollm2_135m, "
                        "llama3_2_1b, qwen2_5_0_5b)");
    if (!c.model.hf_config.empty() && c.model.name != "llama")
      bad("model.hf_config", "is read for model.name: llama only (model '" + c.model.name + "' has its own shape)");
    if (c.model.vocab_multiple > 1 && models::registered_vocab_size(c.model.name) > 0 && c.model.name.rfind("gpt", 0) != 0)
      bad("model.vocab_multiple", "pads GPT models' vocabulary; '" + c.model.name + "' takes 1");
    if (c.data.kind == "synthetic" && !language_model) {
      if (c.data.shape.size() != 3 ||
          std::any_of(c.data.shape.begin(), c.data.shape.end(), [](int64_t d) { return d < 1 || d > kMaxSide; }))
        bad("data.shape", "must be three integers (C, H, W) in [1, " + std::to_string(kMaxSide) + "]");
      if (c.data.shape[0] * c.data.shape[1] * c.data.shape[2] > kMaxSampleElements)
        bad("data.shape", "a sample of more than " + std::to_string(kMaxSampleElements) + " values (C * H * W)");
    }
    if (c.data.kind == "synthetic" && c.data.synthetic_size < c.train.global_batch)
      bad("data.synthetic_size", "must be at least train.global_batch");
    if (c.data.workers < 0) bad("data.workers", "must be >= 0");
    if (c.data.prefetch < 1) bad("data.prefetch", "must be >= 1");
    if (!(c.data.check_timeout_s > 0)) bad("data.check_timeout_s", "must be > 0");
    if (c.data.crop_padding < 0) bad("data.crop_padding", "must be >= 0");
    one_of("data.uint8_batches", c.data.uint8_batches, {"auto", "on", "off"});
    one_of("data.fetch_ahead", c.data.fetch_ahead, {"auto", "on", "off"});
    augmentations(language_model);
    if (c.data.size < 1 || c.data.size > 4096) bad("data.size", "must be in [1, 4096]");
    if (c.data.eval_size < 0 || c.data.eval_size > 4096) bad("data.eval_size", "must be in [1, 4096], or 0 (= data.size)");
    if (c.data.eval_size > 0 && c.data.eval_size != c.data.size && c.model.name.rfind("vit", 0) == 0)
      bad("data.eval_size", "a ViT takes one image size (its position embeddings); leave it 0 or equal to data.size");
    if (c.data.scale.size() != 2 || !(c.data.scale[0] > 0 && c.data.scale[0] <= c.data.scale[1] && c.data.scale[1] <= 1))
      bad("data.scale", "must be two numbers [lo, hi] with 0 < lo <= hi <= 1");
    if (c.data.ratio.size() != 2 || !(c.data.ratio[0] > 0 && c.data.ratio[0] <= c.data.ratio[1]))
      bad("data.ratio", "must be two numbers [lo, hi] with 0 < lo <= hi");
    if (c.data.max_image_pixels < 1) bad("data.max_image_pixels", "must be at least 1");
    if (!(c.data.crop_pct > 0 && c.data.crop_pct <= 1)) bad("data.crop_pct", "must be in (0, 1]");
    if (encoded_images && c.data.crop_padding > c.data.size)
      bad("data.crop_padding", "must be at most data.size (" + std::to_string(c.data.size) + ")");
  }

  // The training-only augmentations of images (data/pixels/augment.h).
  void augmentations(bool language_model) const {
    one_of("data.auto_augment", c.data.auto_augment, {"none", "randaugment", "trivialaugment"});
    if (c.data.randaugment_ops < 0 || c.data.randaugment_ops > 64) bad("data.randaugment_ops", "must be in [0, 64]");
    if (c.data.randaugment_magnitude < 0 || c.data.randaugment_magnitude > 30)
      bad("data.randaugment_magnitude", "must be in [0, 30] (31 magnitude bins)");
    if (!(c.data.random_erasing >= 0 && c.data.random_erasing <= 1))
      bad("data.random_erasing", "must be a probability in [0, 1]");
    if (language_model && c.data.auto_augment != "none")
      bad("data.auto_augment", "augments images; the language model " + c.model.name + " reads tokens (set none)");
    if (language_model && c.data.random_erasing > 0)
      bad("data.random_erasing", "erases image boxes; the language model " + c.model.name + " reads tokens (set 0)");
  }

  // Sizes no job asks for, refused before anything is allocated: beyond these LibTorch fails inside an
  // allocation (or overflows a size) with an error that names no key.
  static constexpr int64_t kMaxClasses = int64_t(1) << 24;         // 16.7 M classifier outputs
  static constexpr int64_t kMaxContext = int64_t(1) << 20;         // tokens per sample
  static constexpr int64_t kMaxSide = int64_t(1) << 16;            // one dimension of an image
  static constexpr int64_t kMaxSampleElements = int64_t(1) << 28;  // C * H * W (1 GiB of float32)
  static constexpr int64_t kMaxBatch = int64_t(1) << 24;           // samples per step or evaluation batch
  static constexpr int64_t kMaxThreads = 4096;                     // loader workers, prefetch, CPU threads

  void sizes() const {
    auto at_most = [&](const char* key, int64_t v, int64_t max) {
      if (v > max) bad(key, "must be at most " + std::to_string(max) + ", got " + std::to_string(v));
    };
    at_most("train.global_batch", c.train.global_batch, kMaxBatch);
    at_most("train.eval_batch", c.train.eval_batch, kMaxBatch);
    at_most("data.synthetic_size", c.data.synthetic_size, int64_t(1) << 40);
    at_most("data.workers", c.data.workers, kMaxThreads);
    at_most("data.prefetch", c.data.prefetch, kMaxThreads);
    at_most("train.threads", c.train.threads, kMaxThreads);
    // These become float32 scalars of the optimizer's and the scaler's tensors; past float32's range
    // LibTorch refuses them at the first step ("cannot be converted to type float without overflow").
    for (const auto& [key, v] : {std::pair<const char*, double>{"optim.lr", c.optim.lr}, {"optim.weight_decay", c.optim.weight_decay},
                                 {"optim.eps", c.optim.eps}, {"optim.grad_clip", c.optim.grad_clip},
                                 {"optim.lamb_max_grad_norm", c.optim.lamb_max_grad_norm},
                                 {"amp.init_scale", c.amp.init_scale}, {"amp.growth_factor", c.amp.growth_factor}})
      if (std::fabs(v) > std::numeric_limits<float>::max()) bad(key, "must fit in float32 (at most 3.4e38)");
  }

  void optimizer_and_schedule() const {
    one_of("optim.name", c.optim.name, {"sgd", "adamw", "lamb"});
    if (!(c.optim.lr > 0)) bad("optim.lr", "must be > 0");
    if (c.optim.momentum < 0 || c.optim.momentum >= 1) bad("optim.momentum", "must be in [0, 1)");
    if (c.optim.nesterov && c.optim.name == "sgd" && c.optim.momentum == 0) bad("optim.nesterov", "needs optim.momentum > 0");
    if (c.optim.weight_decay < 0) bad("optim.weight_decay", "must be >= 0");
    if (c.optim.beta1 < 0 || c.optim.beta1 >= 1) bad("optim.beta1", "must be in [0, 1)");
    if (c.optim.beta2 < 0 || c.optim.beta2 >= 1) bad("optim.beta2", "must be in [0, 1)");
    if (!(c.optim.eps > 0)) bad("optim.eps", "must be > 0");
    if (c.optim.grad_clip < 0) bad("optim.grad_clip", "must be >= 0 (0 = off)");
    if (!(c.optim.lamb_max_grad_norm >= 0)) bad("optim.lamb_max_grad_norm", "must be >= 0 (0 = off)");
    one_of("optim.implementation", c.optim.implementation, {"auto", "plain", "foreach", "fused"});
    if (c.optim.name == "lamb" && c.optim.implementation != "auto" && c.optim.implementation != "plain")
      bad("optim.implementation", c.optim.implementation + " has no lamb version (lamb runs plain); use auto or plain");
    if (c.optim.implementation == "fused" && !compat::kHasFusedOptimizers)
      bad("optim.implementation", "fused needs LibTorch 2.4 or later (this is " + compat::torch_version() +
                                      "); use auto, plain or foreach");
    // A captured step needs the fused update, which reads its rate and its skip on the device.
    if (c.optim.name == "lamb" && c.train.cuda_graph == "on")
      bad("train.cuda_graph", "on needs the fused SGD/AdamW update; lamb has none (use auto or off)");
    one_of("schedule.name", c.schedule.name, {"constant", "cosine", "step"});
    if (c.schedule.warmup_steps < 0) bad("schedule.warmup_steps", "must be >= 0");
    if (c.schedule.warmup_epochs < 0) bad("schedule.warmup_epochs", "must be >= 0");
    if (c.schedule.warmup_steps > 0 && c.schedule.warmup_epochs > 0)
      bad("schedule.warmup_epochs", "set either schedule.warmup_steps or schedule.warmup_epochs, not both");
    if (c.schedule.min_lr < 0 || c.schedule.min_lr > c.optim.lr) bad("schedule.min_lr", "must be in [0, optim.lr]");
    if (!std::is_sorted(c.schedule.milestones.begin(), c.schedule.milestones.end()))
      bad("schedule.milestones", "must be increasing");
    if (c.schedule.name == "step" && c.schedule.milestones.empty()) bad("schedule.milestones", "the step schedule needs milestones");
  }

  // The image recipes' losses and Mixup/CutMix (trainer/numerics/loss.h, trainer/mix/mixing.h).
  void recipe_losses() const {
    one_of("train.loss", c.train.loss, {"cross_entropy", "bce"});
    if (!(c.train.bce_target_threshold >= 0 && c.train.bce_target_threshold < 1))
      bad("train.bce_target_threshold", "must be in [0, 1) (0 = off)");
    if (!(c.train.mixup_alpha >= 0)) bad("train.mixup_alpha", "must be >= 0 (0 = no Mixup)");
    if (!(c.train.cutmix_alpha >= 0)) bad("train.cutmix_alpha", "must be >= 0 (0 = no CutMix)");
    if (!(c.train.mix_prob >= 0 && c.train.mix_prob <= 1)) bad("train.mix_prob", "must be in [0, 1]");
    if (!(c.train.mix_switch_prob >= 0 && c.train.mix_switch_prob <= 1)) bad("train.mix_switch_prob", "must be in [0, 1]");
    one_of("train.mix_mode", c.train.mix_mode, {"batch", "elem"});
    const bool language_model = models::registered_vocab_size(c.model.name) > 0;
    if (language_model && (c.train.mixup_alpha > 0 || c.train.cutmix_alpha > 0))
      bad(c.train.mixup_alpha > 0 ? "train.mixup_alpha" : "train.cutmix_alpha",
          "mixes images; model '" + c.model.name + "' is a language model (set 0)");
    if (language_model && c.train.loss != "cross_entropy")
      bad("train.loss", "bce is for image classifiers; model '" + c.model.name + "' is a language model");
  }

  void training() const {
    if (c.train.global_batch < 1) bad("train.global_batch", "must be at least 1");
    if (c.train.micro_batch < -1) bad("train.micro_batch", "must be a positive integer, 0 (= global_batch) or auto");
    if (c.train.micro_batch > c.train.global_batch) bad("train.micro_batch", "must not exceed train.global_batch");
    if (c.train.steps < 0) bad("train.steps", "must be >= 0");
    if (c.train.epochs < 0) bad("train.epochs", "must be >= 0");
    if (c.train.steps == 0 && c.train.epochs == 0) bad("train.steps", "set train.steps or train.epochs");
    if (c.train.steps > 0 && c.train.epochs > 0) bad("train.epochs", "set either train.steps or train.epochs, not both");
    if (c.train.eval_every < 0) bad("train.eval_every", "must be >= 0");
    if (c.train.eval_batch < 1) bad("train.eval_batch", "must be at least 1");
    if (c.train.eval_batches < 0) bad("train.eval_batches", "must be >= 0 (0 = the whole split)");
    if (c.train.label_smoothing < 0 || c.train.label_smoothing >= 1) bad("train.label_smoothing", "must be in [0, 1)");
    recipe_losses();
    if (c.train.threads < 0) bad("train.threads", "must be >= 0 (0 = usable CPUs)");
    one_of("train.snapshot", c.train.snapshot, {"batched", "per_buffer"});
    one_of("train.cuda_graph", c.train.cuda_graph, {"auto", "on", "off"});
    if (c.train.sample_every < 0) bad("train.sample_every", "must be >= 0 (0 = off)");
    if (c.train.sample_every > 0 && models::registered_vocab_size(c.model.name) == 0)
      bad("train.sample_every", "model '" + c.model.name + "' is not a language model; only GPT models sample (set 0)");
    if (c.train.ema_decay != 0 && !(c.train.ema_decay > 0 && c.train.ema_decay < 1))
      bad("train.ema_decay", "must be in (0, 1), or 0 (off)");
    if (c.train.ema_every < 1) bad("train.ema_every", "must be at least 1 (optimizer steps between updates)");
    if (c.train.sample_tokens < 1 || c.train.sample_tokens > kMaxContext)
      bad("train.sample_tokens", "must be in [1, " + std::to_string(kMaxContext) + "]");
    const std::string& d = c.train.device;
    const bool cuda_n = d.rfind("cuda:", 0) == 0 && d.size() > 5 && d.size() <= 8 &&
                        std::all_of(d.begin() + 5, d.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
    if (d != "auto" && d != "cpu" && d != "cuda" && !cuda_n)
      bad("train.device", "'" + d + "' is not one of: auto, cpu, cuda, cuda:N (N a device number)");
  }

  void amp() const {
    one_of("amp.dtype", c.amp.dtype, {"bf16", "fp16"});
    one_of("amp.scaler", c.amp.scaler, {"auto", "true", "false"});
    if (c.amp.enabled && c.amp.dtype == "fp16" && c.amp.scaler == "false")
      bad("amp.scaler", "fp16 needs the loss scaler (gradients underflow without it); set amp.scaler: auto or true");
    if (c.amp.enabled && c.amp.dtype == "bf16" && c.amp.scaler == "true")
      bad("amp.scaler", "bf16 has fp32's exponent range and must not use the loss scaler; set amp.scaler: auto or false");
    if (!(c.amp.init_scale > 0)) bad("amp.init_scale", "must be > 0");
    if (!(c.amp.growth_factor > 1)) bad("amp.growth_factor", "must be > 1");
    if (!(c.amp.backoff_factor > 0 && c.amp.backoff_factor < 1)) bad("amp.backoff_factor", "must be in (0, 1)");
    if (c.amp.growth_interval < 1) bad("amp.growth_interval", "must be at least 1");
  }

  void memory_checkpoints_logs_dist() const {
    try {
      validate_memory_limit_spec(c.memory.limit);
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();  // "memory.limit: '0.5' is not ..."
      bad("memory.limit", what.substr(what.rfind("memory.limit: ", 0) == 0 ? 14 : 0));
    }
    if (c.memory.auto_margin != -1 && (c.memory.auto_margin < 0 || c.memory.auto_margin >= 1))
      bad("memory.auto_margin", "must be in [0, 1), or -1 for the default of the device");
    try {
      parse_bytes(c.memory.auto_reserve);
    } catch (const std::invalid_argument&) {
      bad("memory.auto_reserve", "'" + c.memory.auto_reserve + "' is not a byte size (write 96MiB, 100MB, 0)");
    }
    if (c.memory.min_micro_batch < 1) bad("memory.min_micro_batch", "must be at least 1");
    one_of("memory.activation_checkpointing", c.memory.activation_checkpointing, {"none", "all", "every_k", "auto"});
    if (c.memory.checkpoint_every_k < 1) bad("memory.checkpoint_every_k", "must be at least 1");
    if (c.memory.grow_after < 1) bad("memory.grow_after", "must be at least 1");
    if (c.memory.headroom < 0 || c.memory.headroom >= 1) bad("memory.headroom", "must be in [0, 1)");
    one_of("memory.ladder_sizes", c.memory.ladder_sizes, {"any", "halvings"});
    one_of("memory.auto_search", c.memory.auto_search, {"auto", "curve", "doubling"});
    one_of("memory.cudnn_policy", c.memory.cudnn_policy, {"always", "off", "start", "pretune", "settle"});
    if (c.memory.cudnn_benchmark_limit < 0 || c.memory.cudnn_benchmark_limit > 10000)
      bad("memory.cudnn_benchmark_limit", "must be in [0, 10000] (0 = LibTorch's default, 10)");
    if (c.checkpoint.every_steps < 0) bad("checkpoint.every_steps", "must be >= 0");
    if (c.checkpoint.every_seconds < 0) bad("checkpoint.every_seconds", "must be >= 0");
    if (c.checkpoint.keep_last < 1 || c.checkpoint.keep_last > 1000000)
      bad("checkpoint.keep_last", "must be in [1, 1000000]");
    if (c.checkpoint.max_failures < 1) bad("checkpoint.max_failures", "must be at least 1");
    if (c.log.every < 1) bad("log.every", "must be at least 1");
    one_of("log.level", c.log.level, {"trace", "debug", "info", "warn", "error"});
    if (c.log.http_port < 0 || c.log.http_port > 65535) bad("log.http_port", "must be in [0, 65535]");
    one_of("dist.backend", c.dist.backend, {"auto", "gloo", "nccl"});
    if (c.dist.timeout_s <= 0) bad("dist.timeout_s", "must be positive");
    if (c.dist.bucket_mb <= 0) bad("dist.bucket_mb", "must be positive");
  }
};

}  // namespace

void validate(const Config& c) {
  const Checks checks{c};
  checks.model_and_data();
  checks.optimizer_and_schedule();
  checks.training();
  checks.amp();
  checks.memory_checkpoints_logs_dist();
}

std::string to_yaml(const Config& cfg) {
  Config copy = cfg;  // fields() takes mutable pointers; the dump only reads them
  auto fs = fields(copy);
  YAML::Emitter out;
  out << YAML::BeginMap;
  std::string open;  // the section whose map is open
  for (const auto& f : fs) {
    auto dot = f.key.find('.');
    std::string section = dot == std::string::npos ? "" : f.key.substr(0, dot);
    std::string leaf = dot == std::string::npos ? f.key : f.key.substr(dot + 1);
    if (section != open) {
      if (!open.empty()) out << YAML::EndMap;
      if (!section.empty()) out << YAML::Key << section << YAML::Value << YAML::BeginMap;
      open = section;
    }
    out << YAML::Key << leaf << YAML::Value;
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
            out << YAML::Flow << YAML::BeginSeq;
            for (auto v : *p) out << v;
            out << YAML::EndSeq;
          } else if constexpr (std::is_same_v<T, std::vector<double>>) {
            out << YAML::Flow << YAML::BeginSeq;
            for (auto v : *p) out << shortest(v);
            out << YAML::EndSeq;
          } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
            out << YAML::Flow << YAML::BeginSeq;
            for (const auto& v : *p) out << YAML::DoubleQuoted << v;
            out << YAML::EndSeq;
          } else if constexpr (std::is_same_v<T, int64_t>) {
            if (f.allow_auto && *p == -1) out << "auto";
            else out << *p;
          } else if constexpr (std::is_same_v<T, std::string>) {
            out << YAML::DoubleQuoted << *p;
          } else if constexpr (std::is_same_v<T, double>) {
            out << shortest(*p);
          } else {
            out << *p;
          }
        },
        f.ref);
  }
  if (!open.empty()) out << YAML::EndMap;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::vector<std::string> config_keys() {
  Config c;
  std::vector<std::string> keys;
  for (const auto& f : fields(c)) keys.push_back(f.key);
  return keys;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  Config cfg;
  if (path.empty()) apply_yaml_text(cfg, kDefaultConfigYaml, std::string("built-in ") + kDefaultConfigName);
  else apply_yaml_file(cfg, path);
  for (const auto& o : overrides) apply_override(cfg, o);
  validate(cfg);
  return cfg;
}

}  // namespace trainer
