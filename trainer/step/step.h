// One optimizer step: the rank's slice of the global batch split into micro-batches, forward and backward
// under autocast, the gradient exchange between ranks, the update; and recovery when memory runs out
// anywhere in it: drop the failed attempt, put the snapshot back, take the ladder's next rung (smaller
// micro-batch, then recomputed activations, then give up) and redo the step with the same samples. After
// a clean step the ladder may grow the micro-batch back.
//
// TrainingRun (trainer/run/run.h) calls Step::run once per optimizer step. A test can drive a Step
// in-process: build the parts (model, Optimizer, GradScaler, a capped MemoryBackend, a MemoryReporter),
// then call run() on batches and read the StepResult.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/log.h"
#include "common/rng.h"
#include "data/samples/batch.h"
#include "models/model.h"
#include "trainer/dist/dist.h"
#include "trainer/dist/shard.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/oom.h"
#include "trainer/memory/report.h"
#include "trainer/mix/mixing.h"
#include "trainer/numerics/amp.h"
#include "trainer/numerics/forward.h"
#include "trainer/numerics/loss.h"
#include "trainer/numerics/optim.h"
#include "trainer/step/cudnn_policy.h"
#include "trainer/step/graph_policy.h"
#include "trainer/step/readback.h"
#include "trainer/step/snapshot.h"
#include "trainer/step/step_graph.h"

namespace trainer {

/// What one optimizer step did, for the metrics line.
struct StepResult {
  double loss = 0;          ///< mean loss over the global batch
  double grad_norm = 0;     ///< before clipping
  double loss_scale = 0;    ///< the scale this step's losses were multiplied by (fp16's GradScaler; 0 without)
  bool updated = true;      ///< false: skipped (non-finite gradients)
  int64_t micro_batch = 0;  ///< micro-batch the step completed with
  int64_t accum_steps = 0;
  int64_t oom_retries = 0;  ///< attempts that ran out of memory before it completed
  double lr = 0;
  int64_t mem_start_bytes = 0;  ///< tensor memory held when the step began (weights, optimizer state, batch)
  int64_t mem_peak_bytes = 0;   ///< the memory backend's peak over the completed attempt
  int64_t grad_buckets_in_backward = 0;  ///< data parallel: gradient buckets sent while backward still ran
  /// Seconds from the first out-of-memory error of the step (caught) to the step's completion at the
  /// configuration the ladder moved to: the recovery. 0 when nothing ran out of memory.
  double recovery_s = 0;
  std::string probe;        ///< the grow-back probe this step ran ("grow", "checkpointing_off"), "" for none
  bool cudnn_benchmark = false;         ///< cuDNN's benchmark flag in the completed attempt
  std::vector<int64_t> new_sizes;       ///< micro-batch sizes this step used first in this process (any attempt)
  std::vector<int64_t> tuned_sizes;     ///< of those, the ones cuDNN timed (CudnnPolicy)
  /// How the completed attempt ran (train.cuda_graph): "eager", "capture" (captured, then replayed) or
  /// "replay".
  std::string graph = "eager";
};

// ---- the OOM outcomes ------------------------------------------------------------------------------
// An out-of-memory error of this rank (is_oom_error) is handled inside Step::run. These two leave it:

/// Thrown on every rank of a data-parallel job when another rank ran out of memory in the same
/// micro-batch: this rank's attempt is abandoned too, and the step backs off everywhere alike.
struct PeerOutOfMemory : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Thrown when the OOM ladder has nothing left to try: the run saves a checkpoint and exits 3.
struct OomGaveUp : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---- the step --------------------------------------------------------------------------------------

struct StepOptions {
  ForwardOptions forward;
  LossOptions loss;            ///< train.loss, train.label_smoothing, train.fused_loss, train.bce_*
  /// Mixup and CutMix (train.mixup_alpha, ...): each step mixes the rank's whole batch, whatever its
  /// micro-batches (trainer/mix/mixing.h), drawn from (mix_seed, step, rank). The search's probes and the
  /// pretuning run unmixed.
  MixOptions mix;
  uint64_t mix_seed = 0;
  double grad_clip = 0;        ///< optim.grad_clip (0 = off)
  /// memory.activation_checkpointing: none | all | every_k | auto. `all` and the ladder's rung are the
  /// controller's flag; `every_k` checkpoints blocks 0, k, 2k, ...; `auto` leaves it to the ladder.
  Checkpointing activation_checkpointing = Checkpointing::kNone;
  int64_t checkpoint_every_k = 2;
  bool batched_snapshot = true;  ///< train.snapshot: batched (StepSnapshot)
  /// With the fused optimizer in a single process: the update is queued with its skip decided on the
  /// device, and the step's values are read once after it (false: read before it, as the plain and
  /// foreach paths and data parallel always do). Not a config key: the tests compare the two.
  bool skip_on_device = true;
  AutoSearch auto_search = AutoSearch::kCurve;  ///< memory.auto_search (MicroBatchSearcher::find without a start)
  CudnnPolicyOptions cudnn;           ///< memory.cudnn_policy and its retry of a timing that ran out of memory
  /// train.cuda_graph (GraphPolicy): auto | on | off. `on` where the job cannot capture is
  /// std::invalid_argument from the constructor, naming the key.
  Switch cuda_graph = Switch::kAuto;
  int64_t graph_warmup_steps = 2;     ///< eager steps at a new micro-batch layout before its capture
};

/// The parts a step works on, owned by the caller and alive as long as the Step.
struct StepParts {
  models::Model model;
  Optimizer* optimizer = nullptr;
  GradScaler* scaler = nullptr;
  MemoryBackend* memory = nullptr;    ///< a PhasePeakBackend also gets per-phase peaks into reports
  MemoryReporter* reporter = nullptr; ///< OOM reports and phase peaks
  MetricsLog* metrics = nullptr;      ///< oom and ladder events (optional)
  Distributed* dist = nullptr;        ///< data parallel (null in a single process)
  GradientSync* grad_sync = nullptr;  ///< with dist
  /// dist.shard optimizer or gradients (trainer/dist/shard.h): the optimizer updates this rank's pieces
  /// (Optimizer::shard), which are all-gathered after the update. With gradients the GradientSync
  /// scatters, and the norm and the scaler's inf check are agreed over the ranks' slices.
  ParamShards* shards = nullptr;
};

class Step {
 public:
  /// Throws std::invalid_argument when a required part is missing.
  Step(StepParts parts, StepOptions options, MicroBatchController controller);

  /// Optimizer step number `step` (1-based) over `batch` (this rank's samples of the global batch) at
  /// learning rate `lr`. `limit` is the memory cap the ladder decides against (the lowest over ranks;
  /// 0 = none). Out of memory: writes a memory report, restores the snapshot, takes the next rung and
  /// retries; OomGaveUp when no rung is left. Any other error propagates.
  /// `while_device_runs`, if given, is called once, in the completed attempt, when the step's work is
  /// queued and before the host waits for its values: the run fetches and stages the next step's batch
  /// there (InputPipeline::fetch_ahead), while the device finishes this one. It must not throw.
  StepResult run(const data::Batch& batch, int64_t step, double lr, int64_t limit,
                 const std::function<void()>& while_device_runs = {});

  const GraphPolicy& graph_policy() const { return graph_policy_; }

  CudnnPolicy& cudnn() { return cudnn_; }
  const CudnnPolicy& cudnn() const { return cudnn_; }

  MicroBatchController& controller() { return controller_; }
  const MicroBatchController& controller() const { return controller_; }
  /// Replaces the controller (the auto search's size, a resumed ladder).
  void set_controller(MicroBatchController controller) { controller_ = std::move(controller); }
  /// The cap changed: tells the controller and logs its events as of `step` optimizer steps completed.
  void on_limit_changed(int64_t limit, int64_t step);
  /// Marks the blocks to checkpoint: the controller's flag (all, or the ladder's rung), else the
  /// configured every_k.
  void apply_activation_checkpointing();

  // ---- for the micro-batch search's probes (MicroBatchSearcher, search.h) ----
  const StepParts& parts() const { return p_; }
  const StepOptions& options() const { return o_; }
  /// The weights' dtype changed (memory.state auto moved them to bfloat16): float inputs are cast to it.
  void set_param_dtype(at::ScalarType dtype) { o_.forward.param_dtype = dtype; }
  /// The cuDNN policy's flag for an attempt of kind `attempt` at `sizes`, set, and the decision recorded.
  CudnnDecision apply_cudnn(CudnnAttempt attempt, const std::vector<int64_t>& sizes, int64_t step);
  /// What a failed attempt (or probe) left, dropped: its gradients, the scaler's step, what autograd still
  /// held, autocast's cached casts and the allocator's cached blocks.
  void drop_failed_attempt();

 private:
  void attempt(const data::Batch& batch, int64_t step, double lr, StepResult& r);
  /// The cuDNN policy's flag for a step at `sizes`, and what the metrics line says of the attempt's layout.
  void apply_step_cudnn(const std::vector<int64_t>& sizes, int64_t step, StepResult& r);
  /// What the micro-batches of an attempt leave for the update: the summed loss (this rank's), the gradient
  /// norm, and under data parallel the global loss the ranks agreed on.
  struct Passes {
    torch::Tensor loss_sum;
    torch::Tensor norm;
    double global_loss = 0;
  };
  /// Forward and backward of every micro-batch of `sizes` over `batch`, then prepare_update.
  Passes run_micro_batches(const data::Batch& batch, const std::vector<int64_t>& sizes, PhasePeakRecorder& phases,
                           StepResult& r);
  /// The step's values packed, the skip decided on the device, the fused update and the scaler's update
  /// queued; the gradients dropped. `lr`: the rate, or none to read it from the device (a captured step).
  /// `read_now`: the copy of the values to the host queued before the update (the eager path).
  torch::Tensor queue_update(const torch::Tensor& loss_sum, const torch::Tensor& norm, std::optional<double> lr,
                             bool read_now);
  /// Waits for the values queue_update or a replay sent to the host; fills r and counts an applied update.
  void read_queued_values(StepResult& r);
  /// Calls run()'s `while_device_runs` if it has not been called in this run() yet.
  void while_device_runs();
  // ---- the step as a CUDA graph (GraphPolicy, StepGraph) ----
  /// The key of a step over `batch` under `limit` at the controller's current layout.
  GraphKey graph_key(const data::Batch& batch, int64_t limit) const;
  /// The policy's action for `key`; a graph the key made stale is released (with its pool) first.
  GraphAction decide_graph(const GraphKey& key, int64_t step);
  /// Captures the step, then replays it for this step. An OOM propagates (run()'s recovery); any other
  /// failure is one warning, the run goes on eagerly, and false is returned with nothing changed.
  bool capture_step(const data::Batch& batch, int64_t step, double lr, StepResult& r);
  void replay_step(const data::Batch& batch, int64_t step, double lr, StepResult& r);
  /// The graph and its pool dropped, and the pool's memory given back to the device.
  void release_graph();
  /// Forward and backward of samples [offset, offset + n); the micro-batch's share of the step's loss.
  torch::Tensor forward_backward(const data::Batch& batch, int64_t offset, int64_t n, double normalizer,
                                 PhasePeakRecorder& phases);
  /// After the last backward: the gradient exchange, the optimizer state, unscale; the gradient norm
  /// (with sharded gradients: the sum of this rank's squares, finished by agree_on_slices).
  torch::Tensor prepare_update(PhasePeakRecorder& phases, StepResult& r);
  /// Sharded gradients, once every rank's backward succeeded: the global norm from every rank's sum of
  /// squares, written into `norm`; the scaler's inf/NaN check agreed (any rank's is every rank's); the
  /// slices clipped. Collectives: after the out-of-memory agreement, never inside an attempt that may fail
  /// on one rank only.
  void agree_on_slices(torch::Tensor& norm);
  /// Data parallel, after micro-batch i of `count`: rethrows this rank's OOM, or PeerOutOfMemory when
  /// another rank had one; returns the global loss after the last micro-batch.
  double agree_on_oom(const std::exception_ptr& oom, size_t i, size_t count, const torch::Tensor& loss_sum);
  /// What the host needs of a finished attempt, read in one device-to-host copy.
  struct HostValues {
    double loss = 0;          ///< loss_sum's value (0 when loss_sum is undefined: data parallel has it)
    double grad_norm = 0;
    bool found_inf = false;   ///< the scaler saw an inf/NaN gradient (false without a scaler)
    double loss_scale = 0;    ///< the scaler's scale (0 without a scaler)
  };
  HostValues read_step_values(const torch::Tensor& loss_sum, const torch::Tensor& norm) const;
  /// (loss_sum if defined, norm, and with a scaler found_inf and the scale) as one fp32 vector on the device.
  torch::Tensor pack_step_values(const torch::Tensor& loss_sum, const torch::Tensor& norm) const;
  HostValues unpack_step_values(const torch::Tensor& host, bool with_loss) const;
  /// The single-process fused path (StepOptions::skip_on_device): the update queued with its skip flag,
  /// then the values read; fills r's loss, norm, scale and `updated`.
  void update_then_read(const torch::Tensor& loss_sum, const torch::Tensor& norm, double lr, StepResult& r);
  /// run()'s answer to an OOM (this rank's or a peer's): the report, the graph and the failed attempt
  /// dropped, the snapshot restored (or, where its take failed (`taken` false), dropped to be taken anew), then the cuDNN
  /// rerun or the ladder's next rung (OomGaveUp when none is left).
  void recover(const std::exception& e, bool peer, int64_t step, int64_t limit, bool taken, StepResult& r);
  /// What a backward that threw left queued in the autograd engine, dropped (see step.cpp).
  void release_autograd_leftovers();
  /// After a failed attempt was dropped: the ladder's next rung, logged; OomGaveUp when there is none.
  void on_oom(const std::exception& e, bool peer, int64_t step, int64_t limit, StepResult& r);

  StepParts p_;
  StepOptions o_;
  MicroBatchController controller_;
  CudnnPolicy cudnn_;
  int64_t bad_samples_ = 0;  // samples that could not be decoded, over the steps this Step ran
  HostReadback readback_;    // update_then_read's copy of the step's values
  std::optional<StepSnapshot> snapshot_;  // run()'s, kept between steps (train.snapshot: batched reuses its copies)
  GraphPolicy graph_policy_;
  StepGraph graph_;
  MixDraw mix_;  // this step's Mixup/CutMix draw (empty: nothing mixed)
  const std::function<void()>* while_device_runs_ = nullptr;  // run()'s, until called
};

}  // namespace trainer
