// TrainingRun::setup(): everything a run needs before its first step, in dependency order. Every check
// that can fail on bad input (the run folder, the device, the data) runs here, before anything trains.
#include <spdlog/spdlog.h>

#include <filesystem>
#include <future>
#include <thread>

#include "common/clock.h"
#include "data/files/image_h5.h"
#include "data/files/token_h5.h"
#include "trainer/checkpoint/state_dict.h"
#include "trainer/run/from_config.h"
#include "trainer/run/run.h"

namespace fs = std::filesystem;

namespace trainer {

void TrainingRun::setup() {
  setup_distributed();
  setup_run_folder();
  trackers_.setup_observers(ranks_);
  setup_memory();
  choose_memory_state();  // may store the moments in fewer bytes: before the config is recorded and tracked
  if (main_rank()) trackers_.setup_tracking(trained_.device(), ranks_);  // after the GPU is named (its UUID is a tag)
  setup_data();
  setup_model();
  trained_.setup_ema();
  sampler_.setup(trained_.model(), input_.source(), trained_.vocab(), main_rank());
  setup_step();
}

void TrainingRun::setup_distributed() {
  // Data parallel: the rendezvous comes first (it needs no files), so that every rank has checked the
  // run folder before any rank writes to it.
  ranks_.read_env();
  const DistEnv& env = ranks_.env();
  trained_.set_device(
      resolve_device(cfg_.train.device, env.distributed() ? std::optional<int64_t>(env.local_rank) : std::nullopt));
  ranks_.connect(trained_.device());
  // Every rank refuses alike, before anything is broadcast (Gloo's collectives take no bfloat16 in 1.13).
  if (ranks_.dist() && cfg_.model.param_dtype == ParamDtype::kBfloat16)
    throw ConfigError("config: key 'model.param_dtype': bfloat16 weights train in one process for now (data "
                      "parallel broadcasts and all-reduces float32); use float32 under torchrun");
}

void TrainingRun::setup_run_folder() {
  ranks_.set_rank_dir(opts_.run_dir);
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
  if (ranks_.dist() && ranks_.dist()->all_max({refused ? 1.0 : 0.0}, "the run folder check")[0] > 0) refused = true;
  if (refused)
    throw std::runtime_error(opts_.run_dir + ": --no-resume needs an empty or new run folder, and this one is not "
                             "empty; use another --run-dir or remove it");
  fs::create_directories(ranks_.rank_dir(), ec);
  if (ec) throw std::runtime_error(ranks_.rank_dir() + ": cannot create the run folder (" + ec.message() + ")");
  saver_ = std::make_unique<Saver>(
      cfg_.checkpoint,
      std::make_unique<CheckpointStore>(opts_.run_dir, static_cast<int>(cfg_.checkpoint.keep_last), cfg_.train.device),
      trackers_.metrics(), ranks_.dist(), main_rank(), trained_.device().str());
  if (main_rank()) saver_->store().check_writable();
  setup_logging(ranks_.rank_dir(), mode_name(cfg_.log.level));
  trackers_.metrics().open((fs::path(ranks_.rank_dir()) / "metrics.jsonl").string());
}

void TrainingRun::take_run_folder() {
  RunLockOptions lo;
  lo.config = opts_.config_file.empty() ? "built-in" : fs::path(opts_.config_file).filename().string();
  lo.command = "train";
  lo.wait_s = opts_.wait_for_run_dir_s;
  if (!ranks_.dist()) {
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
    state = static_cast<int>(ranks_.dist()->all_max({static_cast<double>(state)}, "the run folder's lock")[0]);
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

void TrainingRun::setup_memory() {
  const torch::Device& device = trained_.device();
  trained_.forward() = step_options(cfg_, device).forward;
  validate_amp(cfg_.amp.enabled, cfg_.amp.dtype, loss_scaling(cfg_), device.type());
  // Host threads follow the CPUs this process may use (affinity, container quota); the processes of one
  // node share its CPUs.
  const int64_t local_world_size = ranks_.env().local_world_size;
  const int threads = cpu_threads(cfg_, local_world_size);
  apply_cpu_threads(threads);
  spdlog::info("cpu: {} threads ({} usable CPUs, {} process{} on this node)", threads, usable_cpus(), local_world_size,
               local_world_size == 1 ? "" : "es");
  if (cfg_.train.deterministic) at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  memory_.tune_cudnn();
  memory_.make_backend(device);
  trackers_.setup_resources(device);
  memory_.install_limit(opts_.run_dir, device.is_cuda());
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
  progress_.plan(cfg_, input_.source().steps_per_epoch());
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
  to.rank = ranks_.env().rank;
  to.world_size = ranks_.env().world_size;
  to.pin_memory = trained_.device().is_cuda();
  input_.set_sources(std::make_unique<data::TokenTrainingSource>(train, to),
                     test ? std::make_unique<data::TokenEvalSource>(test) : nullptr);
}

void TrainingRun::setup_image_data() {
  const int64_t workers = cfg_.data.workers > 0 ? cfg_.data.workers : cpu_threads(cfg_, ranks_.env().local_world_size);
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
  lo.rank = ranks_.env().rank;
  lo.world_size = ranks_.env().world_size;
  lo.pin_memory = trained_.device().is_cuda();
  lo.uint8_batches = uint8_image_batches(cfg_, trained_.device());
  // uint8 batches are normalized on the device with the training split's mean/std: for stored pixels the
  // very values the loader's float table takes (meta()). Float batches pass through as they are.
  if (encoded_image_job(cfg_) || lo.uint8_batches)
    set_input_normalization(trained_.forward(), train->meta(), cfg_.data.normalize, trained_.device());
  input_.set_sources(std::make_unique<data::ImageTrainingSource>(train, lo),
                     test ? std::make_unique<data::ImageEvalSource>(test) : nullptr);
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
  trained_.build(input_.source().sample_shape(), tokens());
  if (ranks_.dist()) ranks_.replicate(trained_.model(), trained_.optimizer());
  trained_.make_scaler();
  progress_.model_built();
}

void TrainingRun::setup_step() {
  // Again, now that the data and the model exist: an in-memory dataset, the libraries' first use and
  // the loader's threads are memory the cap does not count, and the container does.
  if (memory_.limit().spec() == "auto") memory_.limit().install();
  memory_.agree_on_limit(false, ranks_.dist());
  StepParts parts;
  parts.model = trained_.model();
  parts.optimizer = &trained_.optimizer();
  parts.scaler = &trained_.scaler();
  parts.memory = &memory_.backend();
  parts.reporter = trackers_.memory_report();
  parts.metrics = &trackers_.metrics();
  parts.dist = ranks_.dist();
  parts.grad_sync = ranks_.grad_sync();
  parts.shards = ranks_.shards();
  StepOptions step_opts = step_options(cfg_, trained_.device());
  step_opts.forward = trained_.forward();  // with the input statistics setup_data() set for uint8 images
  try {
    step_runner_ = std::make_unique<Step>(
        parts, step_opts, make_controller(micro_batch_options(cfg_, rank_batch()), memory_.agreed_limit()));
  } catch (const std::invalid_argument& e) {
    // train.cuda_graph: on where the job cannot capture (a CPU device, data parallel, another optimizer)
    if (std::string(e.what()).rfind("train.cuda_graph", 0) == 0) throw ConfigError(e.what());
    throw;
  }
  if (!step_runner_->graph_policy().enabled() && cfg_.train.cuda_graph != Switch::kOff)
    spdlog::debug("train.cuda_graph auto: eager steps ({})", step_runner_->graph_policy().disabled_reason());
  // The input path: batches to the device, fetched ahead under data.fetch_ahead (input_pipeline.h).
  input_.set_staging(trained_.device(), fetches_ahead(cfg_, trained_.device()));
  eval_micro_batch_ = cfg_.train.eval_batch;
  memory_.plan_micro_batch_search(input_.source().sample_shape());
}

}  // namespace trainer
