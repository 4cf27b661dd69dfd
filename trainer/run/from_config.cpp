#include "trainer/run/from_config.h"

#include "data/files/image_h5.h"
#include "data/files/packed_images.h"
#include "data/files/token_h5.h"
#include "data/samples/image_folder.h"
#include "models/registry.h"
#include "trainer/checkpoint/weights.h"
#include "trainer/hf/families.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/resources.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <stdexcept>

namespace trainer {

torch::Device resolve_device(const std::string& spec, std::optional<int64_t> local_rank) {
  if (spec == "auto") {
    if (!torch::cuda::is_available()) return torch::Device(torch::kCPU);
    return local_rank ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(*local_rank))
                      : torch::Device(torch::kCUDA);
  }
  std::optional<torch::Device> d;
  try {
    d.emplace(spec);
  } catch (const std::exception&) {
    throw ConfigError("train.device: '" + spec + "' is not a device (auto, cpu, cuda or cuda:N)");
  }
  if (!d->is_cpu() && !d->is_cuda())
    throw ConfigError("train.device: '" + spec + "': only cpu and cuda devices are supported");
  if (d->is_cuda()) {
    if (!torch::cuda::is_available())
      throw ConfigError("train.device: '" + spec + "' asked for, but this LibTorch build or machine has no CUDA device");
    if (!d->has_index() && local_rank) d = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(*local_rank));
    const int64_t count = static_cast<int64_t>(torch::cuda::device_count());
    if (d->has_index() && d->index() >= count)
      throw ConfigError("train.device: '" + d->str() + "', but this machine has " + std::to_string(count) +
                        " CUDA device(s)");
  }
  return *d;
}

data::H5CheckResult check_data_file(const Config& cfg, const std::string& path, bool in_memory) {
  data::H5CheckOptions o;
  o.kind = token_job(cfg)                             ? data::H5FileKind::tokens
           : cfg.data.kind == DataKind::kPackedImages ? data::H5FileKind::packed_images
                                                      : data::H5FileKind::images;
  o.in_memory = in_memory;
  o.timeout_s = cfg.data.check_timeout_s;
  o.timeout_hint = " (then raise data.check_timeout_s)";
  return data::check_h5_file(path, o);
}

bool token_job(const Config& cfg) {
  const bool language = models::model_traits(cfg.model.name).language_model();
  if (cfg.data.kind == DataKind::kTokens && !language)
    throw ConfigError("data.kind: tokens needs a language model (gpt2, gpt_tiny); model.name is " + cfg.model.name);
  if ((cfg.data.kind == DataKind::kHdf5 || encoded_image_job(cfg)) && language)
    throw ConfigError("data.kind: " + mode_name(cfg.data.kind) + " holds images; the language model " + cfg.model.name +
                      " reads tokens or synthetic");
  return language;
}

void log_data_check(const std::string& path, const data::H5CheckResult& r) {
  if (r.ran) spdlog::info("data: {} read cleanly by a separate process in {:.0f} ms", path, r.seconds * 1e3);
}

namespace {

// data.auto_augment as data/'s own enum (data/ does not see the config).
data::AutoAugmentKind auto_augment_kind(AutoAugment a) {
  switch (a) {
    case AutoAugment::kNone: return data::AutoAugmentKind::None;
    case AutoAugment::kRandAugment: return data::AutoAugmentKind::RandAugment;
    case AutoAugment::kTrivialAugment: return data::AutoAugmentKind::TrivialAugmentWide;
  }
  throw std::logic_error("auto_augment_kind: a data.auto_augment out of range");
}

// data.auto_augment and its RandAugment keys (training only: the eval transform and loader ignore them).
data::AutoAugmentOptions auto_augment_of(const Config& cfg) {
  data::AutoAugmentOptions a;
  a.kind = auto_augment_kind(cfg.data.auto_augment);
  a.num_ops = cfg.data.randaugment_ops;
  a.magnitude = cfg.data.randaugment_magnitude;
  return a;
}

}  // namespace

bool encoded_image_job(const Config& cfg) {
  return cfg.data.kind == DataKind::kPackedImages || cfg.data.kind == DataKind::kImageFolder;
}

std::shared_ptr<data::ImageDataset> encoded_image_dataset(const Config& cfg, const std::string& path, bool train,
                                                          const data::ImageMeta* stats, int threads) {
  data::ImageTransform t;
  t.size = static_cast<int>(train || cfg.data.eval_size == 0 ? cfg.data.size : cfg.data.eval_size);
  t.train = train;
  t.scale_lo = cfg.data.scale.at(0);
  t.scale_hi = cfg.data.scale.at(1);
  t.ratio_lo = cfg.data.ratio.at(0);
  t.ratio_hi = cfg.data.ratio.at(1);
  t.hflip = cfg.data.hflip;
  t.crop_pct = cfg.data.crop_pct;
  t.crop_padding = static_cast<int>(cfg.data.crop_padding);
  t.auto_augment = auto_augment_of(cfg);
  t.seed = cfg.seed;
  t.limits.max_pixels = cfg.data.max_image_pixels;
  if (cfg.data.kind == DataKind::kPackedImages) {
    log_data_check(path, check_data_file(cfg, path, cfg.data.in_memory));
    return std::make_shared<data::PackedImageDataset>(path, t, cfg.data.in_memory);
  }
  if (stats) return std::make_shared<data::ImageFolderDataset>(path, t, stats->mean, stats->std, threads);
  return std::make_shared<data::ImageFolderDataset>(path, t, std::vector<float>{}, std::vector<float>{}, threads);
}

data::LoaderOptions image_loader_options(const Config& cfg, int64_t workers) {
  data::LoaderOptions lo;
  lo.global_batch = cfg.train.global_batch;
  lo.seed = cfg.seed;
  lo.workers = workers;
  lo.prefetch = cfg.data.prefetch;
  if (!encoded_image_job(cfg)) {
    lo.augment.random_crop_padding = cfg.data.crop_padding;
    lo.augment.hflip = cfg.data.hflip;
    lo.augment.auto_augment = auto_augment_of(cfg);
  }
  lo.augment.normalize = cfg.data.normalize;
  lo.augment.random_erasing = cfg.data.random_erasing;
  return lo;
}

namespace {
// An auto | on | off key whose auto means on for a CUDA device.
bool on_for_cuda(Switch value, const torch::Device& device) {
  return value == Switch::kOn || (value == Switch::kAuto && device.is_cuda());
}
}  // namespace

bool uint8_image_batches(const Config& cfg, const torch::Device& device) {
  // On the CPU the float path is as fast and keeps older runs' numbers; on a GPU a quarter of the bytes cross.
  return on_for_cuda(cfg.data.uint8_batches, device);
}

bool fetches_ahead(const Config& cfg, const torch::Device& device) {
  // Where there is a copy to overlap; `on` keeps the order on the CPU too.
  return on_for_cuda(cfg.data.fetch_ahead, device);
}

void set_input_normalization(ForwardOptions& forward, const data::ImageMeta& stats, bool normalize,
                             const torch::Device& device) {
  forward.input_mean = torch::tensor(stats.mean).reshape({1, -1, 1, 1}).to(device);
  forward.input_std = torch::tensor(stats.std).reshape({1, -1, 1, 1}).to(device);
  if (!normalize) forward.input_mean.zero_(), forward.input_std.fill_(1.0);
}

std::vector<int64_t> sample_shape(const Config& cfg) {
  if (token_job(cfg)) {
    if (cfg.model.context < 1) throw ConfigError("model.context: a language model needs the tokens per sample");
    return {cfg.model.context};
  }
  if (cfg.data.kind == DataKind::kSynthetic) return {cfg.data.shape[0], cfg.data.shape[1], cfg.data.shape[2]};
  if (encoded_image_job(cfg)) return {3, cfg.data.size, cfg.data.size};  // decoded RGB at data.size
  check_data_file(cfg, cfg.data.train, /*in_memory=*/false);
  auto s = data::ImageH5Dataset(cfg.data.train, /*in_memory=*/false).sample_shape();
  return {s[0], s[1], s[2]};
}

std::string hf_config_path(const Config& cfg) {
  if (cfg.model.name != "llama") return "";
  return hf::config_json_of(cfg.model.hf_config.empty() ? cfg.model.init_from : cfg.model.hf_config);
}

std::optional<models::LlamaOptions> hf_architecture(const Config& cfg) {
  const std::string path = hf_config_path(cfg);
  if (path.empty()) return std::nullopt;
  hf::LlamaConfig c = hf::llama_from_json(hf::read_config_json(path), path);
  for (const auto& note : c.notes) spdlog::info("model: {}: {}", path, note);
  if (cfg.model.context > c.options.context())
    throw ConfigError("model.context: " + std::to_string(cfg.model.context) + " tokens per sample, but " + path +
                      " allows " + std::to_string(c.options.context()) + " (max_position_embeddings)");
  return c.options;
}

int64_t vocab_size(const Config& cfg) {
  if (const auto arch = hf_architecture(cfg)) {
    // The architecture's vocabulary is the model's; the data's ids must fall inside it.
    const int64_t data = cfg.data.kind == DataKind::kTokens
                             ? (check_data_file(cfg, cfg.data.train, false),
                                data::TokenDataset(cfg.data.train, /*in_memory=*/false).vocab_size())
                             : 0;
    if (data > arch->vocab_size())
      throw ConfigError("model.hf_config: " + hf_config_path(cfg) + " has vocab_size " + std::to_string(arch->vocab_size()) +
                        ", smaller than the vocabulary " + std::to_string(data) + " of " + cfg.data.train);
    return arch->vocab_size();
  }
  if (cfg.data.kind != DataKind::kTokens) return cfg.model.vocab_size > 0 ? cfg.model.vocab_size : models::registered_vocab_size(cfg.model.name);
  check_data_file(cfg, cfg.data.train, /*in_memory=*/false);
  const int64_t file = data::TokenDataset(cfg.data.train, /*in_memory=*/false).vocab_size();
  if (cfg.model.vocab_size == 0) return file;
  if (cfg.model.vocab_size < file)
    throw ConfigError("model.vocab_size: " + std::to_string(cfg.model.vocab_size) + " is smaller than the vocabulary " +
                      std::to_string(file) + " of " + cfg.data.train);
  return cfg.model.vocab_size;
}

std::shared_ptr<data::SyntheticTokens> synthetic_tokens(const Config& cfg) {
  // (size + 1) windows and one token more: the TokenLoader keeps one window of slack, so exactly
  // data.synthetic_size windows are drawn per epoch.
  const int64_t T = sample_shape(cfg).at(0);
  return std::make_shared<data::SyntheticTokens>((cfg.data.synthetic_size + 1) * T + 1, vocab_size(cfg), cfg.seed);
}

models::ModelOptions model_options(const Config& cfg, const std::vector<int64_t>& shape, int64_t vocab) {
  auto mo = models::ModelOptions()
                .num_classes(cfg.model.num_classes)
                .zero_init_residual(cfg.model.zero_init_residual)
                .context(cfg.model.context)
                .dropout(cfg.model.dropout);
  if (token_job(cfg)) mo.vocab_size(vocab).vocab_multiple(cfg.model.vocab_multiple).fused_bias(cfg.model.fused_bias);
  else mo.in_channels(shape.at(0));
  if (const auto arch = hf_architecture(cfg)) mo.llama(*arch);
  return mo;
}

models::Model build_model(const Config& cfg, const std::vector<int64_t>& shape, int64_t vocab) {
  return models::create_model(cfg.model.name, model_options(cfg, shape, vocab));
}

void load_init_weights(torch::nn::Module& model, const Config& cfg, int64_t vocab) {
  // A Hub folder's config.json and its weights must agree before anything is loaded.
  if (const auto arch = hf_architecture(cfg))
    hf::check_llama_weights(*arch, read_weights(cfg.model.init_from).tensors, hf_config_path(cfg));
  const LoadedWeights w = load_weights(model, cfg.model.init_from, cfg.model.init_skip, vocab);
  spdlog::info("model: weights from {} ({}, {} layout)", cfg.model.init_from, w.format, w.layout);
  for (const auto& note : w.notes) spdlog::info("model: {}", note);
  if (!w.skipped_keys.empty()) {
    std::string keys;
    for (const auto& k : w.skipped_keys) keys += (keys.empty() ? "" : ", ") + k;
    spdlog::info("model: {} keys keep their initialization (model.init_skip): {}", w.skipped_keys.size(), keys);
  }
}

CommBackend comm_backend(const Config& cfg, const torch::Device& device) {
  std::optional<CommBackend> wanted;  // auto: the device's
  if (cfg.dist.backend == DistBackend::kGloo) wanted = CommBackend::kGloo;
  if (cfg.dist.backend == DistBackend::kNccl) wanted = CommBackend::kNccl;
  return resolve_backend(wanted, device);
}

bool loss_scaling(const Config& cfg) {
  return cfg.amp.enabled && cfg.amp.dtype == AmpDtype::kFp16 && cfg.amp.scaler != ScalerMode::kOff;
}

std::string precision_of(const Config& cfg) { return cfg.amp.enabled ? mode_name(cfg.amp.dtype) : "fp32"; }

int cpu_threads(const Config& cfg, int64_t local_world_size) {
  if (cfg.train.threads > 0) return static_cast<int>(cfg.train.threads);
  return std::max<int>(1, usable_cpus(container_root()) / static_cast<int>(std::max<int64_t>(1, local_world_size)));
}

AutoLimitOptions auto_limit_options(const Config& cfg, bool cuda) {
  AutoLimitOptions o;
  // On the CPU, with freed memory given back (heap.h), the process's RSS still grew 13-19 MiB past
  // non-tensor memory + tensor peak in a run with backoffs (docs/MEMORY.md "RSS against the container's
  // limit"): 0.1 of what is left did not cover that in a small container, 0.3 did.
  o.margin = cfg.memory.auto_margin >= 0 ? cfg.memory.auto_margin : cuda ? kAutoMarginCuda : kAutoMarginCpu;
  o.reserve_bytes = parse_bytes(cfg.memory.auto_reserve);
  o.system_root = container_root();
  return o;
}

std::string memory_limit_spec(const Config& cfg) {
  std::string spec;
  for (char c : cfg.memory.limit)
    if (!std::isspace(static_cast<unsigned char>(c))) spec += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return spec;
}

bool cuda_job(const Config& cfg) {
  return cfg.train.device.rfind("cuda", 0) == 0 || (cfg.train.device == "auto" && torch::cuda::is_available());
}

std::string describe_memory_limit(const Config& cfg) {
  const std::string spec = memory_limit_spec(cfg);
  // A CUDA job may be dry-run on a machine without the GPU it will run on: name the device as written.
  const bool cuda = cuda_job(cfg);
  const std::string device = cuda ? (cfg.train.device == "auto" ? std::string("cuda") : cfg.train.device) : "cpu";
  if (spec.empty() || spec == "none") return "memory.limit none: no cap";
  if (spec != "auto") return "memory.limit " + spec + ": a cap of " + format_bytes(parse_bytes(spec)) + " on " + device;
  const AutoLimitOptions o = auto_limit_options(cfg, cuda);
  char margin[16];
  std::snprintf(margin, sizeof margin, "%.0f%%", 100 * o.margin);
  if (cuda)
    return "memory.limit auto on " + device + ": the GPU's free memory (with what the run holds), less " + margin +
           " of the GPU's memory, read again between steps";
  // Nothing is a tensor yet under the trainer's cap: everything this process holds counts as other memory.
  const AutoCpuLimit a = smaller_auto_cpu_limit(read_memory_bounds(o.system_root), host_rss_bytes(), 0,
                                                o.reserve_bytes, o.margin);
  if (a.cap == 0) return "memory.limit auto on cpu: no container limit, and /proc/meminfo unreadable: no cap";
  return "memory.limit auto on cpu: container limit " +
         (a.bounds.container_bytes ? format_bytes(a.bounds.container_bytes) : std::string("none")) + ", machine " +
         (a.bounds.host_bytes ? format_bytes(a.bounds.host_bytes) : std::string("unknown")) +
         " (available + held); the " + a.source + " binds -> tensor cap " + format_bytes(a.cap) + " now (reserve " +
         format_bytes(o.reserve_bytes) + ", margin " + margin + "; resolved again when the run starts and between steps)";
}

MicroBatchOptions micro_batch_options(const Config& cfg, int64_t rank_batch) {
  MicroBatchOptions co;
  co.global_batch = rank_batch;
  co.micro_batch = cfg.train.micro_batch > 0 ? std::min(cfg.train.micro_batch, rank_batch) : rank_batch;
  co.min_micro_batch = std::min(cfg.memory.min_micro_batch, rank_batch);
  co.checkpointing = cfg.memory.activation_checkpointing == Checkpointing::kAll;
  co.allow_checkpointing = cfg.memory.ladder_checkpointing;
  co.grow_after = cfg.memory.grow_after;
  co.headroom = cfg.memory.headroom;
  co.halvings_only = cfg.memory.ladder_sizes == LadderSizes::kHalvings;
  return co;
}

MicroBatchController make_controller(const MicroBatchOptions& options, int64_t limit) {
  MicroBatchController c(options);
  c.on_limit_changed(limit);
  c.take_events();
  return c;
}

StepOptions step_options(const Config& cfg, const torch::Device& device) {
  StepOptions o;
  o.forward.device = device;
  o.forward.channels_last = cfg.model.channels_last;
  o.forward.amp = cfg.amp.enabled;
  o.forward.amp_dtype = amp_scalar_type(cfg.amp.dtype);
  o.forward.param_dtype = cfg.model.param_dtype == ParamDtype::kBfloat16 ? torch::kBFloat16 : torch::kFloat;
  o.loss.label_smoothing = cfg.train.label_smoothing;
  o.loss.fused = cfg.train.fused_loss;
  o.loss.kind = cfg.train.loss;
  o.loss.bce_target_threshold = cfg.train.bce_target_threshold;
  o.loss.bce_sum_classes = cfg.train.bce_sum_classes;
  o.mix.mixup_alpha = cfg.train.mixup_alpha;
  o.mix.cutmix_alpha = cfg.train.cutmix_alpha;
  o.mix.prob = cfg.train.mix_prob;
  o.mix.switch_prob = cfg.train.mix_switch_prob;
  o.mix.mode = cfg.train.mix_mode;
  o.mix_seed = static_cast<uint64_t>(cfg.seed);
  o.grad_clip = cfg.optim.grad_clip;
  o.activation_checkpointing = cfg.memory.activation_checkpointing;
  o.checkpoint_every_k = cfg.memory.checkpoint_every_k;
  o.batched_snapshot = cfg.train.snapshot == SnapshotMode::kBatched;
  o.cuda_graph = cfg.train.cuda_graph;
  o.auto_search = cfg.memory.auto_search;
  // Deterministic runs keep cuDNN's benchmark mode off, as before the policy: timing can choose other
  // algorithms from run to run (whichever measured faster), and with them other rounding.
  o.cudnn.mode = cfg.train.deterministic ? CudnnMode::kOff : cfg.memory.cudnn_policy;
  o.cudnn.retry_tuning_oom = device.is_cuda();
  return o;
}

EvalSettings eval_settings(const Config& cfg, const torch::Device& device, int64_t rank, int64_t world_size) {
  EvalSettings s;
  s.batch = cfg.train.eval_batch;
  s.max_batches = cfg.train.eval_batches;
  s.context = cfg.model.context;
  s.workers = cfg.data.workers > 0 ? cfg.data.workers : at::get_num_threads();
  s.normalize = cfg.data.normalize;
  s.pin_memory = device.is_cuda();
  s.rank = rank;
  s.world_size = world_size;
  s.forward = step_options(cfg, device).forward;
  s.loss.fused = cfg.train.fused_loss;  // scored by cross-entropy over class ids, without label smoothing, whatever train.loss
  return s;
}

}  // namespace trainer
