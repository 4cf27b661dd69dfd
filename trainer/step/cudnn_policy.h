// When cuDNN chooses a convolution's algorithm by timing the candidates (benchmark mode) and when by its
// heuristics, as pure logic: one decision per attempt (an attempt of a training step, a probe of
// `train.micro_batch: auto`, a pretuning pass) from the micro-batch sizes the attempt runs and what ran
// before. Nothing here touches tensors or the device: the step applies each decision with
// set_cudnn_benchmark() and writes the ones that matter to metrics.jsonl (event "cudnn"), and the rules
// are tested without a GPU. docs/MEMORY.md "cuDNN and changing micro-batches".
//
// What LibTorch does (read in aten/src/ATen/native/cudnn/Conv_v8.cpp, run_single_conv, 2.x): every
// convolution first looks its shape up in a per-thread plan cache, whatever the benchmark flag. Only a
// miss reads the flag: on, it times up to benchmark_limit plans (seconds for a whole network, and by
// default the caching allocator's cache is emptied after each timing); off, it runs the heuristics'
// first plan that works. Either way the plan is cached for that shape. So the flag matters at a shape's
// first use only, and what is chosen then stays for the life of the process: a micro-batch size is timed
// at its first use or never. (A cached plan whose workspace no longer fits is chosen again under the flag
// then in force.) The policy therefore tracks sizes, not steps: which sizes have been used, and which of
// them were timed.
//
// The modes (memory.cudnn_policy):
//   always   benchmark on for every attempt, LibTorch's `cudnn.benchmark = True` and the trainer's
//            behaviour before this policy: every new size is timed at its first use, a backoff's and a
//            grow-back probe's included.
//   off      never: the heuristics choose every size's algorithms (YOLOv5's AutoBatch does this). The
//            default: on an H200, `start` cost ResNet-50 4.6-13.1 s before the first step and gave nothing
//            in steady state (47.18 ms a step against 47.14 ms for `off`), and the first step must begin
//            within 2 s of the model being built.
//   start    the sizes the run starts at are timed: the first attempt of the run's first step, and the
//            probes of `micro_batch: auto` that confirm its prediction (the size it then starts at).
//            Everything reached later (a backoff, a grow-back probe, a bisecting probe) takes the
//            heuristics, so no change of size waits for timing; a grow-back to the start size finds its
//            timed plans in the cache.
//   pretune  start, plus one forward and backward with benchmark on at each size of the ladder's next
//            kPretuneRungs halvings below the start size, before the first step, while the memory is
//            free (MicroBatchSearcher::pretune): a backoff to those sizes then finds timed plans.
//   settle   the heuristics at a size's first use; once a size has held `settle_steps` clean steps, one
//            step with benchmark on. Under the plan cache above that step finds every shape cached and
//            times nothing; the mode is kept so that a GPU run can show it.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "trainer/config/config.h"  // CudnnMode: memory.cudnn_policy

namespace trainer {

/// What an attempt is.
enum class CudnnAttempt {
  kStep,              ///< an attempt of a training step (a retried one too)
  kCalibrationProbe,  ///< a probe of the auto search that measures (the floor, a second point, bisection)
  kConfirmProbe,      ///< a probe of the auto search at its prediction: the size the run will likely start at
  kPretune,           ///< pretune's pass at one size of the ladder
};

/// "step", "calibration_probe", "confirm_probe", "pretune".
const char* to_string(CudnnAttempt attempt);

/// Halvings below the start size that `pretune` times (256 -> 128, 64, 32).
inline constexpr int64_t kPretuneRungs = 3;

struct CudnnPolicyOptions {
  CudnnMode mode = CudnnMode::kOff;  ///< memory.cudnn_policy's default: see the file comment
  int64_t settle_steps = 3;  ///< settle: clean steps at a size before its one benchmark step (>= 1)
  /// An attempt that timed a new size and ran out of memory is run once more at the same sizes with the
  /// heuristics before the ladder backs off (timing allocates workspaces of its own). Set where timing
  /// happens at all: a CUDA device with cuDNN. Never in `always` (that mode times everything).
  bool retry_tuning_oom = false;
};

/// The policy's answer for one attempt.
struct CudnnDecision {
  CudnnAttempt attempt = CudnnAttempt::kStep;
  std::vector<int64_t> sizes;      ///< the attempt's distinct micro-batch sizes, largest first
  std::vector<int64_t> new_sizes;  ///< of those, the first uses: their algorithms are chosen in this attempt
  bool benchmark = false;          ///< cuDNN's benchmark flag for the attempt
  bool retry = false;              ///< the rerun, with the heuristics, of an attempt that timed and ran out of memory
  std::string reason;              ///< one sentence for a human

  /// The new sizes this attempt times (new_sizes when benchmark is on, else none).
  std::vector<int64_t> tuned_sizes() const { return benchmark ? new_sizes : std::vector<int64_t>{}; }
  /// {"event": "cudnn", "attempt", "sizes", "new_sizes", "tuned_sizes", "benchmark", "retry", "reason"}.
  nlohmann::json to_json() const;
};

/// The decisions of one process (LibTorch's plan cache lives as long as the process: a policy is never
/// saved in a checkpoint, and a resumed run starts with nothing used). Not thread-safe; one per Step.
class CudnnPolicy {
 public:
  /// Throws std::invalid_argument for settle_steps < 1.
  explicit CudnnPolicy(const CudnnPolicyOptions& options = {});

  const CudnnPolicyOptions& options() const { return opt_; }

  /// The decision for the next attempt of kind `attempt` running micro-batches of `sizes` (any order,
  /// repeats allowed, each >= 1). Marks the new sizes used (and timed when benchmark is on) and keeps the
  /// decision for on_oom() and take_decisions().
  CudnnDecision decide(CudnnAttempt attempt, const std::vector<int64_t>& sizes);

  /// The attempt of the last decide() ran out of memory. True when it is to run again at the same sizes
  /// before anything else moves: it timed a new size, retry_tuning_oom is on, and it was not itself such
  /// a rerun. The next decide() is then that rerun (benchmark off, `retry` set).
  bool on_oom();

  /// A training step completed without running out of memory at `sizes` (settle counts the steps each
  /// size has held; a step at other sizes starts the count again).
  void on_clean_step(const std::vector<int64_t>& sizes);

  /// pretune: the sizes of the steps at the ladder's next kPretuneRungs halvings of `start` (each halving
  /// rounded up, not below `floor`; split_batch of `global` gives a step's sizes), less the start's own
  /// sizes and any size used already, largest first. Empty in the other modes.
  std::vector<int64_t> pretune_sizes(int64_t global, int64_t start, int64_t floor) const;

  /// The benchmark flag for an evaluation (its batch is a size of its own): on in `always` only.
  bool evaluation_benchmark() const { return opt_.mode == CudnnMode::kAlways; }

  bool used(int64_t size) const { return used_.count(size) > 0; }
  bool tuned(int64_t size) const { return tuned_.count(size) > 0; }
  /// Every size timed so far, ascending.
  std::vector<int64_t> tuned_sizes() const { return {tuned_.begin(), tuned_.end()}; }

  /// The decisions worth a record since the last call, oldest first: a first use, a rerun, or the flag on
  /// outside `always` (there it is on for every attempt, and only first uses are recorded).
  std::vector<CudnnDecision> take_decisions();

 private:
  bool benchmark_for(CudnnAttempt attempt, const std::vector<int64_t>& sizes, const std::vector<int64_t>& fresh,
                     std::string& reason);

  CudnnPolicyOptions opt_;
  std::set<int64_t> used_, tuned_;
  std::map<int64_t, int64_t> held_;  // settle: clean steps in a row at each size of the current step
  std::set<int64_t> settled_;        // settle: sizes whose one benchmark step has run
  bool first_step_decided_ = false;
  bool retry_pending_ = false;
  CudnnDecision last_;
  bool has_last_ = false;
  std::vector<CudnnDecision> pending_;
};

/// The distinct sizes of `sizes`, largest first.
std::vector<int64_t> distinct_sizes(const std::vector<int64_t>& sizes);

// ---- the one place the trainer sets cuDNN's global state ------------------------------------------------
// at::globalContext()'s flags; what differs between LibTorch versions is in common/compat.h. On a build
// or a device without cuDNN nothing reads these flags, and setting them changes nothing.

/// cuDNN's benchmark flag for the convolutions that run next (at::globalContext().setBenchmarkCuDNN).
void set_cudnn_benchmark(bool on);

/// How a timing runs: `benchmark_limit` plans at most (0: LibTorch's default, 10), and whether the
/// caching allocator's cache is emptied after each timing (LibTorch's default: yes). Returns whether
/// this LibTorch has the empty-cache switch (2.x; 1.13 has none, and then the setting is ignored).
bool set_cudnn_tuning(int64_t benchmark_limit, bool empty_cache_after_benchmark);

}  // namespace trainer
