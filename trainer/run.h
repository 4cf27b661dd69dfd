// The state of one training run and its two halves: run.cpp sequences (setup, resume, the loop,
// evaluation, checkpoints, logging); step.cpp holds the optimizer step (micro-batches, loss
// normalization, OOM retries, the update). Internal to trainer/: users call train() (train.h).
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "data/dataset.h"
#include "data/loader.h"
#include "data/tokens.h"
#include "models/model.h"
#include "trainer/amp.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/dist.h"
#include "trainer/http.h"
#include "trainer/memory_report.h"
#include "trainer/telemetry.h"
#include "trainer/tensorboard.h"
#include "trainer/log.h"
#include "trainer/memory.h"
#include "trainer/oom.h"
#include "trainer/optim.h"
#include "trainer/resources.h"
#include "trainer/train.h"

namespace trainer {

/// The training stream, image or token loader, behind one face: both return data::Batch and keep
/// their place in samples, so resume and OOM retries do not care which it is.
struct BatchStream {
  virtual ~BatchStream() = default;
  virtual data::Batch next() = 0;
  virtual void seek(int64_t epoch, int64_t position) = 0;
  virtual data::LoaderState state() const = 0;
  virtual int64_t steps_per_epoch() const = 0;
};

template <typename Loader>
struct StreamOf : BatchStream {
  explicit StreamOf(std::unique_ptr<Loader> l) : loader(std::move(l)) {}
  data::Batch next() override { return loader->next(); }
  void seek(int64_t epoch, int64_t position) override { loader->seek(epoch, position); }
  data::LoaderState state() const override { return loader->state(); }
  int64_t steps_per_epoch() const override { return loader->steps_per_epoch(); }
  std::unique_ptr<Loader> loader;
};

/// Thrown on every rank of a data-parallel job when another rank ran out of memory in the same
/// micro-batch: this rank's attempt is abandoned too, and the step backs off everywhere alike.
struct PeerOutOfMemory : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Thrown when the OOM ladder has nothing left to try.
struct OomGaveUp : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// What one optimizer step did, for the metrics line.
struct StepResult {
  double loss = 0;          ///< mean loss over the global batch
  double grad_norm = 0;     ///< before clipping
  bool updated = true;      ///< false: skipped (non-finite gradients)
  int64_t micro_batch = 0;  ///< micro-batch the step completed with
  int64_t accum_steps = 0;
  int64_t oom_retries = 0;  ///< attempts that ran out of memory before it completed
  double lr = 0;
  int64_t mem_start_bytes = 0;  ///< tensor memory held when the step began (weights, optimizer state, batch)
  int64_t grad_buckets_in_backward = 0;  ///< data parallel: gradient buckets sent while backward still ran
};

struct EvalResult {
  double loss = 0, top1 = 0, top5 = 0;
  int64_t samples = 0;
};

class TrainingRun {
 public:
  TrainingRun(const Config& cfg, const RunOptions& opts);
  ~TrainingRun();
  int run();

 private:
  // run.cpp
  void setup();
  void build_model();
  bool resume();
  void apply_activation_checkpointing();
  void setup_distributed();
  void poll_limits();
  void agree_on_limit();
  void poll_threads();
  EvalResult evaluate();
  void save_checkpoint(const std::string& reason, bool wait);
  void log_step(const StepResult& r, double step_time);
  void log_controller_events();
  MicroBatchOptions controller_options() const;
  nlohmann::json state_json() const;

  // step.cpp
  StepResult train_step(const data::Batch& batch);
  void attempt_step(const data::Batch& batch, double lr, StepResult& r);
  void drop_failed_attempt();
  int64_t find_auto_micro_batch(const data::Batch& batch);
  torch::Tensor micro_batch_loss(const torch::Tensor& images, const torch::Tensor& labels, double normalizer);

  Config cfg_;
  RunOptions opts_;
  torch::Device device_{torch::kCPU};
  at::ScalarType amp_dtype_ = at::kBFloat16;

  // Data parallel (null in a single process). The rank-0 process writes the run folder's shared files.
  DistEnv env_;
  std::unique_ptr<Distributed> dist_;
  std::unique_ptr<GradientSync> grad_sync_;
  bool main_rank() const { return env_.rank == 0; }
  int64_t rank_batch() const { return cfg_.train.global_batch / env_.world_size; }  ///< samples per step per rank
  std::string rank_dir_;  // where this rank's own files go: the run folder (rank 0) or <run>/rank<r>

  bool has_eval() const { return tokens_ ? test_tokens_ != nullptr : test_images_ != nullptr; }

  bool tokens_ = false;  // a language model on a token stream (else image classification)
  std::shared_ptr<data::ImageDataset> train_images_, test_images_;
  std::shared_ptr<data::TokenDataset> train_tokens_, test_tokens_;
  std::unique_ptr<BatchStream> loader_;
  std::vector<int64_t> sample_shape_;  // (C, H, W) or (T)
  double flops_per_sample_ = 0;        // forward
  models::Model model_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<GradScaler> scaler_;
  std::unique_ptr<MemoryBackend> memory_;
  std::unique_ptr<MicroBatchController> controller_;
  std::unique_ptr<ControlFile> control_;
  std::unique_ptr<CheckpointStore> store_;
  MetricsLog metrics_;
  Telemetry telemetry_;  // before http_: the server reads it until destroyed
  std::unique_ptr<HttpServer> http_;
  std::unique_ptr<MemoryReporter> memory_report_;
  std::unique_ptr<ResourceMonitor> resources_;
  std::unique_ptr<TensorboardWriter> tensorboard_;

  int64_t step_ = 0;          // optimizer steps completed
  int64_t total_steps_ = 0;
  int64_t steps_per_epoch_ = 0;
  int64_t warmup_steps_ = 0;
  int64_t samples_seen_ = 0;
  int64_t epoch_ = 0, position_ = 0;  // where the next global batch starts
  int64_t nonfinite_in_a_row_ = 0;
  int64_t limit_bytes_ = 0;           // memory cap in force in this process (0 = none)
  int64_t agreed_limit_ = 0;          // the lowest cap over all ranks (0 = none): what the controller sees
  std::string limit_spec_;            // as configured or set through control.yaml
  int64_t cgroup_limit_ = 0;          // the container's limit when limit_bytes_ was resolved
  int64_t eval_micro_batch_ = 0;
  std::optional<EvalResult> last_eval_;
  std::chrono::steady_clock::time_point start_time_, last_ckpt_time_;
  uint64_t batch_hash_ = 0;           // hash of the last step's sample indices
  double data_wait_s_ = 0;            // time the last step waited for its batch
  double window_time_ = 0;            // seconds of the steps since the last log line
  int64_t window_steps_ = 0;
};

}  // namespace trainer
