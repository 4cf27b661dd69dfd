#include "trainer/run.h"

#include <spdlog/spdlog.h>

#include <filesystem>
#include <fstream>

#include "data/image_h5.h"
#include "models/registry.h"
#include "models/summary.h"
#include "trainer/compat.h"
#include "trainer/signals.h"
#include "trainer/state_dict.h"

namespace fs = std::filesystem;

namespace trainer {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

torch::Device pick_device(const std::string& spec) {
  if (spec == "auto") return torch::cuda::is_available() ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  torch::Device d(spec);
  if (d.is_cuda() && !torch::cuda::is_available())
    throw ConfigError("train.device: '" + spec + "' asked for, but this LibTorch build or machine has no CUDA device");
  return d;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TrainingRun::TrainingRun(const Config& cfg, const RunOptions& opts) : cfg_(cfg), opts_(opts) {}

TrainingRun::~TrainingRun() {
  if (store_) {
    try {
      store_->wait();
    } catch (const std::exception& e) {
      spdlog::error("checkpoint: {}", e.what());
    }
  }
}

void TrainingRun::setup() {
  // Data parallel: the rendezvous comes first (it needs no files), so that every rank has checked the
  // run folder before any rank writes to it.
  env_ = dist_env_from();
  device_ = pick_device(cfg_.train.device);
  if (env_.distributed() && device_.is_cuda() && !device_.has_index())
    device_ = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env_.local_rank));
  if (env_.distributed()) {
    if (cfg_.train.global_batch % env_.world_size != 0)
      throw ConfigError("train.global_batch: " + std::to_string(cfg_.train.global_batch) +
                        " is not divisible by the world size " + std::to_string(env_.world_size) +
                        " (every rank takes an equal slice of each step's samples)");
    dist_ = std::make_unique<Distributed>(env_, resolve_backend(cfg_.dist.backend, device_), device_, cfg_.dist.timeout_s);
  }
  rank_dir_ = main_rank() ? opts_.run_dir : (fs::path(opts_.run_dir) / ("rank" + std::to_string(env_.rank))).string();

  // The run folder must be writable before anything is trained: failing after an hour is worse.
  std::error_code ec;
  // --no-resume starts fresh in an empty folder only: nothing of an earlier run is mixed in or overwritten.
  bool refused = opts_.no_resume && fs::exists(opts_.run_dir, ec) && !fs::is_empty(opts_.run_dir, ec);
  if (dist_ && dist_->all_max({refused ? 1.0 : 0.0}, "the run folder check")[0] > 0) refused = true;
  if (refused)
    throw std::runtime_error(opts_.run_dir + ": --no-resume needs an empty or new run folder, and this one is not "
                             "empty; use another --run-dir or remove it");
  fs::create_directories(rank_dir_, ec);
  if (ec) throw std::runtime_error(rank_dir_ + ": cannot create the run folder (" + ec.message() + ")");
  store_ = std::make_unique<CheckpointStore>(opts_.run_dir, static_cast<int>(cfg_.checkpoint.keep_last),
                                             cfg_.train.device);
  if (main_rank()) store_->check_writable();
  setup_logging(rank_dir_, cfg_.log.level);
  metrics_.open((fs::path(rank_dir_) / "metrics.jsonl").string());
  if (cfg_.log.tensorboard && main_rank()) tensorboard_ = std::make_unique<TensorboardWriter>(opts_.run_dir);
  metrics_.set_observer([this](const nlohmann::json& j) {
    telemetry_.observe(j);
    if (tensorboard_) tensorboard_->observe(j);
  });
  memory_report_ = std::make_unique<MemoryReporter>(rank_dir_, &telemetry_);
  if (cfg_.log.http_port > 0) {
    // One endpoint per process: the ranks on one node serve on consecutive ports.
    http_ = std::make_unique<HttpServer>(telemetry_, cfg_.log.http_host,
                                         static_cast<int>(cfg_.log.http_port + env_.local_rank));
    spdlog::info("http: serving /metrics /healthz /readyz /memory on {}", http_->url());
  }
  if (main_rank()) {
    std::ofstream out(fs::path(opts_.run_dir) / "resolved_config.yaml");
    out << to_yaml(cfg_);
  }
  spdlog::info("trainer {} (LibTorch {}), run folder {}", TRAINER_VERSION, compat::torch_version(), opts_.run_dir);
  if (dist_) setup_distributed();

  amp_dtype_ = cfg_.amp.dtype == "fp16" ? at::kHalf : at::kBFloat16;
  validate_amp(cfg_.amp.enabled, cfg_.amp.dtype, cfg_.amp.enabled && cfg_.amp.scaler != "false" && cfg_.amp.dtype == "fp16",
               device_.type());

  // Host threads follow the CPUs this process may use (affinity, container quota).
  // The processes of one node share its CPUs.
  int threads = cfg_.train.threads > 0 ? static_cast<int>(cfg_.train.threads)
                                       : std::max<int>(1, usable_cpus() / static_cast<int>(env_.local_world_size));
  apply_cpu_threads(threads);
  if (cfg_.train.deterministic) at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  at::globalContext().setBenchmarkCuDNN(!cfg_.train.deterministic);

  // Memory: the cap is installed before the model exists so every tensor is counted.
  memory_ = std::make_unique<PhasePeakBackend>(make_memory_backend(device_));  // per-phase peaks (step.cpp)
  resources_ = std::make_unique<ResourceMonitor>(device_.is_cuda() ? std::max<int>(0, device_.index()) : -1);
  telemetry_.set_info("device", device_.str());
  telemetry_.set_info("model", cfg_.model.name);
  telemetry_.set_info("version", TRAINER_VERSION);
  limit_spec_ = cfg_.memory.limit;
  limit_bytes_ = resolve_memory_limit(limit_spec_, *memory_, cfg_.memory.auto_margin);
  cgroup_limit_ = read_cgroup_memory().limit_bytes;
  memory_->set_limit(limit_bytes_);
  agreed_limit_ = limit_bytes_;
  control_ = std::make_unique<ControlFile>((fs::path(opts_.run_dir) / "control.yaml").string());

  // Data: images (HDF5 or synthetic) or a token stream, behind one stream interface.
  const int64_t workers = cfg_.data.workers > 0 ? cfg_.data.workers : threads;
  if (cfg_.data.kind == "tokens") {
    tokens_ = true;
    train_tokens_ = std::make_shared<data::TokenDataset>(cfg_.data.train, cfg_.data.in_memory);
    if (!cfg_.data.test.empty()) test_tokens_ = std::make_shared<data::TokenDataset>(cfg_.data.test, cfg_.data.in_memory);
    data::TokenLoaderOptions to;
    to.global_batch = cfg_.train.global_batch;
    to.context = cfg_.model.context;
    to.seed = cfg_.seed;
    to.rank = env_.rank;
    to.world_size = env_.world_size;
    loader_ = std::make_unique<StreamOf<data::TokenLoader>>(std::make_unique<data::TokenLoader>(train_tokens_, to));
    sample_shape_ = {cfg_.model.context};
  } else {
    if (cfg_.data.kind == "synthetic") {
      train_images_ = std::make_shared<data::SyntheticImageDataset>(cfg_.data.synthetic_size, cfg_.data.shape[0],
                                                                    cfg_.data.shape[1], cfg_.data.shape[2],
                                                                    cfg_.model.num_classes, cfg_.seed);
    } else {
      train_images_ = std::make_shared<data::ImageH5Dataset>(cfg_.data.train, cfg_.data.in_memory);
      if (!cfg_.data.test.empty())
        test_images_ = std::make_shared<data::ImageH5Dataset>(cfg_.data.test, cfg_.data.in_memory);
    }
    if (train_images_->num_classes() > cfg_.model.num_classes)
      throw ConfigError("model.num_classes: " + std::to_string(cfg_.model.num_classes) + ", but " + cfg_.data.train +
                        " has " + std::to_string(train_images_->num_classes()) + " classes");
    if (train_images_->size() < cfg_.train.global_batch)
      throw ConfigError("train.global_batch: " + std::to_string(cfg_.train.global_batch) + " is larger than the " +
                        std::to_string(train_images_->size()) + " samples of the training split");
    data::LoaderOptions lo;
    lo.global_batch = cfg_.train.global_batch;
    lo.seed = cfg_.seed;
    lo.rank = env_.rank;
    lo.world_size = env_.world_size;
    lo.workers = workers;
    lo.prefetch = cfg_.data.prefetch;
    lo.augment.random_crop_padding = cfg_.data.crop_padding;
    lo.augment.hflip = cfg_.data.hflip;
    lo.augment.normalize = cfg_.data.normalize;
    lo.pin_memory = device_.is_cuda();
    loader_ = std::make_unique<StreamOf<data::Loader>>(std::make_unique<data::Loader>(train_images_, lo));
    auto sh = train_images_->sample_shape();
    sample_shape_ = {sh[0], sh[1], sh[2]};
  }
  steps_per_epoch_ = loader_->steps_per_epoch();
  total_steps_ = cfg_.train.steps > 0 ? cfg_.train.steps
                                      : std::max<int64_t>(1, std::llround(cfg_.train.epochs * steps_per_epoch_));
  warmup_steps_ = cfg_.schedule.warmup_steps > 0 ? cfg_.schedule.warmup_steps
                                                 : std::llround(cfg_.schedule.warmup_epochs * steps_per_epoch_);

  torch::manual_seed(cfg_.seed);
  build_model();
  if (dist_) {
    // Every replica starts from rank 0's weights and buffers (the same seed makes them equal already;
    // this makes it a fact, also for init_from files that differ between nodes).
    std::vector<torch::Tensor> state;
    for (auto& p : model_->parameters()) state.push_back(p.data());
    for (auto& b : model_->buffers()) state.push_back(b);
    dist_->broadcast(state, "the initial model");
    std::vector<torch::Tensor> params;
    for (const auto& slot : optimizer_->params()) params.push_back(slot.param);
    grad_sync_ = std::make_unique<GradientSync>(*dist_, params, static_cast<int64_t>(cfg_.dist.bucket_mb * (1 << 20)));
    // Dropout masks differ between ranks, as they would between the samples of one large batch.
    if (env_.rank > 0) torch::manual_seed(cfg_.seed + 1000003ull * static_cast<uint64_t>(env_.rank));
    spdlog::info("distributed: {} gradient buckets of up to {} MiB", grad_sync_->num_buckets(), cfg_.dist.bucket_mb);
  }

  GradScalerOptions so;
  so.enabled(cfg_.amp.enabled && cfg_.amp.dtype == "fp16" && cfg_.amp.scaler != "false");
  so.init_scale(cfg_.amp.init_scale).growth_factor(cfg_.amp.growth_factor).backoff_factor(cfg_.amp.backoff_factor)
      .growth_interval(cfg_.amp.growth_interval);
  scaler_ = std::make_unique<GradScaler>(so);

  controller_ = std::make_unique<MicroBatchController>(controller_options());
  agree_on_limit();
  controller_->on_limit_changed(agreed_limit_);
  controller_->take_events();
  eval_micro_batch_ = cfg_.train.eval_batch;
}

void TrainingRun::setup_distributed() {
  spdlog::info("distributed: rank {} of {} (local {} of {}), {} samples of each global batch of {}", env_.rank,
               env_.world_size, env_.local_rank, env_.local_world_size, rank_batch(), cfg_.train.global_batch);
  telemetry_.set_info("rank", std::to_string(env_.rank));
  telemetry_.set_info("world_size", std::to_string(env_.world_size));
}

void TrainingRun::agree_on_limit() {
  // Every rank's controller must take the same decisions, so it sees the same inputs: the lowest cap
  // of all ranks (each rank's allocator still enforces its own).
  agreed_limit_ = limit_bytes_;
  if (!dist_) return;
  auto a = dist_->all_max({limit_bytes_ > 0 ? -static_cast<double>(limit_bytes_) : -1e300}, "the memory limit agreement");
  agreed_limit_ = a[0] <= -1e299 ? 0 : static_cast<int64_t>(-a[0]);
}

MicroBatchOptions TrainingRun::controller_options() const {
  MicroBatchOptions co;
  // The controller splits this rank's slice of the global batch (all of it in a single process).
  co.global_batch = rank_batch();
  co.micro_batch = cfg_.train.micro_batch > 0 ? std::min(cfg_.train.micro_batch, rank_batch()) : rank_batch();
  co.min_micro_batch = std::min(cfg_.memory.min_micro_batch, rank_batch());
  co.checkpointing = cfg_.memory.activation_checkpointing == "all";
  co.allow_checkpointing = cfg_.memory.ladder_checkpointing;
  co.grow_after = cfg_.memory.grow_after;
  co.headroom = cfg_.memory.headroom;
  return co;
}

void TrainingRun::log_controller_events() {
  for (const auto& e : controller_->take_events()) {
    spdlog::info("memory: {}", e.reason);
    nlohmann::json j = e.to_json();
    j["event"] = to_string(e.kind);
    j["step"] = step_;
    j["current_bytes"] = memory_->current_bytes();
    metrics_.write(j);
  }
}

void TrainingRun::build_model() {
  auto mo = models::ModelOptions()
                .num_classes(cfg_.model.num_classes)
                .zero_init_residual(cfg_.model.zero_init_residual)
                .context(cfg_.model.context)
                .dropout(cfg_.model.dropout);
  if (tokens_) mo.vocab_size(train_tokens_->vocab_size());
  else mo.in_channels(sample_shape_[0]);
  model_ = models::create_model(cfg_.model.name, mo);
  if (!cfg_.model.init_from.empty()) {
    load_state_dict(*model_, cfg_.model.init_from, /*strict=*/true);
    spdlog::info("model: weights from {}", cfg_.model.init_from);
  }
  model_->to(device_);
  if (cfg_.model.channels_last && !tokens_) models::to_channels_last(*model_);
  optimizer_ = std::make_unique<Optimizer>(param_slots(*model_, cfg_.optim.decay_norm_and_bias), cfg_.optim);
  flops_per_sample_ = model_->forward_flops(sample_shape_);
  spdlog::info("model: {} with {} parameters, {:.3f} GFLOPs per sample forward", cfg_.model.name,
               models::count_parameters(*model_), flops_per_sample_ / 1e9);
}

void TrainingRun::apply_activation_checkpointing() {
  const int64_t n = model_->num_blocks();
  std::vector<bool> mask(n, false);
  const std::string& policy = cfg_.memory.activation_checkpointing;
  // The controller's flag covers both `all` and the ladder's rung; `every_k` is the config's own choice.
  for (int64_t i = 0; i < n; ++i) {
    if (controller_->checkpointing()) mask[i] = true;
    else if (policy == "every_k") mask[i] = i % cfg_.memory.checkpoint_every_k == 0;
  }
  // `auto` starts without checkpointing and lets the OOM ladder turn it on.
  model_->set_checkpointed_blocks(mask);
}

// ---- resume -------------------------------------------------------------------------------------------

nlohmann::json TrainingRun::state_json() const {
  nlohmann::json j;
  j["step"] = step_;
  j["epoch"] = epoch_;
  j["position"] = position_;
  j["samples_seen"] = samples_seen_;
  j["seed"] = cfg_.seed;
  j["global_batch"] = cfg_.train.global_batch;
  j["micro_batch_config"] = cfg_.train.micro_batch;
  j["controller"] = controller_->to_json();
  j["scaler"] = scaler_->state();
  j["nonfinite_in_a_row"] = nonfinite_in_a_row_;
  j["eval_micro_batch"] = eval_micro_batch_;
  j["limit_spec"] = limit_spec_;
  j["world_size"] = env_.world_size;
  return j;
}

void TrainingRun::save_checkpoint(const std::string& reason, bool wait) {
  auto t0 = std::chrono::steady_clock::now();
  // Model and optimizer are replicated; the RNG is each rank's own, so rank 0 gathers them all and
  // writes the one checkpoint (every rank calls this at the same step: the gather is a collective).
  NamedTensors rng;
  auto cpu_state = at::detail::getDefaultCPUGenerator().get_state();
  auto cuda_state = device_.is_cuda() ? at::globalContext().defaultGenerator(device_).get_state() : torch::Tensor();
  if (dist_) {
    auto cpus = dist_->all_gather(cpu_state, "the RNG gather for a checkpoint");
    auto cudas = device_.is_cuda() ? dist_->all_gather(cuda_state, "the RNG gather for a checkpoint")
                                   : std::vector<torch::Tensor>{};
    for (int64_t r = 0; r < env_.world_size; ++r) {
      const std::string suffix = r == 0 ? "" : ".rank" + std::to_string(r);
      rng.emplace_back("cpu" + suffix, cpus[r].to(torch::kByte));
      if (!cudas.empty()) rng.emplace_back("cuda" + suffix, cudas[r].to(torch::kByte));
    }
    if (!main_rank()) {
      last_ckpt_time_ = std::chrono::steady_clock::now();
      return;
    }
  } else {
    rng.emplace_back("cpu", cpu_state);
    if (cuda_state.defined()) rng.emplace_back("cuda", cuda_state);
  }
  CheckpointFiles files;
  files["model.pt"] = state_dict_bytes(*model_);
  files["optimizer.pt"] = tensors_to_bytes(optimizer_->state());
  files["rng.pt"] = tensors_to_bytes(rng);
  files["state.json"] = json_text(state_json(), 2);
  files["config.yaml"] = to_yaml(cfg_);
  nlohmann::json extra = {{"reason", reason}, {"device", device_.str()}};
  if (cfg_.checkpoint.async && !wait) store_->save_async(step_, std::move(files), extra);
  else store_->save(step_, std::move(files), extra);
  last_ckpt_time_ = std::chrono::steady_clock::now();
  double secs = seconds_since(t0);
  spdlog::info("checkpoint: step {} ({}), {} in {:.2f}s{}", step_, reason, wait || !cfg_.checkpoint.async ? "written" : "serialized",
               secs, wait || !cfg_.checkpoint.async ? "" : ", writing in the background");
  metrics_.event("checkpoint", {{"step", step_}, {"reason", reason}, {"seconds", secs}});
}

bool TrainingRun::resume() {
  std::optional<LoadedCheckpoint> ck;
  if (!opts_.resume_from.empty()) {
    ck = CheckpointStore::load(opts_.resume_from);
  } else if (opts_.no_resume) {
    return false;  // setup() made sure the folder was empty
  } else {
    ck = store_->load_latest();
    for (const auto& w : ck ? ck->warnings : std::vector<std::string>{}) spdlog::warn("checkpoint: {}", w);
  }
  if (dist_ && dist_->all_max({ck ? 1.0 : 0.0, ck ? 0.0 : 1.0}, "the resume agreement") == std::vector<double>{1.0, 1.0})
    throw std::runtime_error("resume: some ranks found a checkpoint in " + opts_.run_dir + " and some did not; every rank "
                             "must see the same run folder (shared storage)");
  if (!ck) return false;

  // A resize may change memory settings, micro-batch or step count; a different model or data would
  // make a different experiment.
  Config saved;
  apply_yaml_text(saved, ck->files.at("config.yaml"), ck->path + "/config.yaml");
  auto same = [&](const std::string& key, const auto& a, const auto& b) {
    if (!(a == b))
      throw std::runtime_error("resume from " + ck->path + " refused: " + key +
                               " differs from the checkpoint's; start a new run folder for a different experiment");
  };
  same("model.name", cfg_.model.name, saved.model.name);
  same("model.num_classes", cfg_.model.num_classes, saved.model.num_classes);
  same("data.kind", cfg_.data.kind, saved.data.kind);
  same("data.train", cfg_.data.train, saved.data.train);
  same("data.shape", cfg_.data.shape, saved.data.shape);
  same("data.crop_padding", cfg_.data.crop_padding, saved.data.crop_padding);
  same("data.hflip", cfg_.data.hflip, saved.data.hflip);
  same("data.normalize", cfg_.data.normalize, saved.data.normalize);
  same("train.global_batch", cfg_.train.global_batch, saved.train.global_batch);
  same("seed", cfg_.seed, saved.seed);

  load_state_dict_bytes(*model_, ck->files.at("model.pt"), /*strict=*/true);
  std::map<std::string, torch::Tensor> opt_state;
  for (auto& [k, v] : tensors_from_bytes(ck->files.at("optimizer.pt"))) opt_state[k] = v.to(device_);
  optimizer_->load_state(opt_state);
  // Each rank's RNG: "cpu"/"cuda" are rank 0's, "cpu.rank<r>"/"cuda.rank<r>" the others'. A rank the
  // checkpoint has no state for (the job grew) keeps the stream it was seeded with.
  const std::string suffix = env_.rank == 0 ? "" : ".rank" + std::to_string(env_.rank);
  for (auto& [k, v] : tensors_from_bytes(ck->files.at("rng.pt"))) {
    // at::Generator is a handle: a copy sets the state of the process-wide generator.
    if (k == "cpu" + suffix) at::Generator(at::detail::getDefaultCPUGenerator()).set_state(v);
    else if (k == "cuda" + suffix && device_.is_cuda())
      at::Generator(at::globalContext().defaultGenerator(device_)).set_state(v);
  }
  auto st = nlohmann::json::parse(ck->files.at("state.json"));
  step_ = st.at("step");
  epoch_ = st.at("epoch");
  position_ = st.at("position");
  samples_seen_ = st.at("samples_seen");
  nonfinite_in_a_row_ = st.value("nonfinite_in_a_row", 0);
  scaler_->load_state(st.at("scaler").get<GradScalerState>());
  // The learned micro-batch survives a restart, unless the user changed train.micro_batch on purpose.
  // With another number of ranks the per-rank batch differs: the learned size is kept where it still
  // fits in the new slice, and the ladder's other state starts afresh.
  if (st.value("micro_batch_config", int64_t{0}) == cfg_.train.micro_batch) {
    auto learned = MicroBatchController::from_json(st.at("controller"));
    if (st.value("world_size", int64_t{1}) == env_.world_size) {
      controller_ = std::make_unique<MicroBatchController>(learned);
    } else {
      MicroBatchOptions co = controller_options();
      co.micro_batch = std::min(learned.micro_batch(), rank_batch());
      controller_ = std::make_unique<MicroBatchController>(co);
      spdlog::info("resume: the checkpoint was written by {} processes, this job has {}: micro-batch {} per rank",
                   st.value("world_size", int64_t{1}), env_.world_size, co.micro_batch);
    }
    controller_->on_limit_changed(agreed_limit_);
    log_controller_events();
    eval_micro_batch_ = st.value("eval_micro_batch", cfg_.train.eval_batch);
  }
  if (dist_) {
    // Every rank must have read the same checkpoint (the run folder is shared storage).
    auto a = dist_->all_max({static_cast<double>(step_), -static_cast<double>(step_)}, "the resume agreement");
    if (a[0] != -a[1])
      throw std::runtime_error("resume: the ranks found different checkpoints (steps " + std::to_string(-a[1]) + " to " +
                               std::to_string(a[0]) + "); every rank must see the same run folder (shared storage)");
  }
  loader_->seek(epoch_, position_);
  spdlog::info("resumed from {}: step {}, epoch {}, position {} (micro-batch {} x {})", ck->path, step_, epoch_,
               position_, controller_->micro_batch(), controller_->accum_steps());
  metrics_.event("resume", {{"step", step_}, {"path", ck->path}, {"epoch", epoch_}, {"position", position_},
                            {"micro_batch", controller_->micro_batch()}});
  return true;
}

// ---- limits -------------------------------------------------------------------------------------------

void TrainingRun::poll_limits() {
  // control.yaml is how an operator (or a container resize hook) changes the cap of a running job.
  ControlPoll poll = control_->poll();
  if (!poll.warning.empty()) spdlog::warn("{}", poll.warning);
  bool changed = false;
  if (poll.update && poll.update->memory_limit && *poll.update->memory_limit != limit_spec_) {
    spdlog::info("control.yaml: memory.limit {} -> {}", limit_spec_, *poll.update->memory_limit);
    limit_spec_ = *poll.update->memory_limit;
    changed = true;
  }
  // With `auto` on the CPU, the container's limit is re-read: a `docker update --memory` or a Kubernetes
  // in-place resize reaches the trainer this way. (The resolved cap also depends on the process's
  // non-tensor memory, so it is recomputed only when the cgroup limit itself moves.)
  if (limit_spec_ == "auto" && !device_.is_cuda()) {
    int64_t cg = read_cgroup_memory().limit_bytes;
    if (cg != cgroup_limit_) {
      cgroup_limit_ = cg;
      changed = true;
    }
  }
  if (changed) {
    int64_t limit = resolve_memory_limit(limit_spec_, *memory_, cfg_.memory.auto_margin);
    if (limit != limit_bytes_) {
      spdlog::info("memory: limit {} -> {} ({})", limit_bytes_ ? format_bytes(limit_bytes_) : "none",
                   limit ? format_bytes(limit) : "none", limit_spec_);
      limit_bytes_ = limit;
      memory_->set_limit(limit);
    }
  }
  // Every step, on every rank (a collective in a data-parallel job): one rank's resize moves all.
  const int64_t before = agreed_limit_;
  agree_on_limit();
  if (agreed_limit_ != before) {
    controller_->on_limit_changed(agreed_limit_);
    log_controller_events();
  }
}

void TrainingRun::poll_threads() {
  int threads = cfg_.train.threads > 0 ? static_cast<int>(cfg_.train.threads) : usable_cpus();
  if (threads != at::get_num_threads()) {
    spdlog::info("cpu: {} -> {} threads (affinity / quota changed)", at::get_num_threads(), threads);
    apply_cpu_threads(threads);
  }
}

// ---- evaluation ---------------------------------------------------------------------------------------

EvalResult TrainingRun::evaluate() {
  EvalResult r;
  if (!has_eval()) return r;
  torch::NoGradGuard no_grad;
  // Data parallel: BatchNorm statistics are each rank's own (as in DDP without SyncBatchNorm); the
  // evaluation uses rank 0's, as the checkpoint does, on every rank's share of the split.
  if (dist_) {
    auto buffers = model_->buffers();
    dist_->broadcast(std::vector<torch::Tensor>(buffers.begin(), buffers.end()), "the BatchNorm statistics");
  }
  model_->eval();
  // The evaluation split in order, as batches of train.eval_batch samples (images or token windows).
  std::function<std::optional<data::Batch>()> next_eval;
  std::unique_ptr<data::EvalLoader> image_eval;
  std::unique_ptr<data::TokenEvalLoader> token_eval;
  if (tokens_) {
    data::TokenEvalOptions eo;
    eo.batch = cfg_.train.eval_batch;
    eo.context = cfg_.model.context;
    eo.rank = env_.rank;
    eo.world_size = env_.world_size;
    token_eval = std::make_unique<data::TokenEvalLoader>(test_tokens_, eo);
    next_eval = [&] { return token_eval->next(); };
  } else {
    data::EvalOptions eo;
    eo.batch = cfg_.train.eval_batch;
    eo.workers = cfg_.data.workers > 0 ? cfg_.data.workers : at::get_num_threads();
    eo.normalize = cfg_.data.normalize;
    eo.pin_memory = device_.is_cuda();
    eo.rank = env_.rank;
    eo.world_size = env_.world_size;
    image_eval = std::make_unique<data::EvalLoader>(test_images_, eo);
    next_eval = [&] { return image_eval->next(); };
  }
  torch::Tensor loss_sum = torch::zeros({}, torch::dtype(torch::kDouble).device(device_));
  torch::Tensor correct1 = torch::zeros({}, torch::dtype(torch::kLong).device(device_));
  torch::Tensor correct5 = torch::zeros({}, torch::dtype(torch::kLong).device(device_));
  int64_t targets = 0, batches = 0;
  telemetry_.set_phase("eval");
  while (auto b = next_eval()) {
    telemetry_.heartbeat();
    if (cfg_.train.eval_batches > 0 && batches++ >= cfg_.train.eval_batches) break;
    // Evaluation backs off on its own: an OOM halves the evaluation micro-batch and redoes that chunk,
    // without touching the training micro-batch.
    for (int64_t start = 0; start < b->size();) {
      int64_t n = std::min(eval_micro_batch_, b->size() - start);
      try {
        auto x = b->images.narrow(0, start, n).to(device_, /*non_blocking=*/true);
        if (cfg_.model.channels_last && x.dim() == 4) x = x.contiguous(at::MemoryFormat::ChannelsLast);
        auto y = b->labels.narrow(0, start, n).to(device_, true).reshape({-1});  // (N) classes or (N*T) tokens
        torch::Tensor logits;
        {
          AutocastGuard ag(device_.type(), amp_dtype_, cfg_.amp.enabled);
          logits = model_->forward(x);
        }
        logits = logits.to(torch::kFloat).reshape({y.size(0), -1});  // (N, classes) or (N*T, vocab)
        targets += y.size(0);
        loss_sum += torch::nn::functional::cross_entropy(
                        logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                        .to(torch::kDouble);
        auto top = std::get<1>(logits.topk(std::min<int64_t>(5, logits.size(1)), 1));  // (n, 5) class ids
        auto hit = top.eq(y.unsqueeze(1));
        correct1 += hit.narrow(1, 0, 1).sum();
        correct5 += hit.sum();
        start += n;
      } catch (const std::exception& e) {
        if (!is_oom_error(e) || eval_micro_batch_ == 1) throw;
        memory_->empty_cache();
        int64_t old = eval_micro_batch_;
        eval_micro_batch_ = std::max<int64_t>(1, eval_micro_batch_ / 2);
        spdlog::warn("evaluation: out of memory at micro-batch {}, retrying at {}", old, eval_micro_batch_);
        metrics_.event("eval_backoff", {{"step", step_}, {"old_micro_batch", old}, {"new_micro_batch", eval_micro_batch_},
                                        {"limit", limit_bytes_}, {"current_bytes", memory_->current_bytes()}});
      }
    }
  }
  model_->train();
  // Per sample for images, per token for language models; summed over ranks. A sync, once per evaluation.
  std::vector<double> totals{loss_sum.item<double>(), static_cast<double>(correct1.item<int64_t>()),
                             static_cast<double>(correct5.item<int64_t>()), static_cast<double>(targets)};
  if (dist_) totals = dist_->all_sum(totals, "the evaluation totals");
  r.samples = static_cast<int64_t>(totals[3]);
  r.loss = totals[0] / totals[3];
  r.top1 = totals[1] / totals[3];
  r.top5 = totals[2] / totals[3];
  return r;
}

// ---- logging ------------------------------------------------------------------------------------------

namespace {
// FNV-1a over the step's sample indices: two runs saw the same samples in a step iff these agree.
uint64_t indices_hash(const std::vector<int64_t>& indices) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t i : indices) {
    h ^= static_cast<uint64_t>(i);
    h *= 1099511628211ull;
  }
  return h;
}
}  // namespace

void TrainingRun::log_step(const StepResult& r, double step_time) {
  window_time_ += step_time + data_wait_s_;
  ++window_steps_;
  const double sps = cfg_.train.global_batch / (step_time + data_wait_s_);  // waiting for data counts
  nlohmann::json j = {{"step", step_},
                      {"epoch", static_cast<double>(step_) / steps_per_epoch_},
                      {"loss", r.loss},
                      {"lr", r.lr},
                      {"grad_norm", r.grad_norm},
                      {"samples_seen", samples_seen_},
                      {"micro_batch", r.micro_batch},
                      {"accum_steps", r.accum_steps},
                      {"samples_per_s", sps},
                      {"step_time_s", step_time},
                      {"data_wait_s", data_wait_s_},
                      {"mem_peak_bytes", memory_->peak_bytes()},
                      {"mem_start_bytes", r.mem_start_bytes},
                      {"mem_limit_bytes", limit_bytes_},
                      {"oom_retries", r.oom_retries},
                      {"batch_hash", batch_hash_},
                      {"updated", r.updated}};
  if (scaler_->is_enabled()) j["loss_scale"] = scaler_->get_scale();
  if (grad_sync_) {
    j["grad_buckets"] = grad_sync_->num_buckets();
    j["grad_buckets_in_backward"] = r.grad_buckets_in_backward;
  }
  if (tokens_) j["tokens_per_s"] = sps * cfg_.model.context;
  j["model_flops_per_s"] = 3.0 * flops_per_sample_ * sps;  // forward + backward (2x forward)
  metrics_.write(j);
  if (step_ % cfg_.log.every == 0 || step_ == total_steps_ || step_ == 1) {
    double window_sps = cfg_.train.global_batch * window_steps_ / window_time_;
    double eta = (total_steps_ - step_) * (window_time_ / window_steps_);
    spdlog::info("step {}/{} (epoch {:.2f}) loss {:.4f} lr {:.4g} | {:.1f} {}/s | mb {}x{} | mem peak {} | ETA {}",
                 step_, total_steps_, static_cast<double>(step_) / steps_per_epoch_, r.loss, r.lr,
                 tokens_ ? window_sps * cfg_.model.context : window_sps, tokens_ ? "tokens" : "samples",
                 r.micro_batch, r.accum_steps, format_bytes(memory_->peak_bytes()), format_duration(eta));
    window_time_ = 0;
    window_steps_ = 0;
  }
}

// ---- the loop -----------------------------------------------------------------------------------------

int TrainingRun::run() {
  setup();
  install_signal_handlers();
  bool resumed = resume();
  if (!resumed) {
    metrics_.event("start", {{"total_steps", total_steps_}, {"steps_per_epoch", steps_per_epoch_},
                             {"global_batch", cfg_.train.global_batch}, {"device", device_.str()},
                             {"torch", compat::torch_version()}, {"limit", limit_bytes_}});
  }
  if (resumed && step_ >= total_steps_) {
    spdlog::info("the run is complete: step {} of {} (raise train.steps or train.epochs to train on)", step_, total_steps_);
    return kExitOk;
  }
  spdlog::info("training {} steps ({} per epoch) at global batch {} on {}; memory limit {}", total_steps_,
               steps_per_epoch_, cfg_.train.global_batch, device_.str(),
               limit_bytes_ ? format_bytes(limit_bytes_) : "none");
  model_->train();
  // The configured policy (or the ladder's state restored from a checkpoint) applies from the first step.
  apply_activation_checkpointing();
  start_time_ = last_ckpt_time_ = std::chrono::steady_clock::now();
  telemetry_.set_memory(device_memory_of(*memory_));
  telemetry_.set_total_steps(total_steps_);
  telemetry_.set_ready(true);
  int exit_code = kExitOk;
  bool need_micro_batch_search = cfg_.train.micro_batch == -1 && !resumed;

  try {
    while (step_ < total_steps_) {
      poll_limits();
      if (step_ % 50 == 0) poll_threads();
      auto tw = std::chrono::steady_clock::now();
      data::Batch batch = loader_->next();
      data_wait_s_ = seconds_since(tw);
      if (need_micro_batch_search) {
        find_auto_micro_batch(batch);
        need_micro_batch_search = false;
      }
      auto t0 = std::chrono::steady_clock::now();
      StepResult r = train_step(batch);
      batch_hash_ = indices_hash(batch.indices);
      double dt = seconds_since(t0);
      ++step_;
      samples_seen_ += cfg_.train.global_batch;
      // Where the next step's samples start: what a checkpoint records (in samples, not batches, so a
      // resume may use any micro-batch).
      epoch_ = loader_->state().epoch;
      position_ = loader_->state().position;
      log_step(r, dt);
      telemetry_.set_memory(device_memory_of(*memory_));
      if (step_ % cfg_.log.every == 0) {
        ResourceSample rs = resources_->sample(memory_.get());
        telemetry_.set_gpu_utilization(rs.gpu_percent);
        spdlog::info("{}", ResourceMonitor::format(rs));
      }
      if (take_memory_report_request() || telemetry_.take_memory_report_request()) {
        MemoryReport rep = memory_report_->write(step_, *memory_, "request");
        spdlog::info("{}\n{}", rep.path.empty() ? rep.write_error : "memory report: " + rep.path, rep.text);
      }

      bool epoch_end = step_ % steps_per_epoch_ == 0;
      bool eval_now = cfg_.train.eval_every > 0 ? step_ % cfg_.train.eval_every == 0 : epoch_end;
      if (eval_now && step_ < total_steps_ && has_eval()) {
        auto t = std::chrono::steady_clock::now();
        auto e = evaluate();
        spdlog::info("eval at step {}: loss {:.4f} top1 {:.2f}% top5 {:.2f}% ({:.1f}s)", step_, e.loss, 100 * e.top1,
                     100 * e.top5, seconds_since(t));
        metrics_.event("eval", {{"step", step_}, {"loss", e.loss}, {"top1", e.top1}, {"top5", e.top5},
                                {"samples", e.samples}, {"seconds", seconds_since(t)}});
        last_eval_ = e;
      }
      bool ckpt_now = (cfg_.checkpoint.every_steps > 0 && step_ % cfg_.checkpoint.every_steps == 0) ||
                      (cfg_.checkpoint.every_seconds > 0 && seconds_since(last_ckpt_time_) >= cfg_.checkpoint.every_seconds);
      bool ckpt_request = take_checkpoint_request();
      bool stop = stop_requested();
      int stop_sig = stop ? stop_signal() : 0;
      if (dist_) {
        // Saving is collective and a stop must happen at the same step everywhere: a signal or a timer
        // seen by any rank counts for all (torchrun forwards SIGTERM to every rank, not at the same instant).
        auto a = dist_->all_max({ckpt_now ? 1.0 : 0.0, ckpt_request ? 1.0 : 0.0, static_cast<double>(stop_sig)},
                                "the checkpoint and stop agreement");
        ckpt_now = a[0] > 0;
        ckpt_request = a[1] > 0;
        stop_sig = static_cast<int>(a[2]);
        stop = stop_sig != 0;
      }
      if (ckpt_request) {
        save_checkpoint("SIGUSR1", false);
        ckpt_now = false;
      }
      if (stop) {
        // SIGTERM/SIGINT: the step in progress was finished; save and exit with 128 + signal so a
        // scheduler restarts the job, which then resumes from this checkpoint.
        const std::string sig = stop_sig == SIGINT ? "SIGINT" : "SIGTERM";
        spdlog::warn("stop requested by {}: saving a checkpoint at step {} and exiting", sig, step_);
        telemetry_.set_stopping();
        save_checkpoint(sig, true);
        metrics_.event("stop", {{"step", step_}, {"signal", sig}});
        return exit_code_for_signal(stop_sig);
      }
      if (ckpt_now && step_ < total_steps_) save_checkpoint("periodic", false);
    }
  } catch (const OomGaveUp& e) {
    spdlog::error("{}", e.what());
    metrics_.event("oom_gave_up", {{"step", step_}, {"message", e.what()}, {"mem_peak_bytes", memory_->peak_bytes()}});
    // The cap stays in force: the checkpoint's own buffers are small next to a step's activations.
    save_checkpoint("oom_gave_up", true);
    return kExitOomGaveUp;
  } catch (const std::exception& e) {
    // Setup and resume errors (bad input) propagate; a failure while training is an error of the run.
    spdlog::error("training stopped at step {}: {}", step_, e.what());
    metrics_.event("error", {{"step", step_}, {"message", e.what()}});
    return kExitError;
  }

  auto e = evaluate();
  if (has_eval()) {
    spdlog::info("final eval at step {}: loss {:.4f} top1 {:.2f}% top5 {:.2f}%", step_, e.loss, 100 * e.top1, 100 * e.top5);
    metrics_.event("eval", {{"step", step_}, {"loss", e.loss}, {"top1", e.top1}, {"top5", e.top5},
                            {"samples", e.samples}, {"final", true}});
  }
  save_checkpoint("final", true);
  double total = seconds_since(start_time_);
  metrics_.event("end", {{"step", step_}, {"seconds", total}, {"samples_seen", samples_seen_}});
  spdlog::info("done: {} steps in {}", step_, format_duration(total));
  return exit_code;
}

std::string export_weights(const std::string& run_dir, const std::string& checkpoint, const std::string& out) {
  std::optional<LoadedCheckpoint> ck;
  if (!checkpoint.empty()) ck = CheckpointStore::load(checkpoint);
  else ck = CheckpointStore(run_dir, 0).load_latest();
  if (!ck) throw std::runtime_error(run_dir + ": no checkpoint to export");
  // model.pt is already a Python-compatible state dict; it is written through a temporary file so a
  // failed export never leaves a truncated file under the final name.
  const std::string tmp = out + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    const std::string& bytes = ck->file("model.pt");
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!f.flush()) throw std::runtime_error(out + ": cannot write the exported weights");
  }
  fs::rename(tmp, out);
  return ck->path;
}

int train(const Config& cfg, const RunOptions& opts) {
  TrainingRun run(cfg, opts);
  return run.run();
}

}  // namespace trainer
