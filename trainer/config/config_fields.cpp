// The field table: one entry per config key, a typed pointer into a Config, section by section. It
// drives the YAML reading, --set, the errors that name a key and the dump (config.cpp); config_keys().
// Before it, the names of every mode (config.h), the only place they are written.
#include "trainer/config/config_internal.h"

#include <stdexcept>

namespace trainer {

using config_internal::Field;
using config_internal::fields;
using config_internal::mode;
using config_internal::ModeRef;

namespace {

// E's names, in its enum's order: a list of another length than the enum's (kModeCount<E>) does not compile.
template <class E, size_t N>
std::vector<std::string> listed(const char* const (&names)[N]) {
  static_assert(N == kModeCount<E>, "a mode's table names each value of its enum once, in the enum's order");
  return {names, names + N};
}

// The names of each mode, by enum (mode_names below).
std::vector<std::string> names_of(Switch) { return listed<Switch>({"auto", "on", "off"}); }
std::vector<std::string> names_of(DataKind) {
  return listed<DataKind>({"hdf5", "packed_images", "image_folder", "synthetic", "tokens"});
}
std::vector<std::string> names_of(AutoAugment) { return listed<AutoAugment>({"none", "randaugment", "trivialaugment"}); }
std::vector<std::string> names_of(OptimKind) { return listed<OptimKind>({"sgd", "adamw", "lamb"}); }
std::vector<std::string> names_of(OptimImpl) { return listed<OptimImpl>({"auto", "plain", "foreach", "fused"}); }
std::vector<std::string> names_of(StateDtype) { return listed<StateDtype>({"float32", "bfloat16", "int8"}); }
std::vector<std::string> names_of(ParamDtype) { return listed<ParamDtype>({"float32", "bfloat16"}); }
std::vector<std::string> names_of(ScheduleKind) { return listed<ScheduleKind>({"constant", "cosine", "step"}); }
std::vector<std::string> names_of(LossKind) { return listed<LossKind>({"cross_entropy", "bce"}); }
std::vector<std::string> names_of(MixMode) { return listed<MixMode>({"batch", "elem"}); }
std::vector<std::string> names_of(SnapshotMode) { return listed<SnapshotMode>({"batched", "per_buffer"}); }
std::vector<std::string> names_of(AmpDtype) { return listed<AmpDtype>({"bf16", "fp16"}); }
std::vector<std::string> names_of(ScalerMode) { return listed<ScalerMode>({"auto", "true", "false"}); }
std::vector<std::string> names_of(Checkpointing) { return listed<Checkpointing>({"none", "all", "every_k", "auto"}); }
std::vector<std::string> names_of(MemoryState) { return listed<MemoryState>({"fixed", "auto"}); }
std::vector<std::string> names_of(LadderSizes) { return listed<LadderSizes>({"any", "halvings"}); }
std::vector<std::string> names_of(AutoSearch) { return listed<AutoSearch>({"auto", "curve", "doubling"}); }
std::vector<std::string> names_of(CudnnMode) {
  return listed<CudnnMode>({"always", "off", "start", "pretune", "settle"});
}
std::vector<std::string> names_of(LogLevel) { return listed<LogLevel>({"trace", "debug", "info", "warn", "error"}); }
std::vector<std::string> names_of(DistBackend) { return listed<DistBackend>({"auto", "gloo", "nccl"}); }
std::vector<std::string> names_of(ShardMode) { return listed<ShardMode>({"none", "optimizer", "gradients"}); }

}  // namespace

template <class E>
const std::vector<std::string>& mode_names() {
  static const std::vector<std::string> names = names_of(E{});
  return names;
}

// Every mode of config.h: the definitions of mode_names<E>() that the other files call.
template const std::vector<std::string>& mode_names<Switch>();
template const std::vector<std::string>& mode_names<DataKind>();
template const std::vector<std::string>& mode_names<AutoAugment>();
template const std::vector<std::string>& mode_names<OptimKind>();
template const std::vector<std::string>& mode_names<OptimImpl>();
template const std::vector<std::string>& mode_names<StateDtype>();
template const std::vector<std::string>& mode_names<ParamDtype>();
template const std::vector<std::string>& mode_names<ScheduleKind>();
template const std::vector<std::string>& mode_names<LossKind>();
template const std::vector<std::string>& mode_names<MixMode>();
template const std::vector<std::string>& mode_names<SnapshotMode>();
template const std::vector<std::string>& mode_names<AmpDtype>();
template const std::vector<std::string>& mode_names<ScalerMode>();
template const std::vector<std::string>& mode_names<Checkpointing>();
template const std::vector<std::string>& mode_names<MemoryState>();
template const std::vector<std::string>& mode_names<LadderSizes>();
template const std::vector<std::string>& mode_names<AutoSearch>();
template const std::vector<std::string>& mode_names<CudnnMode>();
template const std::vector<std::string>& mode_names<LogLevel>();
template const std::vector<std::string>& mode_names<DistBackend>();
template const std::vector<std::string>& mode_names<ShardMode>();

size_t mode_index(const std::vector<std::string>& names, const std::string& name) {
  std::string list;
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return i;
    list += (i ? ", " : "") + names[i];
  }
  throw std::invalid_argument("'" + name + "' is not one of: " + list);
}

namespace {

// The table, one function per section of the config; fields() joins them, in this order.
std::vector<Field> model_fields(Config& c) {  // the model
  return {
      {"model.name", &c.model.name, false},
      {"model.num_classes", &c.model.num_classes, false},
      {"model.zero_init_residual", &c.model.zero_init_residual, false},
      {"model.channels_last", &c.model.channels_last, false},
      {"model.param_dtype", mode(&c.model.param_dtype), false},
      {"model.init_from", &c.model.init_from, false},
      {"model.init_skip", &c.model.init_skip, false},
      {"model.context", &c.model.context, false},
      {"model.vocab_size", &c.model.vocab_size, false},
      {"model.vocab_multiple", &c.model.vocab_multiple, false},
      {"model.fused_bias", &c.model.fused_bias, false},
      {"model.dropout", &c.model.dropout, false},
      {"model.hf_config", &c.model.hf_config, false},
      {"model.lora.rank", &c.model.lora.rank, false},
      {"model.lora.alpha", &c.model.lora.alpha, false},
      {"model.lora.dropout", &c.model.lora.dropout, false},
      {"model.lora.targets", &c.model.lora.targets, false},
      {"model.lora.use_rslora", &c.model.lora.use_rslora, false},
      {"model.lora_init_from", &c.model.lora_init_from, false},
  };
}

std::vector<Field> data_fields(Config& c) {  // the data and its augmentation
  return {
      {"data.kind", mode(&c.data.kind), false},
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
      {"data.auto_augment", mode(&c.data.auto_augment), false},
      {"data.randaugment_ops", &c.data.randaugment_ops, false},
      {"data.randaugment_magnitude", &c.data.randaugment_magnitude, false},
      {"data.random_erasing", &c.data.random_erasing, false},
      {"data.uint8_batches", mode(&c.data.uint8_batches), false},
      {"data.fetch_ahead", mode(&c.data.fetch_ahead), false},
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
      {"optim.name", mode(&c.optim.name), false},
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
      {"optim.implementation", mode(&c.optim.implementation), false},
      {"optim.state_dtype", mode(&c.optim.state_dtype), false},
      {"optim.stochastic_rounding", &c.optim.stochastic_rounding, false},
  };
}

std::vector<Field> schedule_fields(Config& c) {  // the learning-rate schedule
  return {
      {"schedule.name", mode(&c.schedule.name), false},
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
      {"train.loss", mode(&c.train.loss), false},
      {"train.bce_target_threshold", &c.train.bce_target_threshold, false},
      {"train.bce_sum_classes", &c.train.bce_sum_classes, false},
      {"train.mixup_alpha", &c.train.mixup_alpha, false},
      {"train.cutmix_alpha", &c.train.cutmix_alpha, false},
      {"train.mix_prob", &c.train.mix_prob, false},
      {"train.mix_switch_prob", &c.train.mix_switch_prob, false},
      {"train.mix_mode", mode(&c.train.mix_mode), false},
      {"train.fused_loss", &c.train.fused_loss, false},
      {"train.device", &c.train.device, false},
      {"train.threads", &c.train.threads, false},
      {"train.deterministic", &c.train.deterministic, false},
      {"train.snapshot", mode(&c.train.snapshot), false},
      {"train.cuda_graph", mode(&c.train.cuda_graph), false},
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
      {"amp.dtype", mode(&c.amp.dtype), false},
      {"amp.scaler", mode(&c.amp.scaler), false},
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
      {"memory.activation_checkpointing", mode(&c.memory.activation_checkpointing), false},
      {"memory.checkpoint_every_k", &c.memory.checkpoint_every_k, false},
      {"memory.ladder_checkpointing", &c.memory.ladder_checkpointing, false},
      {"memory.grow_after", &c.memory.grow_after, false},
      {"memory.headroom", &c.memory.headroom, false},
      {"memory.state", mode(&c.memory.state), false},
      {"memory.ladder_sizes", mode(&c.memory.ladder_sizes), false},
      {"memory.auto_search", mode(&c.memory.auto_search), false},
      {"memory.cudnn_policy", mode(&c.memory.cudnn_policy), false},
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
      {"log.level", mode(&c.log.level), false},
      {"log.http_port", &c.log.http_port, false},
      {"log.http_host", &c.log.http_host, false},
      {"log.tensorboard", &c.log.tensorboard, false},
      {"log.mlflow", &c.log.mlflow, false},
      {"log.mlflow_experiment", &c.log.mlflow_experiment, false},
  };
}

std::vector<Field> dist_fields(Config& c) {  // data parallelism
  return {
      {"dist.backend", mode(&c.dist.backend), false},
      {"dist.timeout_s", &c.dist.timeout_s, false},
      {"dist.bucket_mb", &c.dist.bucket_mb, false},
      {"dist.shard", mode(&c.dist.shard), false},
  };
}

}  // namespace

std::vector<Field> config_internal::fields(Config& c) {
  std::vector<Field> all;
  for (auto section : {model_fields, data_fields, optim_fields, schedule_fields, train_fields, amp_fields,
                       memory_fields, checkpoint_fields, log_fields, dist_fields})
    for (Field& f : section(c)) all.push_back(std::move(f));
  all.push_back({"seed", &c.seed, false});
  return all;
}

std::vector<std::string> config_keys() {
  Config c;
  std::vector<std::string> keys;
  for (const auto& f : fields(c)) keys.push_back(f.key);
  return keys;
}

std::vector<std::string> config_key_modes(const std::string& key) {
  Config c;
  for (const auto& f : fields(c))
    if (const auto* m = std::get_if<ModeRef>(&f.ref); m && f.key == key) return *m->names;
  return {};
}

}  // namespace trainer
