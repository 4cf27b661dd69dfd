// The state of one training run. Its parts, each in a file named after it:
//
//   run.cpp        the loop: it only sequences (fetch -> poll -> step -> record -> evaluate -> agree on
//                  save/stop), and how the run ends
//   setup.cpp      setup(): the run folder, logging, memory, data, the model, the step, in that order
//   input_pipeline.*  InputPipeline, the run's input: the training source and the test split (images or
//                  tokens, data/samples/source.h), the batch's way to the device and the fetch-ahead
//   auto_batch.cpp train.micro_batch: auto before the first step: the start, the checkpointing, the
//                  findings kept across a restart (the search itself is MicroBatchSearcher, trainer/step/search.h)
//   record.cpp     what each step writes: metrics.jsonl, the progress line, telemetry, memory reports
//   limits.cpp     poll(): the memory cap (control.yaml, LimitFollower: limit_follower.*) agreed over
//                  ranks, and the CPU threads
//   resume.cpp     what a checkpoint holds (serialize_checkpoint) and reading it back (resume)
//   saver.*        Saver: when the run saves, and what it does when a save fails (retries, exit 4)
//   sampling.cpp   train.sample_every: a short text sample on rank 0 (trainer/numerics/generate.h), to
//                  train.log, metrics.jsonl and TensorBoard
//   from_config.*  what the config builds, shared with `trainer bench` and the commands
//
// Beneath it, trainer/step/: one optimizer step (Step), its OOM recovery and its snapshot, and the
// evaluation of a split with its own OOM backoff (shared with `trainer eval`).
//
// Internal to trainer/: users call train() (train.h).
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "common/log.h"
#include "common/run_lock.h"
#include "data/samples/source.h"
#include "models/model.h"
#include "trainer/checkpoint/store.h"
#include "trainer/config/config.h"
#include "trainer/dist/dist.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/curve.h"
#include "trainer/memory/oom.h"
#include "trainer/memory/report.h"
#include "trainer/memory/resources.h"
#include "trainer/numerics/amp.h"
#include "trainer/numerics/ema.h"
#include "trainer/numerics/optim.h"
#include "trainer/observe/http.h"
#include "trainer/observe/telemetry.h"
#include "trainer/observe/tensorboard.h"
#include "trainer/run/input_pipeline.h"
#include "trainer/run/limit_follower.h"
#include "trainer/run/saver.h"
#include "trainer/run/train.h"
#include "trainer/step/evaluate.h"
#include "trainer/step/search.h"
#include "trainer/step/step.h"
#include "trainer/track/tracker.h"

namespace data {
class Tokenizer;  // data/text/tokenizer.h
}  // namespace data

namespace trainer {

class SearchFindings;  // trainer/step/search_findings.h

class TrainingRun {
 public:
  TrainingRun(const Config& cfg, const RunOptions& opts);
  ~TrainingRun();
  /// Trains to the end (or a stop) and returns the process exit code (common/signals.h).
  int run();

 private:
  int run_stages();  // run() without telling the tracker how it ended
  // setup.cpp
  void setup();
  void setup_distributed();
  void setup_run_folder();
  void take_run_folder();  // the lock: rank 0 takes it, or every rank gives up together
  void setup_observers();
  void setup_tracking();
  /// On a resume: the step lines and evaluations of metrics.jsonl up to step `upto` handed to the tracker
  /// again. A killed process may have trained and checkpointed steps whose metrics were still queued for
  /// MLflow (its tracker sends a batch a second); the tracker sends only what MLflow lacks (StepFilter).
  void backfill_tracker(int64_t upto);  // log.mlflow: the MLflow tracker (rank 0)
  void setup_memory();
  void setup_data();        // the training source and the test split (InputPipeline), the steps they make
  void setup_token_data();  // a language model's token stream
  void setup_image_data();  // images: HDF5, packed or a folder (decoded), or synthetic
  int64_t steps_of_epochs(double epochs, const char* key) const;  // after setup_data(): steps per epoch known
  void check_test_split() const;
  void setup_model();
  void setup_step();
  void setup_ema();  // train.ema_decay: the average, after setup_model() (resident before the search and step 1)
  void load_memory_curve();

  // run.cpp
  void start(bool resumed);
  /// Step::run's while_device_runs under data.fetch_ahead: InputPipeline::fetch_ahead, not after the last
  /// step (the source would move past what the final checkpoint records), nor when a stop is on its way.
  std::function<void()> fetch_ahead_hook();
  void maybe_evaluate();
  std::string evaluate_and_log(bool final);  // "" or why the evaluation failed (one line)
  void update_ema();  // train.ema_decay: after each optimizer step (ModelEma::update decides if it is due)
  std::optional<int> agree_on_save_and_stop();
  int give_up(const OomGaveUp& e);
  int finish();

  // auto_batch.cpp
  // train.micro_batch: auto. `stopped` when a stop (SIGTERM, SIGINT) came during the search: its findings
  // are in auto_search.json and the run exits (stop_during_search).
  MicroBatchSearch auto_micro_batch(const data::Batch& batch);
  // memory.activation_checkpointing: sets co.checkpointing; returns where the choice came from.
  std::string choose_checkpointing(MicroBatchOptions& co) const;
  MicroBatchSearch search_once(const data::Batch& batch, const MicroBatchOptions& co, SearchFindings& findings);
  void log_auto_micro_batch(const MicroBatchSearch& found, bool checkpointing, const std::string& from,
                            double search_s);  // the line and the auto_micro_batch event
  int stop_during_search(const MicroBatchSearch& found);
  // What a probe's outcome depends on, for auto_search.json: the config less how long the run is, what it
  // logs and when it saves; the agreed limit, the device, the rank, the checkpointing and the start.
  nlohmann::json search_conditions(bool checkpointing) const;
  void pretune(const data::Batch& batch);  // memory.cudnn_policy pretune, once before the first step
  int64_t curve_start() const;  // where the auto search starts: the curve's prediction (0 = no curve)

  // record.cpp
  void record(const StepResult& r, const data::Batch& batch, double step_time);
  void count_nonfinite(const StepResult& r);  // divergence: 5 in a row without a GradScaler
  nlohmann::json step_metrics(const StepResult& r, double step_time, double sps) const;  // metrics.jsonl's line
  void log_progress(const StepResult& r);  // the step line of train.log, over the window since the last
  void observe_resources();                // telemetry, the resources line, a requested memory report

  // limits.cpp
  void poll(bool batch_failed);  // the memory limit every step, the threads every 50 steps
  void poll_memory_limit(bool batch_failed);  // OomGaveUp on every rank if any rank's batch did not fit
  bool agree_on_limit(bool batch_failed);     // whether any rank's batch did not fit
  void poll_threads();

  EvalResult evaluate();  // the test split (evaluate.h)
  EvalResult evaluate_ema();  // the same with the averaged weights swapped in (train.ema_decay)

  // resume.cpp
  bool resume();
  std::optional<LoadedCheckpoint> find_checkpoint() const;
  std::string checkpoint_problem(const LoadedCheckpoint& ck) const;  // "" when this run can resume from it
  void check_same_experiment(const LoadedCheckpoint& ck) const;
  void restore_tensors(const LoadedCheckpoint& ck);
  void restore_ema(const LoadedCheckpoint& ck);  // ema.pt, or the average started from the restored weights
  void restore_loop(const nlohmann::json& state);
  std::optional<CheckpointFiles> serialize_checkpoint();  // collective; the files on rank 0 only
  nlohmann::json state_json() const;

  // sampling.cpp
  void setup_sampling();  // after setup_model(): the tokenizer and the prompt (rank 0, sample_every > 0)
  void maybe_sample();    // every train.sample_every steps; a failure is a warning and training goes on

  /// The checkpoint the run ends with (SIGTERM/SIGINT, final, OOM give-up), retried; agreed by all ranks.
  bool save_before_exit(const std::string& reason) {
    return saver_->save_before_exit(step_, reason, [this] { return serialize_checkpoint(); });
  }

  int64_t rank_batch() const { return cfg_.train.global_batch / env_.world_size; }  ///< samples per step per rank
  bool main_rank() const { return env_.rank == 0; }
  bool has_eval() const { return input_.eval() != nullptr; }
  bool tokens() const { return input_.source().tokens(); }  ///< a language model on a token stream

  Config cfg_;
  RunOptions opts_;
  // The run folder's lock (rank 0 only; common/run_lock.h). Declared first of the run's parts so that it
  // is released last, after the background saves and the logs are done with the folder.
  std::shared_ptr<RunFolderLock> run_lock_;
  torch::Device device_{torch::kCPU};
  ForwardOptions forward_;  // device, channels_last, autocast: training and evaluation alike

  // Data parallel (null in a single process). The rank-0 process writes the run folder's shared files.
  DistEnv env_;
  std::unique_ptr<Distributed> dist_;
  std::unique_ptr<GradientSync> grad_sync_;
  std::string rank_dir_;  // where this rank's own files go: the run folder (rank 0) or <run>/rank<r>

  double flops_per_sample_ = 0;        // forward
  int64_t vocab_ = 0;                  // a language model's vocabulary (wte may have more rows: model.vocab_multiple)
  models::Model model_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<ModelEma> ema_;  // train.ema_decay > 0: the averaged weights, on device_
  std::unique_ptr<GradScaler> scaler_;
  std::unique_ptr<MemoryBackend> memory_;
  std::unique_ptr<Step> step_runner_;
  std::unique_ptr<ControlFile> control_;
  std::unique_ptr<Saver> saver_;  // the checkpoints: when, how, and what a failed write does (saver.h)
  MetricsLog metrics_;
  Telemetry telemetry_;  // before http_: the server reads it until destroyed
  std::unique_ptr<HttpServer> http_;
  std::unique_ptr<MemoryReporter> memory_report_;
  std::unique_ptr<ResourceMonitor> resources_;
  std::unique_ptr<TensorboardWriter> tensorboard_;
  std::unique_ptr<track::MlflowTracker> tracker_;  // log.mlflow, rank 0 only
  std::shared_ptr<const data::Tokenizer> sample_tokenizer_;  // train.sample_every: decodes the samples
  std::vector<int64_t> sample_prompt_;                         // its ids

  int64_t step_ = 0;          // optimizer steps completed
  int64_t start_step_ = 0;    // step_ when this process began: 0, or the resumed checkpoint's step
  int64_t total_steps_ = 0;
  int64_t steps_per_epoch_ = 0;
  int64_t warmup_steps_ = 0;
  int64_t samples_seen_ = 0;
  int64_t epoch_ = 0, position_ = 0;  // where the next global batch starts
  int64_t nonfinite_in_a_row_ = 0;
  std::unique_ptr<LimitFollower> limit_;  // memory.limit: this process's cap, followed (limit_follower.h)
  int64_t agreed_limit_ = 0;          // the lowest cap over all ranks (0 = none): what the ladder sees
  int64_t eval_micro_batch_ = 0;
  bool need_micro_batch_search_ = false;  // train.micro_batch: auto, before the first step
  bool need_pretune_ = true;              // memory.cudnn_policy pretune: once, before this process's first step
  bool cudnn_empty_cache_switch_ = false; // this LibTorch has the switch memory.cudnn_empty_cache sets
  std::optional<MemoryCurve> curve_;      // memory.curve, read when the auto search will run
  std::chrono::steady_clock::time_point start_time_;
  std::chrono::steady_clock::time_point model_built_;  // setup_model() done: step 1's since_model_built_s
  // The input (input_pipeline.h): the training source and the test split, the fetch-ahead, and what a
  // step records of its batch. Declared after memory_, so destroyed before it, with the batches it
  // counted (on the device under data.fetch_ahead).
  InputPipeline input_;
  uint64_t batch_hash_ = 0;           // hash of the last step's sample indices
  double window_time_ = 0;            // seconds of the steps since the last log line
  int64_t window_steps_ = 0;
};

}  // namespace trainer
