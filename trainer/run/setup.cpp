// TrainingRun::setup(): everything a run needs before its first step, in dependency order. Every check
// that can fail on bad input (the run folder, the device, the data) runs here, before anything trains.
#include <spdlog/spdlog.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <thread>

#include "common/clock.h"
#include "common/compat.h"
#include "common/versions.h"
#include "data/files/image_h5.h"
#include "data/files/token_h5.h"
#include "models/registry.h"
#include "models/summary.h"
#include "trainer/checkpoint/state_dict.h"
#include "trainer/run/from_config.h"
#include "trainer/run/run.h"
#include "trainer/track/build_info.h"
#include "trainer/track/mlflow_client.h"

namespace fs = std::filesystem;

namespace trainer {

void TrainingRun::setup() {
  setup_distributed();
  setup_run_folder();
  setup_observers();
  setup_memory();
  if (main_rank()) setup_tracking();  // after the GPU is named (its UUID is a tag)
  setup_data();
  setup_model();
  setup_ema();
  setup_sampling();
  setup_step();
}

void TrainingRun::setup_distributed() {
  // Data parallel: the rendezvous comes first (it needs no files), so that every rank has checked the
  // run folder before any rank writes to it.
  env_ = dist_env_from();
  device_ = resolve_device(cfg_.train.device, env_.distributed() ? std::optional<int64_t>(env_.local_rank) : std::nullopt);
  if (!env_.distributed()) return;
  if (cfg_.train.global_batch % env_.world_size != 0)
    throw ConfigError("train.global_batch: " + std::to_string(cfg_.train.global_batch) +
                      " is not divisible by the world size " + std::to_string(env_.world_size) +
                      " (every rank takes an equal slice of each step's samples)");
  dist_ = std::make_unique<Distributed>(env_, comm_backend(cfg_, device_), device_, cfg_.dist.timeout_s);
}

void TrainingRun::setup_run_folder() {
  rank_dir_ = main_rank() ? opts_.run_dir : (fs::path(opts_.run_dir) / ("rank" + std::to_string(env_.rank))).string();
  // One owner before anything is written: no other process's checkpoints, metrics or logs mix with ours.
  take_run_folder();
  // The run folder must be writable before anything is trained: failing after an hour is worse.
  std::error_code ec;
  // --no-resume starts fresh in an empty folder only (its lock file aside): nothing of an earlier run is
  // mixed in or overwritten.
  bool refused = false;
  if (opts_.no_resume && main_rank())
    for (const auto& e : fs::directory_iterator(opts_.run_dir, ec))
      if (e.path().filename() != kRunLockFile) refused = true;
  if (dist_ && dist_->all_max({refused ? 1.0 : 0.0}, "the run folder check")[0] > 0) refused = true;
  if (refused)
    throw std::runtime_error(opts_.run_dir + ": --no-resume needs an empty or new run folder, and this one is not "
                             "empty; use another --run-dir or remove it");
  fs::create_directories(rank_dir_, ec);
  if (ec) throw std::runtime_error(rank_dir_ + ": cannot create the run folder (" + ec.message() + ")");
  saver_ = std::make_unique<Saver>(
      cfg_.checkpoint,
      std::make_unique<CheckpointStore>(opts_.run_dir, static_cast<int>(cfg_.checkpoint.keep_last), cfg_.train.device),
      metrics_, dist_.get(), main_rank(), device_.str());
  if (main_rank()) saver_->store().check_writable();
  setup_logging(rank_dir_, mode_name(cfg_.log.level));
  metrics_.open((fs::path(rank_dir_) / "metrics.jsonl").string());
}

void TrainingRun::take_run_folder() {
  RunLockOptions lo;
  lo.config = opts_.config_file.empty() ? "built-in" : fs::path(opts_.config_file).filename().string();
  lo.command = "train";
  lo.wait_s = opts_.wait_for_run_dir_s;
  if (!dist_) {
    run_lock_ = RunFolderLock::acquire(opts_.run_dir, lo);
    return;
  }
  // Under torchrun rank 0 holds the folder for the job. Every try is one small all-reduce, so the other
  // ranks neither write before rank 0 has the folder nor time out in a collective while it waits; a
  // folder still held is refused on every rank, each with its own line.
  enum : int { kTaken = 0, kWaiting = 1, kRefused = 2 };
  const auto t0 = std::chrono::steady_clock::now();
  double next_report = 0;
  for (;;) {
    const double waited = seconds_since(t0);
    int state = kTaken;
    RunFolderHolder holder;
    if (main_rank()) {
      run_lock_ = RunFolderLock::try_acquire(opts_.run_dir, lo, &holder);
      state = run_lock_ ? kTaken : waited >= lo.wait_s ? kRefused : kWaiting;
    }
    state = static_cast<int>(dist_->all_max({static_cast<double>(state)}, "the run folder's lock")[0]);
    if (state == kTaken) return;
    if (state == kRefused) {
      run_lock_.reset();
      throw RunFolderBusy(RunFolderLock::busy_message(
          opts_.run_dir, RunFolderLock::read_holder(opts_.run_dir).value_or(RunFolderHolder{}), waited));
    }
    if (main_rank() && waited >= next_report) {
      spdlog::info("{}: waiting for {} to let go of the run folder ({:.0f} s of {:.0f} s)", opts_.run_dir,
                   holder.describe(), waited, lo.wait_s);
      next_report = waited + lo.report_every_s;
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(lo.poll_every_s));
  }
}

void TrainingRun::setup_observers() {
  if (cfg_.log.tensorboard && main_rank()) tensorboard_ = std::make_unique<TensorboardWriter>(opts_.run_dir);
  metrics_.set_observer([this](const nlohmann::json& j) {
    telemetry_.observe(j);
    if (tensorboard_) tensorboard_->observe(j);
    if (tracker_) tracker_->observe(j);
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
  if (!dist_) return;
  spdlog::info("distributed: rank {} of {} (local {} of {}), {} samples of each global batch of {}", env_.rank,
               env_.world_size, env_.local_rank, env_.local_world_size, rank_batch(), cfg_.train.global_batch);
  telemetry_.set_info("rank", std::to_string(env_.rank));
  telemetry_.set_info("world_size", std::to_string(env_.world_size));
}

void TrainingRun::setup_tracking() {
  std::string uri = cfg_.log.mlflow;
  if (uri == "off") return;
  const char* env_uri = std::getenv("MLFLOW_TRACKING_URI");
  const char* source = "log.mlflow";
  if (uri.empty() && env_uri != nullptr && *env_uri != 0) {
    uri = env_uri;
    source = "MLFLOW_TRACKING_URI";
  }
  if (uri.empty()) return;
  // A tracker that cannot be reached is a warning, never a reason to stop a job (docs/OPERATIONS.md).
  if (const std::string why = track::check_tracking_uri(uri); !why.empty()) {
    spdlog::warn("mlflow: {} {}; this run is not tracked", source, why);
    return;
  }
  track::TrackerOptions o;
  o.uri = uri;
  o.experiment = !cfg_.log.mlflow_experiment.empty() ? cfg_.log.mlflow_experiment
                 : opts_.config_file.empty()          ? "resnet20_fmnist"  // the built-in job's config
                                                      : fs::path(opts_.config_file).stem().string();
  o.run_dir = opts_.run_dir;
  o.run_name = fs::absolute(opts_.run_dir).lexically_normal().filename().string();
  if (o.run_name.empty()) o.run_name = fs::absolute(opts_.run_dir).lexically_normal().parent_path().filename().string();
  o.params = track::params_of_yaml(to_yaml(cfg_));
  o.tags = {{"mlflow.source.name", "trainer"},
            {"mlflow.source.type", "JOB"},
            {"mlflow.source.git.commit", track::build_commit()},
            {"trainer.version", TRAINER_VERSION},
            {"trainer.libtorch", compat::torch_version()},
            {"trainer.host", track::host_name()},
            {"trainer.device", device_.str()},
            {"trainer.model", cfg_.model.name},
            {"trainer.world_size", std::to_string(env_.world_size)},
            {"trainer.config", opts_.config_file.empty() ? "built-in" : opts_.config_file},
            {"trainer.run_dir", fs::absolute(opts_.run_dir).lexically_normal().string()}};
  if (const char* user = std::getenv("USER"); user != nullptr) o.tags["mlflow.user"] = user;
  if (const std::string v = cuda_runtime_version(); !v.empty()) o.tags["trainer.cuda"] = v;
  if (const std::string v = cudnn_version(); !v.empty()) o.tags["trainer.cudnn"] = v;
  const GpuIdentity& gpu = resources_->gpu();  // what the DCGM exporter's series are labelled with
  if (!gpu.uuid.empty()) o.tags["trainer.gpu_uuid"] = gpu.uuid;
  if (!gpu.mig_uuid.empty()) o.tags["trainer.mig_uuid"] = gpu.mig_uuid;
  tracker_ = std::make_unique<track::MlflowTracker>(std::move(o));
}

void TrainingRun::setup_memory() {
  forward_ = step_options(cfg_, device_).forward;
  validate_amp(cfg_.amp.enabled, cfg_.amp.dtype, loss_scaling(cfg_), device_.type());
  // Host threads follow the CPUs this process may use (affinity, container quota); the processes of one
  // node share its CPUs.
  const int threads = cpu_threads(cfg_, env_.local_world_size);
  apply_cpu_threads(threads);
  spdlog::info("cpu: {} threads ({} usable CPUs, {} process{} on this node)", threads, usable_cpus(),
               env_.local_world_size, env_.local_world_size == 1 ? "" : "es");
  if (cfg_.train.deterministic) at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  // cuDNN's benchmark flag is the step's to set, attempt by attempt (memory.cudnn_policy, Step::apply_cudnn);
  // off until then. How a timing runs is set once here.
  set_cudnn_benchmark(false);
  cudnn_empty_cache_switch_ = set_cudnn_tuning(cfg_.memory.cudnn_benchmark_limit, cfg_.memory.cudnn_empty_cache);

  // The cap is installed before the model exists so every tensor is counted. PhasePeakBackend measures
  // the per-phase peaks the memory reports list.
  memory_ = std::make_unique<PhasePeakBackend>(make_memory_backend(device_));
  resources_ = std::make_unique<ResourceMonitor>(device_.is_cuda() ? std::max<int>(0, device_.index()) : -1);
  telemetry_.set_gpu(resources_->gpu());  // UUID, GPU_I_ID: the labels of the DCGM exporter's series
  telemetry_.set_info("device", device_.str());
  telemetry_.set_info("model", cfg_.model.name);
  telemetry_.set_info("version", TRAINER_VERSION);
  limit_ = LimitFollower::make(cfg_, *memory_, device_.is_cuda());
  agreed_limit_ = limit_->install();
  control_ = std::make_unique<ControlFile>((fs::path(opts_.run_dir) / "control.yaml").string());
}

namespace {

// Checks the training and the test file (data/files/h5_check.h) side by side: each check is mostly the start
// of a fresh process (loading LibTorch), which takes longer than reading the file. The log says how
// long, so a slow start can be told apart from a slow check. An error is the training file's first;
// the other check still ends (or times out) before it propagates: no child is left behind.
void check_before_opening(const Config& cfg) {
  std::vector<std::string> paths = {cfg.data.train};
  if (!cfg.data.test.empty() && cfg.data.test != cfg.data.train) paths.push_back(cfg.data.test);
  std::vector<std::future<data::H5CheckResult>> checks;
  for (const auto& path : paths)
    checks.push_back(std::async(std::launch::async, [&cfg, path] { return check_data_file(cfg, path, cfg.data.in_memory); }));
  for (size_t i = 0; i < paths.size(); ++i) log_data_check(paths[i], checks[i].get());
}

}  // namespace

void TrainingRun::setup_data() {
  // Images (HDF5 or synthetic) or a token stream, behind one training source and one evaluation source
  // (data/samples/source.h).
  if (token_job(cfg_)) setup_token_data();
  else setup_image_data();
  check_test_split();
  steps_per_epoch_ = input_.source().steps_per_epoch();
  total_steps_ = cfg_.train.steps > 0 ? cfg_.train.steps
                                      : std::max<int64_t>(1, steps_of_epochs(cfg_.train.epochs, "train.epochs"));
  warmup_steps_ = cfg_.schedule.warmup_steps > 0 ? cfg_.schedule.warmup_steps
                                                 : steps_of_epochs(cfg_.schedule.warmup_epochs, "schedule.warmup_epochs");
}

void TrainingRun::setup_token_data() {
  std::shared_ptr<data::TokenSource> train, test;
  if (cfg_.data.kind == DataKind::kSynthetic) {
    train = synthetic_tokens(cfg_);
  } else {
    check_before_opening(cfg_);
    train = std::make_shared<data::TokenDataset>(cfg_.data.train, cfg_.data.in_memory);
    if (!cfg_.data.test.empty()) test = std::make_shared<data::TokenDataset>(cfg_.data.test, cfg_.data.in_memory);
  }
  data::TokenLoaderOptions to;
  to.global_batch = cfg_.train.global_batch;
  to.context = cfg_.model.context;
  to.seed = cfg_.seed;
  to.rank = env_.rank;
  to.world_size = env_.world_size;
  to.pin_memory = device_.is_cuda();
  input_.set_sources(std::make_unique<data::TokenTrainingSource>(train, to),
                     test ? std::make_unique<data::TokenEvalSource>(test) : nullptr);
}

void TrainingRun::setup_image_data() {
  const int64_t workers = cfg_.data.workers > 0 ? cfg_.data.workers : cpu_threads(cfg_, env_.local_world_size);
  std::shared_ptr<data::ImageDataset> train, test;
  if (cfg_.data.kind == DataKind::kSynthetic) {
    train = std::make_shared<data::SyntheticImageDataset>(cfg_.data.synthetic_size, cfg_.data.shape[0],
                                                          cfg_.data.shape[1], cfg_.data.shape[2],
                                                          cfg_.model.num_classes, cfg_.seed);
  } else if (encoded_image_job(cfg_)) {
    // Decoded in the loader's workers with the train transform; the test split with the eval transform
    // and the training split's mean/std. Batches are uint8 NHWC; forward_logits normalizes on the device.
    train = encoded_image_dataset(cfg_, cfg_.data.train, /*train=*/true, nullptr, static_cast<int>(workers));
    if (!cfg_.data.test.empty())
      test = encoded_image_dataset(cfg_, cfg_.data.test, /*train=*/false, &train->meta(), static_cast<int>(workers));
    const auto& m = train->meta();
    spdlog::info("data: {} {} with {} samples, {} classes, mean [{:.4f}, {:.4f}, {:.4f}], std [{:.4f}, {:.4f}, {:.4f}]",
                 mode_name(cfg_.data.kind), cfg_.data.train, train->size(), m.num_classes, m.mean[0], m.mean[1], m.mean[2],
                 m.std[0], m.std[1], m.std[2]);
  } else {
    check_before_opening(cfg_);
    train = std::make_shared<data::ImageH5Dataset>(cfg_.data.train, cfg_.data.in_memory);
    if (!cfg_.data.test.empty()) test = std::make_shared<data::ImageH5Dataset>(cfg_.data.test, cfg_.data.in_memory);
  }
  if (train->num_classes() > cfg_.model.num_classes)
    throw ConfigError("model.num_classes: " + std::to_string(cfg_.model.num_classes) + ", but " + cfg_.data.train +
                      " has " + std::to_string(train->num_classes()) + " classes");
  if (train->size() < cfg_.train.global_batch)
    throw ConfigError("train.global_batch: " + std::to_string(cfg_.train.global_batch) + " is larger than the " +
                      std::to_string(train->size()) + " samples of the training split");
  data::LoaderOptions lo = image_loader_options(cfg_, workers);
  lo.rank = env_.rank;
  lo.world_size = env_.world_size;
  lo.pin_memory = device_.is_cuda();
  lo.uint8_batches = uint8_image_batches(cfg_, device_);
  // uint8 batches are normalized on the device with the training split's mean/std: for stored pixels the
  // very values the loader's float table takes (meta()). Float batches pass through as they are.
  if (encoded_image_job(cfg_) || lo.uint8_batches) set_input_normalization(forward_, train->meta(), cfg_.data.normalize, device_);
  input_.set_sources(std::make_unique<data::ImageTrainingSource>(train, lo),
                     test ? std::make_unique<data::ImageEvalSource>(test) : nullptr);
}

int64_t TrainingRun::steps_of_epochs(double epochs, const char* key) const {
  // llround of a product past int64's range is unspecified (here: the run trained 1 step of 1e300 epochs).
  const double steps = epochs * static_cast<double>(steps_per_epoch_);
  if (!(steps < 4.6e18)) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", epochs);
    throw ConfigError(std::string(key) + ": " + text + " epochs of " + std::to_string(steps_per_epoch_) +
                      " steps do not fit in a step counter (2^62); ask for fewer");
  }
  return std::llround(steps);
}

void TrainingRun::check_test_split() const {
  // The evaluation runs at the end (and between epochs): a split the model cannot take must fail here,
  // before anything trains, not after.
  auto shape_str = [](const std::vector<int64_t>& v) {
    std::string s;
    for (int64_t d : v) s += (s.empty() ? "" : ", ") + std::to_string(d);
    return "[" + s + "]";
  };
  const std::vector<int64_t> sample_shape = input_.source().sample_shape();
  if (const auto* images = dynamic_cast<const data::ImageEvalSource*>(input_.eval())) {
    const data::ImageDataset& test = *images->dataset();
    if (test.num_classes() > cfg_.model.num_classes)
      throw ConfigError("model.num_classes: " + std::to_string(cfg_.model.num_classes) + ", but " + cfg_.data.test +
                        " (data.test) has " + std::to_string(test.num_classes()) + " classes");
    const auto sh = test.sample_shape();
    const std::vector<int64_t> test_shape(sh.begin(), sh.end());
    std::vector<int64_t> expected = sample_shape;  // decoded images: evaluated at data.eval_size when set
    if (encoded_image_job(cfg_) && cfg_.data.eval_size > 0) expected = {3, cfg_.data.eval_size, cfg_.data.eval_size};
    if (test_shape != expected)
      throw ConfigError("data.test: " + cfg_.data.test + " holds samples of shape " + shape_str(test_shape) +
                        ", the training split " + shape_str(sample_shape));
  }
  if (const auto* tokens = dynamic_cast<const data::TokenEvalSource*>(input_.eval())) {
    const data::TokenSource& test = *tokens->dataset();
    // The model's vocabulary: model.vocab_size when set (at least the training file's), else the file's.
    const int64_t vocab = vocab_size(cfg_);
    if (test.vocab_size() > vocab)
      throw ConfigError("data.test: " + cfg_.data.test + " has a vocabulary of " +
                        std::to_string(test.vocab_size()) + " tokens, the model " + std::to_string(vocab));
    if (test.size() < cfg_.model.context + 1)
      throw ConfigError("data.test: " + cfg_.data.test + " has " + std::to_string(test.size()) +
                        " tokens, fewer than model.context + 1 = " + std::to_string(cfg_.model.context + 1));
  }
}

void TrainingRun::setup_model() {
  torch::manual_seed(cfg_.seed);
  const std::vector<int64_t> sample_shape = input_.source().sample_shape();
  vocab_ = tokens() ? vocab_size(cfg_) : 0;
  model_ = build_model(cfg_, sample_shape, vocab_);
  if (!cfg_.model.init_from.empty()) load_init_weights(*model_, cfg_, vocab_);
  model_->to(device_);
  if (cfg_.model.channels_last && !tokens()) models::to_channels_last(*model_);
  optimizer_ = std::make_unique<Optimizer>(param_slots(*model_, cfg_.optim.decay_norm_and_bias), cfg_.optim);
  flops_per_sample_ = model_->forward_flops(sample_shape);
  spdlog::info("model: {} with {} parameters, {:.3f} GFLOPs per sample forward", cfg_.model.name,
               models::count_parameters(*model_), flops_per_sample_ / 1e9);
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
  so.enabled(loss_scaling(cfg_));
  so.init_scale(cfg_.amp.init_scale).growth_factor(cfg_.amp.growth_factor).backoff_factor(cfg_.amp.backoff_factor)
      .growth_interval(cfg_.amp.growth_interval);
  scaler_ = std::make_unique<GradScaler>(so);
  model_built_ = std::chrono::steady_clock::now();
}

void TrainingRun::setup_ema() {
  if (cfg_.train.ema_decay == 0) return;
  // Now, before the micro-batch search and the first step: the copy is resident device memory that the
  // ladder's decisions must see. Under data parallel every rank starts from the broadcast weights and
  // keeps its own average of identical weights (rank 0's is saved).
  EmaOptions o;
  o.decay = cfg_.train.ema_decay;
  o.warmup = cfg_.train.ema_warmup;
  o.every = cfg_.train.ema_every;
  ema_ = std::make_unique<ModelEma>(*model_, o);
  spdlog::info("ema: decay {}{}, updated every {} step(s); {} on {}", o.decay, o.warmup ? " with warmup" : "", o.every,
               format_bytes(ema_->bytes()), device_.str());
}

void TrainingRun::setup_step() {
  // Again, now that the data and the model exist: an in-memory dataset, the libraries' first use and
  // the loader's threads are memory the cap does not count, and the container does.
  if (limit_->spec() == "auto") limit_->install();
  agree_on_limit(false);
  StepParts parts;
  parts.model = model_;
  parts.optimizer = optimizer_.get();
  parts.scaler = scaler_.get();
  parts.memory = memory_.get();
  parts.reporter = memory_report_.get();
  parts.metrics = &metrics_;
  parts.dist = dist_.get();
  parts.grad_sync = grad_sync_.get();
  StepOptions step_opts = step_options(cfg_, device_);
  step_opts.forward = forward_;  // with the input statistics setup_data() set for uint8 images
  try {
    step_runner_ = std::make_unique<Step>(parts, step_opts,
                                          make_controller(micro_batch_options(cfg_, rank_batch()), agreed_limit_));
  } catch (const std::invalid_argument& e) {
    // train.cuda_graph: on where the job cannot capture (a CPU device, data parallel, another optimizer)
    if (std::string(e.what()).rfind("train.cuda_graph", 0) == 0) throw ConfigError(e.what());
    throw;
  }
  if (!step_runner_->graph_policy().enabled() && cfg_.train.cuda_graph != Switch::kOff)
    spdlog::debug("train.cuda_graph auto: eager steps ({})", step_runner_->graph_policy().disabled_reason());
  // The input path: batches to the device, fetched ahead under data.fetch_ahead (input_pipeline.h).
  input_.set_staging(device_, fetches_ahead(cfg_, device_));
  eval_micro_batch_ = cfg_.train.eval_batch;
  need_micro_batch_search_ = cfg_.train.micro_batch == -1;
  if (need_micro_batch_search_ && agreed_limit_ == 0)
    spdlog::warn("train.micro_batch auto with no memory limit (memory.limit: {}): nothing bounds the search, which "
                 "takes the whole batch, and the kernel may kill the run; set memory.limit to auto or a size",
                 limit_->spec().empty() ? "none" : limit_->spec());
  if (need_micro_batch_search_ && !cfg_.memory.curve.empty()) load_memory_curve();
}

void TrainingRun::load_memory_curve() {
  // A curve of another job would only start the search far off (the answer is the search's either way),
  // but it is almost certainly a wrong path: say so rather than run slowly.
  MemoryCurve c = read_memory_curve(cfg_.memory.curve);
  auto describe = [](const std::string& model, const std::vector<int64_t>& shape, const std::string& precision) {
    std::string s = model + " on ";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? "x" : "") + std::to_string(shape[i]);
    return s + " in " + precision;
  };
  const std::string job = describe(cfg_.model.name, input_.source().sample_shape(), precision_of(cfg_));
  const std::string measured = describe(c.model, c.sample_shape, c.precision);
  if (job != measured)
    throw ConfigError("memory.curve: " + c.path + " was measured for " + measured + ", and this job is " + job +
                      "; measure this job with trainer bench --memory-curve");
  curve_ = std::move(c);
}

}  // namespace trainer
