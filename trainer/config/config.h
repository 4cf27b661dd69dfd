// The typed configuration tree. Precedence: defaults (below) < YAML file < --set key=value; then
// validate(); then the resolved tree is written into the run folder as resolved_config.yaml.
//
// Every key is declared once, in config_fields.cpp's field table, which drives YAML parsing, --set,
// error messages (unknown key, wrong type: naming the key and the file) and the YAML dump.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace trainer {

/// A configuration problem: the message names the key and where it came from (file or --set).
struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---- modes -------------------------------------------------------------------------------------------
// A key whose value is one of a fixed set of names is an enum. The name is read once, at the config's edge
// (YAML, --set: a name outside the set is refused there, naming the file or --set, the key and the names
// it takes), and code compares enumerators, so a misspelt mode does not compile. Each enum's names are
// written once, in the field table (config_fields.cpp), in the enum's order: the reading, the YAML dump
// (resolved_config.yaml, a checkpoint's config.yaml), --list-keys and the refusals all go through them.
// The keys that stay strings take open sets: paths, byte sizes (memory.limit, memory.auto_reserve), a
// device (train.device: cuda:N), URLs and text, and model.name (the model registry's names).

/// How many values the mode E has, declared beside E; its name table (config_fields.cpp) must list exactly
/// that many names, or the table does not compile.
template <class E>
inline constexpr size_t kModeCount = 0;

/// auto | on | off (data.uint8_batches, data.fetch_ahead, train.cuda_graph); auto decides by the job,
/// as each key says.
enum class Switch { kAuto, kOn, kOff };
template <> inline constexpr size_t kModeCount<Switch> = 3;
/// data.kind: hdf5 | packed_images | image_folder | synthetic | tokens.
enum class DataKind { kHdf5, kPackedImages, kImageFolder, kSynthetic, kTokens };
template <> inline constexpr size_t kModeCount<DataKind> = 5;
/// data.auto_augment: none | randaugment | trivialaugment.
enum class AutoAugment { kNone, kRandAugment, kTrivialAugment };
template <> inline constexpr size_t kModeCount<AutoAugment> = 3;
/// optim.name: sgd | adamw | lamb.
enum class OptimKind { kSgd, kAdamW, kLamb };
template <> inline constexpr size_t kModeCount<OptimKind> = 3;
/// optim.implementation: auto | plain | foreach | fused. What an optimizer runs is never auto
/// (Optimizer::implementation).
enum class OptimImpl { kAuto, kPlain, kForeach, kFused };
template <> inline constexpr size_t kModeCount<OptimImpl> = 4;
/// optim.state_dtype: float32 | bfloat16 | int8 (AdamW's and LAMB's moments: trainer/numerics/moments.h).
enum class StateDtype { kFloat32, kBfloat16, kInt8 };
template <> inline constexpr size_t kModeCount<StateDtype> = 3;
/// model.param_dtype: float32 | bfloat16 (the weights' and gradients' storage: docs/MEMORY.md).
enum class ParamDtype { kFloat32, kBfloat16 };
template <> inline constexpr size_t kModeCount<ParamDtype> = 2;
/// schedule.name: constant | cosine | step.
enum class ScheduleKind { kConstant, kCosine, kStep };
template <> inline constexpr size_t kModeCount<ScheduleKind> = 3;
/// train.loss: cross_entropy | bce.
enum class LossKind { kCrossEntropy, kBce };
template <> inline constexpr size_t kModeCount<LossKind> = 2;
/// train.mix_mode: batch | elem.
enum class MixMode { kBatch, kElem };
template <> inline constexpr size_t kModeCount<MixMode> = 2;
/// train.snapshot: batched | per_buffer.
enum class SnapshotMode { kBatched, kPerBuffer };
template <> inline constexpr size_t kModeCount<SnapshotMode> = 2;
/// amp.dtype: bf16 | fp16.
enum class AmpDtype { kBf16, kFp16 };
template <> inline constexpr size_t kModeCount<AmpDtype> = 2;
/// amp.scaler: auto | true | false (kOn is `true`, kOff `false`).
enum class ScalerMode { kAuto, kOn, kOff };
template <> inline constexpr size_t kModeCount<ScalerMode> = 3;
/// memory.activation_checkpointing: none | all | every_k | auto.
enum class Checkpointing { kNone, kAll, kEveryK, kAuto };
template <> inline constexpr size_t kModeCount<Checkpointing> = 4;
/// memory.state: fixed | auto (whether the run may store the optimizer's state in fewer bytes to fit).
enum class MemoryState { kFixed, kAuto };
template <> inline constexpr size_t kModeCount<MemoryState> = 2;
/// memory.ladder_sizes: any | halvings.
enum class LadderSizes { kAny, kHalvings };
template <> inline constexpr size_t kModeCount<LadderSizes> = 2;
/// memory.auto_search: auto | curve | doubling.
enum class AutoSearch { kAuto, kCurve, kDoubling };
template <> inline constexpr size_t kModeCount<AutoSearch> = 3;
/// memory.cudnn_policy: always | off | start | pretune | settle (trainer/step/cudnn_policy.h).
enum class CudnnMode { kAlways, kOff, kStart, kPretune, kSettle };
template <> inline constexpr size_t kModeCount<CudnnMode> = 5;
/// log.level: trace | debug | info | warn | error (spdlog's names for its levels).
enum class LogLevel { kTrace, kDebug, kInfo, kWarn, kError };
template <> inline constexpr size_t kModeCount<LogLevel> = 5;
/// dist.backend: auto | gloo | nccl.
enum class DistBackend { kAuto, kGloo, kNccl };
template <> inline constexpr size_t kModeCount<DistBackend> = 3;
/// dist.shard: none | optimizer | gradients (what data-parallel ranks split instead of copying:
/// trainer/dist/shard.h).
enum class ShardMode { kNone, kOptimizer, kGradients };
template <> inline constexpr size_t kModeCount<ShardMode> = 3;

/// The names of the mode E's values, in the enum's order: the one list they are written in
/// (config_fields.cpp, for each enum above).
template <class E>
const std::vector<std::string>& mode_names();

/// The name of `value`, as YAML and the dump write it.
template <class E>
const std::string& mode_name(E value) {
  return mode_names<E>().at(static_cast<size_t>(value));
}

/// The index of `name` in `names`; std::invalid_argument "'<name>' is not one of: <names, comma-separated>"
/// when it is none of them.
size_t mode_index(const std::vector<std::string>& names, const std::string& name);

/// The value of E named `name`; std::invalid_argument as mode_index otherwise.
template <class E>
E mode_from_name(const std::string& name) {
  return static_cast<E>(mode_index(mode_names<E>(), name));
}

struct ModelConfig {
  std::string name = "resnet20";  ///< a name from models::model_names() (a string: the registry holds the names)
  int64_t num_classes = 10;       ///< classifier outputs
  bool zero_init_residual = false;  ///< last BN of each residual branch starts at 0
  bool channels_last = false;     ///< NHWC memory format for weights and inputs
  /// The weights, their gradients and the activations held in float32 or bfloat16 (half the bytes). bfloat16
  /// weights are updated by AdamW in float32 and rounded back (optim.stochastic_rounding: how); CPU only.
  ParamDtype param_dtype = ParamDtype::kFloat32;
  std::string init_from;          ///< weights to start from: safetensors or torch.save, our names or Hugging Face's (GPT-2), timm's or torchvision's (docs/MODELS.md)
  std::vector<std::string> init_skip;  ///< with init_from: glob patterns of our names that keep their initialization (`[fc.*]`: a classifier of another size)
  int64_t context = 0;            ///< language models: tokens per sample (0 = the model's own)
  int64_t vocab_size = 0;         ///< language models: 0 = the token file's, or for synthetic tokens the model's own
  /// Language models: the token embedding's rows (and the output matmul's columns) rounded up to a multiple of
  /// this, for aligned matmuls (64: GPT-2's 50257 -> 50304, as nanoGPT); the extra rows are zero, never looked
  /// up, and their logits are dropped before the loss. 1 = none. Changes wte's shape in checkpoints.
  int64_t vocab_multiple = 1;
  /// GPT: each Linear layer adds its bias inside its matmul (one addmm, as PyTorch's nn.Linear); false runs
  /// LibTorch's nn::Linear (a matmul, then an add over the whole output), kept to measure the difference.
  bool fused_bias = true;
  double dropout = 0.0;           ///< Transformers: dropout probability
  /// model.name llama: the transformers config.json (or the folder holding it) the architecture is read
  /// from; empty = the config.json beside model.init_from (a Hub folder). Other models: must be empty.
  std::string hf_config;
  /// LoRA (models/lora.h, peft's LoraConfig): adapters on the named Linear layers, every other weight
  /// frozen. rank 0 = off.
  struct Lora {
    int64_t rank = 0;                  ///< r
    double alpha = 8;                  ///< lora_alpha: the adapter's term is scaled by alpha / rank
    double dropout = 0;                ///< lora_dropout, on the adapter's input
    std::vector<std::string> targets;  ///< target_modules: Linear layers by name (empty = peft's default: q_proj, v_proj / c_attn)
    bool use_rslora = false;           ///< scale by alpha / sqrt(rank) (rsLoRA)
  } lora;
  /// A PEFT adapter folder (adapter_config.json, adapter_model.safetensors) to start the adapters from;
  /// its rank and targets must be model.lora's.
  std::string lora_init_from;
};

struct DataConfig {
  DataKind kind = DataKind::kHdf5;                   ///< hdf5 (images) | packed_images | image_folder | tokens | synthetic (images or tokens, as the model takes)
  std::string train = "datasets/fmnist/train.h5";    ///< training split: an HDF5 file, or image_folder's DIR/train
  std::string test = "datasets/fmnist/test.h5";      ///< evaluation split ("" = no evaluation)
  bool in_memory = true;                             ///< read the HDF5 file once into memory
  double check_timeout_s = 30;                       ///< the child that opens an HDF5 file first is killed after this (+20 s per GiB)
  std::vector<int64_t> shape = {3, 224, 224};        ///< synthetic images: sample shape (C, H, W)
  int64_t synthetic_size = 10000;                    ///< synthetic: samples (images, or windows of context tokens) per epoch
  int64_t workers = 0;                               ///< loader threads (0 = usable CPUs)
  int64_t prefetch = 2;                              ///< global batches prepared ahead
  int64_t crop_padding = 0;                          ///< random crop after zero padding (0 = off; packed_images, image_folder: instead of RandomResizedCrop)
  bool hflip = false;                                ///< random horizontal flip
  bool normalize = true;                             ///< subtract mean, divide by std
  AutoAugment auto_augment = AutoAugment::kNone;     ///< none | randaugment | trivialaugment (torchvision's RandAugment, TrivialAugmentWide; training only)
  int64_t randaugment_ops = 2;                       ///< randaugment: operations per sample (num_ops)
  int64_t randaugment_magnitude = 9;                 ///< randaugment: magnitude bin in [0, 30] (of 31)
  double random_erasing = 0;                         ///< RandomErasing's probability after normalization (0 = off; training only)
  /// Stored pixels (hdf5, synthetic images) in training batches: auto | on | off. on: uint8 NHWC, converted,
  /// normalized and erased on the device, as decoded images always are (a quarter of the bytes to copy);
  /// off: float32, normalized and erased by the loader; auto: on for a CUDA device, off elsewhere.
  Switch uint8_batches = Switch::kAuto;
  /// The next step's batch fetched while the device runs this step, its copy queued on a side stream:
  /// auto | on | off. auto: on for a CUDA device; on: also on the CPU (the same order, nothing to overlap);
  /// off: each micro-batch crosses to the device inside its step, on the compute stream.
  Switch fetch_ahead = Switch::kAuto;
  int64_t size = 224;                                ///< packed_images, image_folder: side of a decoded sample
  /// packed_images, image_folder: side of an evaluation sample (0 = data.size). The published recipes train
  /// smaller than they test (RSB A3: 160 and 224; torchvision's: 176 and 224); a ResNet takes any size.
  int64_t eval_size = 0;
  std::vector<double> scale = {0.08, 1.0};           ///< packed_images, image_folder: RandomResizedCrop's area range
  std::vector<double> ratio = {3.0 / 4.0, 4.0 / 3.0};  ///< packed_images, image_folder: RandomResizedCrop's aspect range
  double crop_pct = 0.875;                           ///< packed_images, image_folder: eval view = shorter side to size / crop_pct, center crop
  int64_t max_image_pixels = 100000000;              ///< refuse an image whose header claims more width * height
};

struct OptimConfig {
  OptimKind name = OptimKind::kSgd;  ///< sgd | adamw | lamb (timm's Lamb: trainer/numerics/optim.h)
  double lr = 0.1;              ///< peak learning rate (after warmup)
  double momentum = 0.9;        ///< sgd
  bool nesterov = true;         ///< sgd
  double weight_decay = 5e-4;   ///< L2 (sgd), decoupled (adamw), or added to the update before the trust ratio (lamb)
  bool decay_norm_and_bias = false;  ///< false: no weight decay on BatchNorm/LayerNorm weights and biases
  double beta1 = 0.9;           ///< adamw, lamb
  double beta2 = 0.999;         ///< adamw, lamb
  double eps = 1e-8;            ///< adamw, lamb (timm's Lamb defaults to 1e-6: the LAMB recipes set it)
  double grad_clip = 0.0;       ///< max global gradient norm (0 = off)
  /// lamb: the optimizer's own global gradient-norm clip (timm Lamb's max_grad_norm), applied after
  /// train's grad_clip: the gradients are divided by max(1, norm / this). 0 = off.
  double lamb_max_grad_norm = 1.0;
  bool trust_clip = false;      ///< lamb: the trust ratio at most 1 (LAMBC; timm Lamb's trust_clip)
  /// lamb: the trust ratio also for tensors without weight decay (timm Lamb's always_adapt); otherwise
  /// those take the plain Adam step.
  bool always_adapt = false;
  /// How the update runs (trainer/numerics/optim.h): auto (fused on CUDA with LibTorch 2.4+, foreach on CUDA
  /// before, plain on the CPU; lamb: plain), plain (tensor by tensor), foreach (multi-tensor ops), fused (one
  /// fused kernel per group: LibTorch 2.4+). lamb runs plain only.
  OptimImpl implementation = OptimImpl::kAuto;
  /// adamw, lamb: what the two moments are held in (trainer/numerics/moments.h). float32 (8 bytes a
  /// parameter), bfloat16 (4), or int8: blockwise dynamic quantization as torchao's AdamW8bit and
  /// bitsandbytes' 8-bit Adam, blocks of 256 with a float32 scale each (about 2.03 bytes a parameter;
  /// tensors under 4,096 elements, or not a multiple of 256, stay float32). Low-precision state runs the
  /// plain implementation, on the CPU.
  StateDtype state_dtype = StateDtype::kFloat32;
  /// adamw with model.param_dtype bfloat16: the updated weights are rounded back to bfloat16 stochastically
  /// (torchao's bf16_stochastic_round: an update below bfloat16's resolution survives on average) instead of
  /// to nearest (where it is lost). The random bits come from (seed, step, tensor, index): a resumed run
  /// rounds as the uninterrupted one (trainer/numerics/stochastic_round.h).
  bool stochastic_rounding = false;
};

struct ScheduleConfig {
  ScheduleKind name = ScheduleKind::kCosine;  ///< constant | cosine | step
  int64_t warmup_steps = 0;           ///< linear warmup from 0 to optim.lr
  double warmup_epochs = 0.0;         ///< alternative to warmup_steps (converted with steps per epoch)
  double min_lr = 0.0;                ///< cosine floor
  std::vector<int64_t> milestones;    ///< step: optimizer steps at which lr is multiplied by gamma
  double gamma = 0.1;                 ///< step
};

struct TrainConfig {
  int64_t global_batch = 128;   ///< samples per optimizer step (constant whatever the micro-batch)
  int64_t micro_batch = 0;      ///< samples per forward/backward; 0 = global_batch; -1 (`auto`) = largest that fits
  int64_t steps = 0;            ///< optimizer steps (0: use epochs)
  double epochs = 0.0;          ///< passes over the training split (used when steps is 0)
  int64_t eval_every = 0;       ///< evaluate every N steps (0 = once per epoch); always at the end
  int64_t eval_batch = 500;     ///< evaluation batch (its micro-batch backs off on OOM by itself)
  int64_t eval_batches = 0;     ///< evaluate on the first N batches of the split (0 = all of it)
  /// Label smoothing s: targets (1 - s) one_hot + s / classes, as PyTorch's cross_entropy applies it; under
  /// Mixup/CutMix folded into the mixed targets, with BCE into its one-hot targets (trainer/numerics/loss.h).
  double label_smoothing = 0.0;
  LossKind loss = LossKind::kCrossEntropy;  ///< cross_entropy | bce (binary cross-entropy over the classes, as ResNet Strikes Back)
  double bce_target_threshold = 0.0;   ///< bce: targets above it become 1, the rest 0 (0 = off; RSB: 0.2)
  bool bce_sum_classes = false;        ///< bce: sum over the classes instead of their mean
  /// Mixup and CutMix with timm's semantics (trainer/mix/mixing.h): each alpha > 0 turns one on.
  double mixup_alpha = 0.0;            ///< Mixup's lam ~ Beta(alpha, alpha) (0 = off)
  double cutmix_alpha = 0.0;           ///< CutMix's lam ~ Beta(alpha, alpha) (0 = off)
  double mix_prob = 1.0;               ///< probability that a batch (or a sample, mix_mode elem) is mixed
  double mix_switch_prob = 0.5;        ///< with both alphas: probability of CutMix rather than Mixup
  MixMode mix_mode = MixMode::kBatch;  ///< batch (one draw per step and rank) | elem (one per sample)
  bool fused_loss = true;       ///< the cross-entropy in one CUDA kernel each way (trainer/numerics/loss.h); CPU: plain
  std::string device = "auto";  ///< auto | cpu | cuda | cuda:N (a string: N is any device number)
  int64_t threads = 0;          ///< intra-op threads (0 = CPUs this process may use)
  bool deterministic = false;   ///< deterministic algorithms (bitwise-reproducible runs)
  /// How a step saves the buffers (BatchNorm statistics) that a retried step restores (trainer/step/step.h):
  /// batched (one copy per dtype) or per_buffer (a copy per buffer, the earlier way; kept to be measured).
  SnapshotMode snapshot = SnapshotMode::kBatched;
  /// The whole step (every micro-batch's forward and backward, the unscale, the clip, the update) as one
  /// CUDA graph, captured once per micro-batch layout and replayed (trainer/step/graph_policy.h): auto
  /// (on where it can run: a CUDA device, one process, the fused optimizer; off elsewhere) | on (an error
  /// where it cannot) | off.
  Switch cuda_graph = Switch::kAuto;
  /// GPT models: every N optimizer steps, one short sample of text from sample_prompt, written to train.log,
  /// metrics.jsonl (a "sample" event) and TensorBoard's text tab (0 = off). Rank 0, eval mode, a generator
  /// of its own seeded from seed and the step: the training's random numbers are not touched.
  int64_t sample_every = 0;
  int64_t sample_tokens = 64;   ///< tokens per sample
  /// The text the samples continue; "" = `<|endoftext|>` where the tokenizer has it, else a newline.
  std::string sample_prompt;
  /// An exponential moving average of the weights, timm's ModelEmaV3 (trainer/numerics/ema.h): its decay per
  /// update, in (0, 1); 0 = off. Checkpoints hold it (ema.pt); evaluations score both weight sets.
  double ema_decay = 0.0;
  bool ema_warmup = false;  ///< ModelEmaV3's use_warmup: decay min(ema_decay, 1 - (1 + step - 1)^(-2/3))
  int64_t ema_every = 1;    ///< update the average after every N-th optimizer step (torchvision's --model-ema-steps)
};

struct AmpConfig {
  bool enabled = false;           ///< autocast forward passes
  AmpDtype dtype = AmpDtype::kBf16;  ///< bf16 | fp16
  ScalerMode scaler = ScalerMode::kAuto;  ///< auto (on for fp16, off for bf16) | true | false
  double init_scale = 65536.0;    ///< GradScaler initial loss scale
  double growth_factor = 2.0;     ///< scale *= this after growth_interval clean steps
  double backoff_factor = 0.5;    ///< scale *= this after a step with inf/NaN gradients
  int64_t growth_interval = 2000; ///< clean steps between growths
};

struct MemoryConfig {
  std::string limit = "none";                 ///< byte size ("6GiB", "300MiB"), auto, or none (a string: sizes are open)
  double auto_margin = -1;  ///< auto: fraction of the limit kept free; -1: measured default (0.1 CUDA, 0.3 CPU)
  std::string auto_reserve = "0";             ///< auto on CPU: bytes kept for non-tensor memory that grows later (a byte size)
  std::string curve;                          ///< micro_batch auto: start at this bench --memory-curve JSON's prediction
  int64_t min_micro_batch = 1;                ///< backoff floor before the next rung
  Checkpointing activation_checkpointing = Checkpointing::kNone;  ///< none | all | every_k | auto
  int64_t checkpoint_every_k = 2;             ///< every_k: checkpoint blocks 0, k, 2k, ...
  bool ladder_checkpointing = true;           ///< the OOM ladder may turn checkpointing on
  int64_t grow_after = 50;                    ///< clean steps with headroom before probing a larger micro-batch
  double headroom = 0.25;                     ///< grow only when peak < (1 - headroom) * limit
  /// fixed: the numbers are stored as configured, whatever the memory (the default: nothing changes
  /// silently). auto: when the memory plan (trainer/run/memory_plan.h) shows that the job does not fit, the run
  /// stores AdamW's or LAMB's moments in fewer bytes (optim.state_dtype bfloat16, then int8: the least change
  /// that fits), logs a `memory_state` event and records the setting in resolved_config.yaml and MLflow's
  /// params. CPU only, as low-precision state.
  MemoryState state = MemoryState::kFixed;
  LadderSizes ladder_sizes = LadderSizes::kAny;  ///< any | halvings: grow-back probes only sizes reached by halving
  AutoSearch auto_search = AutoSearch::kAuto;   ///< micro_batch auto: auto (by probe cost; fastest size) | curve | doubling
  CudnnMode cudnn_policy = CudnnMode::kOff;     ///< always | off | start | pretune | settle: when cuDNN times algorithms
  int64_t cudnn_benchmark_limit = 0;          ///< algorithms cuDNN times per new shape (0 = LibTorch's default, 10)
  bool cudnn_empty_cache = true;              ///< empty the CUDA cache after each cuDNN timing (LibTorch's default)
};

struct CheckpointConfig {
  int64_t every_steps = 0;     ///< save every N optimizer steps (0 = off)
  double every_seconds = 0.0;  ///< save when this much time passed since the last save (0 = off)
  int64_t keep_last = 3;       ///< complete checkpoints kept
  bool async = true;           ///< write files on a background thread
  /// Failed save attempts in a row before the run stops with exit 4. A failed periodic save is retried
  /// at the next step; the saves a run ends with (SIGTERM/SIGINT, final, OOM give-up) are retried at
  /// once under fresh folder names, this many attempts in all.
  int64_t max_failures = 3;
  /// Save a checkpoint when the run ends (after its last step). `trainer bench` turns it off: a
  /// benchmark's state is not worth the seconds it takes to write (GPT-2 small with AdamW: 1.5 GB).
  bool final = true;
};

struct LogConfig {
  int64_t every = 20;               ///< log line and host sync every N steps
  LogLevel level = LogLevel::kInfo;  ///< trace | debug | info | warn | error
  int64_t http_port = 0;            ///< metrics/probe endpoint (0 = off)
  std::string http_host = "127.0.0.1";
  bool tensorboard = false;
  /// MLflow tracking server, http(s)://host:port (docs/OPERATIONS.md, "Tracking in MLflow"); "" = the
  /// environment's MLFLOW_TRACKING_URI if set, else no tracking; "off" = no tracking whatever it says.
  std::string mlflow;
  std::string mlflow_experiment;  ///< the MLflow experiment ("" = the config file's name, without .yaml)
};

/// Data-parallel training (docs/DISTRIBUTED.md). The rank and world size come from the environment
/// (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, as torchrun and PyTorchJob set them), not
/// from the config: one config serves any number of processes.
struct DistConfig {
  DistBackend backend = DistBackend::kAuto;  ///< auto (nccl on CUDA, gloo on CPU) | gloo | nccl
  double timeout_s = 600.0;      ///< a collective (or the rendezvous) that waits longer is an error
  double bucket_mb = 25.0;       ///< gradient all-reduce bucket size, MiB
  /// none: every rank holds the whole optimizer state; optimizer: each rank updates and keeps the state of
  /// its slice of every bucket (ZeRO stage 1); gradients: the gradients are reduce-scattered too, each rank
  /// keeping its slice (stage 2). A single process warns and ignores it.
  ShardMode shard = ShardMode::kNone;
};

/// The whole configuration. Each component is built from its own sub-tree only.
struct Config {
  ModelConfig model;
  DataConfig data;
  OptimConfig optim;
  ScheduleConfig schedule;
  TrainConfig train;
  AmpConfig amp;
  MemoryConfig memory;
  CheckpointConfig checkpoint;
  LogConfig log;
  DistConfig dist;
  uint64_t seed = 0;  ///< every random stream derives from it
};

/// Applies a YAML file over `cfg`. Throws ConfigError naming the file and key.
void apply_yaml_file(Config& cfg, const std::string& path);
/// Applies YAML text over `cfg`; `source` names it in errors.
void apply_yaml_text(Config& cfg, const std::string& text, const std::string& source);
/// Applies one `--set key=value` (dotted key; value parsed as YAML). Throws ConfigError.
void apply_override(Config& cfg, const std::string& assignment);
/// Checks ranges and combinations. Throws ConfigError naming the key.
void validate(const Config& cfg);
/// The whole tree as YAML (every key, in declaration order).
std::string to_yaml(const Config& cfg);
/// Every dotted key, in declaration order (for --help and tests).
std::vector<std::string> config_keys();
/// The names a mode key takes, in its enum's order (--list-keys); empty for a key of another kind.
std::vector<std::string> config_key_modes(const std::string& key);

/// defaults < file < overrides, then validate. An empty path means the built-in job
/// (configs/resnet20_fmnist.yaml, embedded at build time).
Config load_config(const std::string& path, const std::vector<std::string>& overrides);

}  // namespace trainer
