// validate(): the range and combination checks of a Config, one group per section; each failure names
// its key.
#include "trainer/config/config_internal.h"

#include "common/compat.h"
#include "models/registry.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/resources.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace trainer {

using config_internal::fail;

namespace {

// Range and combination checks, one group per config section; each failure names its key.
struct Checks {
  const Config& c;
  void bad(const std::string& key, const std::string& what) const { fail("config", key, what); }

  void model_and_data() const {
    const auto names = models::model_names();
    if (std::find(names.begin(), names.end(), c.model.name) == names.end()) {
      std::string known;
      for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
      bad("model.name", "unknown model '" + c.model.name + "'; known models: " + known);
    }
    if (c.model.num_classes < 1 || c.model.num_classes > kMaxClasses)
      bad("model.num_classes", "must be in [1, " + std::to_string(kMaxClasses) + "], got " + std::to_string(c.model.num_classes));
    // synthetic serves both: images of data.shape to an image model, tokens to a language model.
    const models::ModelTraits& model = models::model_traits(c.model.name);
    const bool language_model = model.language_model();
    const bool encoded_images = c.data.kind == DataKind::kPackedImages || c.data.kind == DataKind::kImageFolder;
    if (language_model && (c.data.kind == DataKind::kHdf5 || encoded_images))
      bad("model.name", "'" + c.model.name + "' is a language model and needs tokens, but data.kind is '" +
                            mode_name(c.data.kind) + "' (images); set data.kind: tokens or synthetic, or an image model");
    if (!language_model && c.data.kind == DataKind::kTokens)
      bad("model.name", "'" + c.model.name + "' is an image model, but data.kind is 'tokens'; set data.kind: hdf5 "
                            "or synthetic, or a language model (gpt2, gpt_tiny)");
    sizes();
    if (c.data.kind != DataKind::kSynthetic && c.data.train.empty())
      bad("data.train", std::string(c.data.kind == DataKind::kImageFolder ? "a folder" : "an HDF5 file") +
                            " is required for data.kind " + mode_name(c.data.kind));
    if (c.model.context < 0 || c.model.context > kMaxContext)
      bad("model.context", "must be in [0, " + std::to_string(kMaxContext) + "] (0 = the model's own)");
    if (c.model.vocab_size < 0 || c.model.vocab_size > INT32_MAX) bad("model.vocab_size", "must be in [0, 2^31) (0 = the data's)");
    if (c.model.vocab_multiple < 1 || c.model.vocab_multiple > 4096)
      bad("model.vocab_multiple", "must be in [1, 4096] (1 = no padding), got " + std::to_string(c.model.vocab_multiple));
    if (c.data.kind == DataKind::kTokens && c.model.context == 0) bad("model.context", "data.kind tokens needs the tokens per sample");
    if (c.model.dropout < 0 || c.model.dropout >= 1) bad("model.dropout", "must be in [0, 1)");
    if (!c.model.init_skip.empty() && c.model.init_from.empty())
      bad("model.init_skip", "names keys to leave out of model.init_from, which is not set");
    for (const auto& pattern : c.model.init_skip)
      if (pattern.empty()) bad("model.init_skip", "holds an empty pattern");
    if (model.shape_from_hub && c.model.hf_config.empty() && c.model.init_from.empty())
      bad("model.name", "llama takes its shape from a transformers config.json: set model.init_from to a Hub folder (or "
                        "weights beside their config.json), or model.hf_config; or name a shape (llama_tiny, smollm2_135m, "
                        "llama3_2_1b, qwen2_5_0_5b)");
    if (!c.model.hf_config.empty() && !model.shape_from_hub)
      bad("model.hf_config", "is read for model.name: llama only (model '" + c.model.name + "' has its own shape)");
    if (c.model.vocab_multiple > 1 && language_model && !model.pads_vocab)
      bad("model.vocab_multiple", "pads GPT models' vocabulary; '" + c.model.name + "' takes 1");
    if (c.data.kind == DataKind::kSynthetic && !language_model) {
      if (c.data.shape.size() != 3 ||
          std::any_of(c.data.shape.begin(), c.data.shape.end(), [](int64_t d) { return d < 1 || d > kMaxSide; }))
        bad("data.shape", "must be three integers (C, H, W) in [1, " + std::to_string(kMaxSide) + "]");
      if (c.data.shape[0] * c.data.shape[1] * c.data.shape[2] > kMaxSampleElements)
        bad("data.shape", "a sample of more than " + std::to_string(kMaxSampleElements) + " values (C * H * W)");
    }
    if (c.data.kind == DataKind::kSynthetic && c.data.synthetic_size < c.train.global_batch)
      bad("data.synthetic_size", "must be at least train.global_batch");
    if (c.data.workers < 0) bad("data.workers", "must be >= 0");
    if (c.data.prefetch < 1) bad("data.prefetch", "must be >= 1");
    if (!(c.data.check_timeout_s > 0)) bad("data.check_timeout_s", "must be > 0");
    if (c.data.crop_padding < 0) bad("data.crop_padding", "must be >= 0");
    augmentations(language_model);
    if (c.data.size < 1 || c.data.size > 4096) bad("data.size", "must be in [1, 4096]");
    if (c.data.eval_size < 0 || c.data.eval_size > 4096) bad("data.eval_size", "must be in [1, 4096], or 0 (= data.size)");
    if (c.data.eval_size > 0 && c.data.eval_size != c.data.size && model.fixed_input_size)
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

  // LoRA (models/lora.h): what can be told from the config alone; the targets against the model's layers
  // and the rank against their sizes are checked when the model is built.
  void lora() const {
    const auto& l = c.model.lora;
    if (l.rank < 0 || l.rank > 65536) bad("model.lora.rank", "must be in [0, 65536] (0 = no LoRA), got " + std::to_string(l.rank));
    if (!c.model.lora_init_from.empty() && l.rank == 0)
      bad("model.lora_init_from", "starts LoRA adapters, but model.lora.rank is 0: set it to the folder's r");
    if (l.rank == 0) return;
    if (!(l.alpha > 0)) bad("model.lora.alpha", "must be positive");
    if (!(l.dropout >= 0 && l.dropout < 1)) bad("model.lora.dropout", "must be in [0, 1)");
    for (const auto& t : l.targets)
      if (t.empty() || t.find('.') != std::string::npos)
        bad("model.lora.targets", "'" + t + "' is not a layer name (the last part of one: q_proj, c_attn)");
    if (!models::model_traits(c.model.name).language_model())
      bad("model.lora.rank", "LoRA adapts the Llama family and GPT models; '" + c.model.name + "' is not one");
  }

  // The training-only augmentations of images (data/pixels/augment.h).
  void augmentations(bool language_model) const {
    if (c.data.randaugment_ops < 0 || c.data.randaugment_ops > 64) bad("data.randaugment_ops", "must be in [0, 64]");
    if (c.data.randaugment_magnitude < 0 || c.data.randaugment_magnitude > 30)
      bad("data.randaugment_magnitude", "must be in [0, 30] (31 magnitude bins)");
    if (!(c.data.random_erasing >= 0 && c.data.random_erasing <= 1))
      bad("data.random_erasing", "must be a probability in [0, 1]");
    if (language_model && c.data.auto_augment != AutoAugment::kNone)
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
    if (!(c.optim.lr > 0)) bad("optim.lr", "must be > 0");
    if (c.optim.momentum < 0 || c.optim.momentum >= 1) bad("optim.momentum", "must be in [0, 1)");
    if (c.optim.nesterov && c.optim.name == OptimKind::kSgd && c.optim.momentum == 0) bad("optim.nesterov", "needs optim.momentum > 0");
    if (c.optim.weight_decay < 0) bad("optim.weight_decay", "must be >= 0");
    if (c.optim.beta1 < 0 || c.optim.beta1 >= 1) bad("optim.beta1", "must be in [0, 1)");
    if (c.optim.beta2 < 0 || c.optim.beta2 >= 1) bad("optim.beta2", "must be in [0, 1)");
    if (!(c.optim.eps > 0)) bad("optim.eps", "must be > 0");
    if (c.optim.grad_clip < 0) bad("optim.grad_clip", "must be >= 0 (0 = off)");
    if (!(c.optim.lamb_max_grad_norm >= 0)) bad("optim.lamb_max_grad_norm", "must be >= 0 (0 = off)");
    if (c.optim.name == OptimKind::kLamb && c.optim.implementation != OptimImpl::kAuto &&
        c.optim.implementation != OptimImpl::kPlain)
      bad("optim.implementation", mode_name(c.optim.implementation) + " has no lamb version (lamb runs plain); use auto or plain");
    if (c.optim.implementation == OptimImpl::kFused && !compat::kHasFusedOptimizers)
      bad("optim.implementation", "fused needs LibTorch 2.4 or later (this is " + compat::torch_version() +
                                      "); use auto, plain or foreach");
    if (c.optim.state_dtype != StateDtype::kFloat32) {
      const std::string dtype = mode_name(c.optim.state_dtype);
      if (c.optim.name == OptimKind::kSgd)
        bad("optim.state_dtype", dtype + " applies to AdamW's and LAMB's two moments; SGD's momentum buffer stays "
                                 "float32 (use float32, or optim.name adamw or lamb)");
      if (c.optim.implementation != OptimImpl::kAuto && c.optim.implementation != OptimImpl::kPlain)
        bad("optim.implementation", mode_name(c.optim.implementation) + " keeps float32 moments; optim.state_dtype " +
                                        dtype + " runs its own block update (use auto or plain)");
      if (c.train.cuda_graph == Switch::kOn)
        bad("train.cuda_graph", "on needs the fused float32 update; optim.state_dtype " + dtype +
                                    " has none (use auto or off)");
    }
    if (c.model.param_dtype == ParamDtype::kBfloat16) {
      if (c.optim.name != OptimKind::kAdamW)
        bad("model.param_dtype", "bfloat16 weights are updated by AdamW in float32 and rounded back; " +
                                     mode_name(c.optim.name) + " has no such update (use optim.name adamw, or float32)");
      if (c.train.device.rfind("cuda", 0) == 0)
        bad("model.param_dtype", "bfloat16 weights run on the CPU only (on " + c.train.device +
                                     " use float32 with amp.enabled)");
      if (c.amp.enabled)
        bad("amp.enabled", "the weights are bfloat16 already (model.param_dtype): autocast has nothing to cast "
                           "(use amp.enabled false)");
      if (c.optim.implementation != OptimImpl::kAuto && c.optim.implementation != OptimImpl::kPlain)
        bad("optim.implementation", mode_name(c.optim.implementation) + " updates in the weights' dtype; bfloat16 "
                                    "weights run their own float32 block update (use auto or plain)");
      if (c.train.cuda_graph == Switch::kOn)
        bad("train.cuda_graph", "on needs the fused float32 update; bfloat16 weights have none (use auto or off)");
      if (c.train.ema_decay > 0)
        bad("train.ema_decay", "an average kept in bfloat16 weights' dtype loses its updates ((1 - decay) times "
                               "the change is below bfloat16's resolution); use 0 with model.param_dtype bfloat16");
    } else if (c.optim.stochastic_rounding) {
      bad("optim.stochastic_rounding", "rounds bfloat16 weights after their float32 update; the weights are "
                                       "float32 (set model.param_dtype: bfloat16, or false)");
    }
    if (c.memory.state == MemoryState::kAuto) {
      if (c.optim.name == OptimKind::kSgd)
        bad("memory.state", "auto stores AdamW's and LAMB's moments in fewer bytes; SGD's momentum buffer stays "
                            "float32 (use fixed, or optim.name adamw or lamb)");
      if (c.optim.implementation != OptimImpl::kAuto && c.optim.implementation != OptimImpl::kPlain)
        bad("memory.state", "auto may store the moments in fewer bytes, which optim.implementation " +
                                mode_name(c.optim.implementation) + " cannot update (use auto or plain)");
      if (c.train.device.rfind("cuda", 0) == 0)
        bad("memory.state", "auto stores the moments in fewer bytes on the CPU only (use fixed on " + c.train.device + ")");
    }
    // A captured step needs the fused update, which reads its rate and its skip on the device.
    if (c.optim.name == OptimKind::kLamb && c.train.cuda_graph == Switch::kOn)
      bad("train.cuda_graph", "on needs the fused SGD/AdamW update; lamb has none (use auto or off)");
    if (c.schedule.warmup_steps < 0) bad("schedule.warmup_steps", "must be >= 0");
    if (c.schedule.warmup_epochs < 0) bad("schedule.warmup_epochs", "must be >= 0");
    if (c.schedule.warmup_steps > 0 && c.schedule.warmup_epochs > 0)
      bad("schedule.warmup_epochs", "set either schedule.warmup_steps or schedule.warmup_epochs, not both");
    if (c.schedule.min_lr < 0 || c.schedule.min_lr > c.optim.lr) bad("schedule.min_lr", "must be in [0, optim.lr]");
    if (!std::is_sorted(c.schedule.milestones.begin(), c.schedule.milestones.end()))
      bad("schedule.milestones", "must be increasing");
    if (c.schedule.name == ScheduleKind::kStep && c.schedule.milestones.empty()) bad("schedule.milestones", "the step schedule needs milestones");
  }

  // The image recipes' losses and Mixup/CutMix (trainer/numerics/loss.h, trainer/mix/mixing.h).
  void recipe_losses() const {
    if (!(c.train.bce_target_threshold >= 0 && c.train.bce_target_threshold < 1))
      bad("train.bce_target_threshold", "must be in [0, 1) (0 = off)");
    if (!(c.train.mixup_alpha >= 0)) bad("train.mixup_alpha", "must be >= 0 (0 = no Mixup)");
    if (!(c.train.cutmix_alpha >= 0)) bad("train.cutmix_alpha", "must be >= 0 (0 = no CutMix)");
    if (!(c.train.mix_prob >= 0 && c.train.mix_prob <= 1)) bad("train.mix_prob", "must be in [0, 1]");
    if (!(c.train.mix_switch_prob >= 0 && c.train.mix_switch_prob <= 1)) bad("train.mix_switch_prob", "must be in [0, 1]");
    const bool language_model = models::model_traits(c.model.name).language_model();
    if (language_model && (c.train.mixup_alpha > 0 || c.train.cutmix_alpha > 0))
      bad(c.train.mixup_alpha > 0 ? "train.mixup_alpha" : "train.cutmix_alpha",
          "mixes images; model '" + c.model.name + "' is a language model (set 0)");
    if (language_model && c.train.loss != LossKind::kCrossEntropy)
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
    if (c.train.sample_every < 0) bad("train.sample_every", "must be >= 0 (0 = off)");
    if (c.train.sample_every > 0 && !models::model_traits(c.model.name).language_model())
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
    if (c.amp.enabled && c.amp.dtype == AmpDtype::kFp16 && c.amp.scaler == ScalerMode::kOff)
      bad("amp.scaler", "fp16 needs the loss scaler (gradients underflow without it); set amp.scaler: auto or true");
    if (c.amp.enabled && c.amp.dtype == AmpDtype::kBf16 && c.amp.scaler == ScalerMode::kOn)
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
    if (c.memory.checkpoint_every_k < 1) bad("memory.checkpoint_every_k", "must be at least 1");
    if (c.memory.grow_after < 1) bad("memory.grow_after", "must be at least 1");
    if (c.memory.headroom < 0 || c.memory.headroom >= 1) bad("memory.headroom", "must be in [0, 1)");
    if (c.memory.cudnn_benchmark_limit < 0 || c.memory.cudnn_benchmark_limit > 10000)
      bad("memory.cudnn_benchmark_limit", "must be in [0, 10000] (0 = LibTorch's default, 10)");
    if (c.checkpoint.every_steps < 0) bad("checkpoint.every_steps", "must be >= 0");
    if (c.checkpoint.every_seconds < 0) bad("checkpoint.every_seconds", "must be >= 0");
    if (c.checkpoint.keep_last < 1 || c.checkpoint.keep_last > 1000000)
      bad("checkpoint.keep_last", "must be in [1, 1000000]");
    if (c.checkpoint.max_failures < 1) bad("checkpoint.max_failures", "must be at least 1");
    if (c.log.every < 1) bad("log.every", "must be at least 1");
    if (c.log.http_port < 0 || c.log.http_port > 65535) bad("log.http_port", "must be in [0, 65535]");
    if (c.dist.timeout_s <= 0) bad("dist.timeout_s", "must be positive");
    if (c.dist.bucket_mb <= 0) bad("dist.bucket_mb", "must be positive");
  }
};

}  // namespace

void validate(const Config& c) {
  const Checks checks{c};
  checks.model_and_data();
  checks.lora();
  checks.optimizer_and_schedule();
  checks.training();
  checks.amp();
  checks.memory_checkpoints_logs_dist();
}

}  // namespace trainer
