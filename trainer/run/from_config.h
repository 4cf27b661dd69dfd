// What the config builds, written once for every command that builds it (the run, `--dry-run`,
// `trainer bench`): the device, the model and its sample shape, the host threads, the micro-batch
// ladder, the step's options.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "data/files/h5_check.h"
#include "data/samples/loader.h"
#include "data/samples/token_loader.h"
#include "models/llama.h"
#include "models/model.h"
#include "models/registry.h"
#include "trainer/config/config.h"
#include "trainer/memory/oom.h"
#include "trainer/memory/resources.h"
#include "trainer/step/evaluate.h"
#include "trainer/step/step.h"

namespace trainer {

/// train.device: auto (CUDA when this build and machine have it, else the CPU) | cpu | cuda | cuda:N.
/// In a multi-process job (`local_rank` given), plain "cuda" means this process's GPU, cuda:<local rank>.
/// Throws ConfigError naming the key for a malformed string or a CUDA device that is not there.
torch::Device resolve_device(const std::string& spec, std::optional<int64_t> local_rank = std::nullopt);

/// Whether cfg.model is a language model (tokens in): then data.kind is tokens or synthetic (tokens);
/// an image model reads hdf5 or synthetic images. Throws ConfigError naming data.kind for a mismatch.
bool token_job(const Config& cfg);

/// Checks the HDF5 file `path` of the job's kind (images, or tokens for a language model) in a child
/// process before this process opens it (data/files/h5_check.h, issue 16), within data.check_timeout_s.
/// Call it before every reader of a user's file; `in_memory` as the reader that follows will read.
/// Throws one line naming the file when the child crashed, hung, ran out of memory or refused it.
data::H5CheckResult check_data_file(const Config& cfg, const std::string& path, bool in_memory);

/// Logs how long check_data_file's child took for `path` (nothing when no child ran), so a slow start
/// of the child can be told apart from a slow file.
void log_data_check(const std::string& path, const data::H5CheckResult& r);

/// One sample's shape: (C, H, W) for images, (T) for tokens; what the model is built for and
/// forward_flops takes. data.kind hdf5 reads the training file's header (checked first).
std::vector<int64_t> sample_shape(const Config& cfg);

/// data.kind packed_images or image_folder: samples decoded from encoded images (data/samples/image_sample.h).
bool encoded_image_job(const Config& cfg);

/// The training (`train`) or evaluation split at `path` of an encoded-image job: a PackedImageDataset
/// (packed_images) or an ImageFolderDataset (image_folder) decoding with the train transform
/// (RandomResizedCrop(data.size, data.scale, data.ratio), or with data.crop_padding the padded random
/// crop of the eval view; flip when data.hflip; seed) or the eval one (data.crop_pct).
/// `stats` (the training split's meta) gives an image_folder evaluation split the training mean/std;
/// `threads` compute an image_folder training split's mean/std at open time.
std::shared_ptr<data::ImageDataset> encoded_image_dataset(const Config& cfg, const std::string& path, bool train,
                                                          const data::ImageMeta* stats, int threads);

/// The image loader's options from the configuration (batch, seed, workers, prefetch, augmentation),
/// as the run and `trainer bench --loader-only` share them; the caller sets rank, world size and pinning.
/// Encoded-image datasets crop and flip in their own transform, so the loader's augmentation is off.
data::LoaderOptions image_loader_options(const Config& cfg, int64_t workers);

/// Whether stored pixels (data.kind hdf5, synthetic images) reach the step as uint8 batches
/// (data::LoaderOptions::uint8_batches): data.uint8_batches on, or auto on a CUDA `device`.
bool uint8_image_batches(const Config& cfg, const torch::Device& device);

/// Whether each step fetches the next step's batch and queues its copy while the device runs it
/// (TrainingRun's fetch-ahead, BatchStager): data.fetch_ahead on, or auto on a CUDA `device`.
bool fetches_ahead(const Config& cfg, const torch::Device& device);

/// Decoded (uint8) images are normalized on the device: x = (pixel / 255 - mean[c]) / std[c] with the
/// training split's `stats`, or pixel / 255 alone when data.normalize is off.
void set_input_normalization(ForwardOptions& forward, const data::ImageMeta& stats, bool normalize,
                             const torch::Device& device);

/// model.init_from into `model` (built by build_model, on the CPU): a safetensors file or a torch.save
/// state dict, in our layout or Hugging Face's / timm's / torchvision's (trainer/checkpoint/weights.h),
/// keeping the initialization of the keys that match model.init_skip. Logs the format, the layout
/// recognised and what was dropped, filled in or skipped. Throws std::runtime_error naming the file and
/// the keys for weights that do not fit. `vocab`: a language model's vocabulary (build_model's), so that
/// a file of the real vocabulary fills a model padded by model.vocab_multiple; 0 for image models.
void load_init_weights(torch::nn::Module& model, const Config& cfg, int64_t vocab = 0);

/// Whether the GradScaler scales the loss: amp on, in fp16, with amp.scaler auto or true (validate()
/// refuses true with bf16).
bool loss_scaling(const Config& cfg);

/// fp32, or the autocast dtype (bf16, fp16).
std::string precision_of(const Config& cfg);

/// dist.backend as the process group's kind on `device` (resolve_backend, trainer/dist/dist.h: auto is
/// nccl for CUDA, gloo for the CPU). std::runtime_error where this build or the device cannot run it.
CommBackend comm_backend(const Config& cfg, const torch::Device& device);

/// model.name llama: the config.json its architecture is read from (model.hf_config, else the one beside
/// model.init_from; trainer/hf/families.h config_json_of); "" for every other model.
std::string hf_config_path(const Config& cfg);

/// model.name llama: the architecture hf_config_path(cfg) describes (trainer/hf/families.h), with
/// model.context checked against its max_position_embeddings; std::nullopt for every other model. Throws
/// std::runtime_error (ConfigError) with one line naming the file and the key.
std::optional<models::LlamaOptions> hf_architecture(const Config& cfg);

/// The vocabulary a token job's model is built with: model.vocab_size when set (it must cover the
/// token file's), else the training file's (data.kind tokens) or the model's registered one (synthetic).
/// model.name llama: the config.json's vocab_size (the data's must fit in it).
int64_t vocab_size(const Config& cfg);

/// The tokens of data.kind synthetic for a language model: data.synthetic_size windows of model.context
/// tokens per epoch (the TokenLoader's slots), vocab_size(cfg), from cfg.seed.
std::shared_ptr<data::SyntheticTokens> synthetic_tokens(const Config& cfg);

/// The options cfg.model builds with for samples of `shape` ((C, H, W) or (T)) and, for language models,
/// `vocab` tokens (build_model's; the memory plan counts the same model from them).
models::ModelOptions model_options(const Config& cfg, const std::vector<int64_t>& shape, int64_t vocab);

/// cfg.model for samples of `shape` ((C, H, W) or (T)) and, for language models, `vocab` tokens.
models::Model build_model(const Config& cfg, const std::vector<int64_t>& shape, int64_t vocab);

/// Host threads: train.threads, else the CPUs this process may use shared by the `local_world_size`
/// processes of its node (at least 1).
int cpu_threads(const Config& cfg, int64_t local_world_size);

/// How `memory.limit: auto` resolves: memory.auto_margin, memory.auto_reserve, the cgroup files and
/// proc/meminfo under container_root() (TRAINER_CGROUP_ROOT for tests), the process's RSS from the real
/// /proc.
/// memory.auto_margin -1 (the default) is kAutoMarginCuda on CUDA, kAutoMarginCpu on the CPU.
AutoLimitOptions auto_limit_options(const Config& cfg, bool cuda);

/// memory.limit in lower case, without spaces: "auto", "none", "6gib".
std::string memory_limit_spec(const Config& cfg);

/// Whether the job runs on CUDA: train.device names it, or auto on a machine that has one. A CUDA job may be
/// planned or dry-run on a machine without its GPU.
bool cuda_job(const Config& cfg);

/// One line for `--dry-run`: what memory.limit resolves to on this machine now. `auto` on the CPU reads
/// the container's limit and the machine's memory as the run will, with what this process holds now as
/// the memory that is not tensors (the run resolves again once its data and model exist); on a CUDA
/// device it is the GPU's free memory at start (said, not read: the GPU need not be on this machine).
std::string describe_memory_limit(const Config& cfg);

/// The default memory.auto_margin per device, measured (docs/MEMORY.md "RSS against the container's limit").
inline constexpr double kAutoMarginCuda = 0.1;
inline constexpr double kAutoMarginCpu = 0.3;

/// The ladder's options for a rank's slice of `rank_batch` samples per step.
MicroBatchOptions micro_batch_options(const Config& cfg, int64_t rank_batch);

/// A ladder that starts with `options` under the cap `limit` (0 = none). Setting the first limit is
/// not an event.
MicroBatchController make_controller(const MicroBatchOptions& options, int64_t limit);

/// The step's options on `device`.
StepOptions step_options(const Config& cfg, const torch::Device& device);

/// The evaluation's settings on `device` for rank `rank` of `world_size`: train.eval_batch,
/// eval_batches, model.context, data.workers (0 = this process's threads), data.normalize and the
/// step's forward options.
EvalSettings eval_settings(const Config& cfg, const torch::Device& device, int64_t rank = 0, int64_t world_size = 1);

}  // namespace trainer
