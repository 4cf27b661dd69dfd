// The state of one training run. It holds its parts, each a class with its own state in files named after
// it, and the files of its own stages:
//
//   run.cpp        the loop: it only sequences (fetch -> poll -> step -> record -> evaluate -> agree on
//                  save/stop), and how the run ends
//   setup.cpp      setup(): the run folder, logging, memory, data, the model, the step, in that order
//   ranks.*        Ranks: torchrun's environment, the process group and the gradient buckets, this rank's
//                  folder
//   trained_model.*  TrainedModel: the device, the model, its optimizer, the GradScaler, the averaged
//                  weights (train.ema_decay)
//   run_memory.*   RunMemory: the memory backend, the cap (LimitFollower: limit_follower.*) and the lowest
//                  over ranks, control.yaml, what the first step needs first (the auto search, pretuning)
//   trackers.*     Trackers: metrics.jsonl and its observers (telemetry, HTTP, TensorBoard, MLflow), the
//                  memory reports, the resource monitor
//   progress.*     Progress: the loop's counters (step, epoch, position, samples), its clocks and the
//                  progress line's window; the loop's part of state.json
//   input_pipeline.*  InputPipeline, the run's input: the training source and the test split (images or
//                  tokens, data/samples/source.h), the batch's way to the device and the fetch-ahead
//   auto_batch.cpp train.micro_batch: auto before the first step: the start, the checkpointing, the
//                  findings kept across a restart (the search itself is MicroBatchSearcher, trainer/step/search.h)
//   record.cpp     what each step writes: metrics.jsonl, the progress line, telemetry, memory reports
//   limits.cpp     poll(): the memory cap (control.yaml, RunMemory) agreed over ranks, and the CPU threads
//   resume.cpp     what a checkpoint holds (serialize_checkpoint) and reading it back (resume)
//   saver.*        Saver: when the run saves, and what it does when a save fails (retries, exit 4)
//   text_sampler.* TextSampler, train.sample_every: a short text sample on rank 0
//                  (trainer/numerics/generate.h), to train.log, metrics.jsonl and TensorBoard
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
#include "trainer/memory/oom.h"
#include "trainer/run/input_pipeline.h"
#include "trainer/run/progress.h"
#include "trainer/run/ranks.h"
#include "trainer/run/run_memory.h"
#include "trainer/run/saver.h"
#include "trainer/run/text_sampler.h"
#include "trainer/run/trackers.h"
#include "trainer/run/train.h"
#include "trainer/run/trained_model.h"
#include "trainer/step/evaluate.h"
#include "trainer/step/search.h"
#include "trainer/step/step.h"

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
  void setup_memory();
  void setup_data();        // the training source and the test split (InputPipeline), the steps they make
  void setup_token_data();  // a language model's token stream
  void setup_image_data();  // images: HDF5, packed or a folder (decoded), or synthetic
  void check_test_split() const;
  void setup_model();
  void setup_step();

  // memory_state.cpp
  void choose_memory_state();  // memory.state auto: the moments' dtype the plan fits with, before the model
  std::string what_would_fit() const;  // for the give-up: the settings the plan finds would fit ("" none)
  /// memory.state auto, after a give-up the plan did not foresee: the state one rung fewer bytes (moments
  /// float32 -> bfloat16 -> int8, then the weights in bfloat16), converted in place; whether the step may
  /// run again.
  bool store_state_in_fewer_bytes(const OomGaveUp& e);
  bool store_moments_in_fewer_bytes(const OomGaveUp& e);
  bool store_weights_in_bfloat16(const OomGaveUp& e);

  // run.cpp
  void start(bool resumed);
  /// Step::run's while_device_runs under data.fetch_ahead: InputPipeline::fetch_ahead, not after the last
  /// step (the source would move past what the final checkpoint records), nor when a stop is on its way.
  std::function<void()> fetch_ahead_hook();
  void maybe_evaluate();
  std::string evaluate_and_log(bool final);  // "" or why the evaluation failed (one line)
  std::optional<int> agree_on_save_and_stop();
  int give_up(const OomGaveUp& e);
  int finish();

  // auto_batch.cpp
  // train.micro_batch: auto. `stopped` when a stop (SIGTERM, SIGINT) came during the search: its findings
  // are in auto_search.json and the run exits (stop_during_search).
  MicroBatchSearch auto_micro_batch(const data::Batch& batch);
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

  // limits.cpp
  void poll(bool batch_failed);  // the memory limit every step, the threads every 50 steps
  void poll_memory_limit(bool batch_failed);  // OomGaveUp on every rank if any rank's batch did not fit
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

  /// The checkpoint the run ends with (SIGTERM/SIGINT, final, OOM give-up), retried; agreed by all ranks.
  bool save_before_exit(const std::string& reason) {
    return saver_->save_before_exit(progress_.step(), reason, [this] { return serialize_checkpoint(); });
  }

  bool main_rank() const { return ranks_.main_rank(); }
  int64_t rank_batch() const { return ranks_.rank_batch(); }  ///< samples per step per rank
  bool has_eval() const { return input_.eval() != nullptr; }
  bool tokens() const { return input_.source().tokens(); }  ///< a language model on a token stream

  // The parts are destroyed in the reverse of this order. The config and the options come first: the parts
  // keep references to them.
  Config cfg_;
  RunOptions opts_;
  // The run folder's lock (rank 0 only; common/run_lock.h). Declared first of the run's parts so that it
  // is released last, after the background saves and the logs are done with the folder.
  std::shared_ptr<RunFolderLock> run_lock_;
  // The processes (ranks.h): declared before the parts that hold their process group (the step, the saver),
  // destroyed after them.
  Ranks ranks_;
  // The model and what updates it (trained_model.h): declared before memory_ and the step, destroyed after them.
  TrainedModel trained_;
  // The memory backend, its cap and what the first step needs first (run_memory.h): declared before the
  // step, destroyed after it.
  RunMemory memory_;
  std::unique_ptr<Step> step_runner_;
  std::unique_ptr<Saver> saver_;  // the checkpoints: when, how, and what a failed write does (saver.h)
  // metrics.jsonl, the telemetry and its HTTP endpoint, memory reports, TensorBoard, MLflow (trackers.h;
  // inside, the telemetry is declared before the HTTP server: the server reads it until destroyed).
  Trackers trackers_;
  TextSampler sampler_;  // train.sample_every (text_sampler.h)
  Progress progress_;    // the loop's counters and clocks (progress.h)
  int64_t eval_micro_batch_ = 0;
  // The input (input_pipeline.h): the training source and the test split, the fetch-ahead, and what a
  // step records of its batch. Declared after memory_, so destroyed before it, with the batches it
  // counted (on the device under data.fetch_ahead).
  InputPipeline input_;
};

}  // namespace trainer
