// The OOM ladder and grow-back, as pure logic: which micro-batch size and whether activation
// checkpointing to use for the next attempt, given the out-of-memory failures and clean steps so far.
// The training step runs the attempts and catches the failures (see docs/MEMORY.md); nothing here
// touches tensors, so the rules are tested without a model and saved in checkpoints as JSON.
//
// Ladder on each OOM (the global batch never changes, only how it is split):
//   1. micro-batch above the floor   -> halve it (rounded up, not below the floor); accum_steps grows
//   2. at the floor, checkpointing off and allowed -> turn checkpointing on, keep the floor
//   3. otherwise                     -> give up
// Turning checkpointing on keeps the micro-batch at the floor instead of resetting it to the original
// size: an OOM response never asks for more memory than the attempt that just failed, so the retry is the
// cheapest configuration there is; the grow-back probes below raise the micro-batch again if the memory
// saved by checkpointing allows. docs/MEMORY.md compares this ladder with other tools'.
//
// Grow-back after clean steps: a probe (one step at a larger size, or with checkpointing off again if the
// ladder turned it on) starts when the limit rose, or after `grow_after` clean steps whose peak stayed
// below (1 - headroom) * limit. A probe that OOMs is reverted and remembered: the smallest micro-batch
// that failed at the current limit is never probed again (nor anything above it) until the limit rises.
// A probe the clean steps' own peaks rule out is not run: the controller keeps the lowest peak it saw at
// each micro-batch (per checkpointing setting), and once they span a factor of two it fits a line
// (trainer/memory/curve.h) and probes no size that the line puts over the limit. It probes the largest
// size the line allows instead, or nothing.
// With `halvings_only` the micro-batch only ever takes sizes of halving_ladder(): a probe climbs to the
// next of them instead of bisecting towards a failed size, so a run reuses a few sizes (and whatever
// cuDNN tuned for them, trainer/step/cudnn_policy.h) rather than meeting new ones.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace trainer {

/// Settings of the controller; validated by MicroBatchController's constructor.
struct MicroBatchOptions {
  int64_t global_batch = 0;         ///< samples per optimizer step (>= 1); never changed by the ladder
  int64_t micro_batch = 0;          ///< first micro-batch size (0 = global_batch); in [min, global]
  int64_t min_micro_batch = 1;      ///< the floor the ladder halves down to (>= 1)
  bool checkpointing = false;       ///< activation checkpointing on from the start (then never turned off)
  bool allow_checkpointing = true;  ///< the ladder may turn checkpointing on once at the floor
  int64_t grow_after = 50;          ///< clean steps with headroom before a probe (>= 1)
  double headroom = 0.2;            ///< probe only while peak < (1 - headroom) * limit; in [0, 1)
  bool halvings_only = false;       ///< grow-back probes only sizes of halving_ladder() (memory.ladder_sizes)
  /// The largest micro-batch grow-back probes (0 = global_batch), a rise of the limit included: set when
  /// `micro_batch: auto` chose a size below the largest that fits because it ran faster. In
  /// [micro_batch, global_batch] when set.
  int64_t max_micro_batch = 0;
};

/// ceil(global_batch / micro_batch): micro-batches per optimizer step.
int64_t accum_steps_for(int64_t global_batch, int64_t micro_batch);

/// The sizes of the micro-batches of one step: accum_steps_for(g, m) - 1 of size m, then the rest
/// (g = 10, m = 4 -> {4, 4, 2}). They sum to g. Throws std::invalid_argument unless 1 <= m <= g.
std::vector<int64_t> split_batch(int64_t global_batch, int64_t micro_batch);

/// The sizes the ladder reaches by halving (rounded up, not below `floor`) from the global batch and from
/// `micro_batch` (the size a run starts or resumes at), both included, ascending: global 256, micro 96,
/// floor 1 -> {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256}. Throws std::invalid_argument
/// unless 1 <= floor <= micro_batch <= global_batch.
std::vector<int64_t> halving_ladder(int64_t global_batch, int64_t micro_batch, int64_t floor);

/// What a transition was.
enum class OomEventKind {
  kBackoff,          ///< OOM: micro-batch halved
  kCheckpointingOn,  ///< OOM at the floor: activation checkpointing turned on
  kGiveUp,           ///< OOM at the floor with checkpointing on (or not allowed): nothing left to try
  kProbe,            ///< grow-back: the next step tries a larger micro-batch or checkpointing off
  kProbeFailed,      ///< the probe OOMed: back to the last good configuration, size remembered
  kProbeSucceeded,   ///< the probe step was clean: its configuration is kept
  kLimitChanged,     ///< the memory limit differs from the last one seen
  kProbeSkipped,     ///< grow-back: the line through the clean steps' peaks puts every larger size over the limit
};

/// "backoff", "checkpointing_on", "give_up", "probe", "probe_failed", "probe_succeeded", "limit_changed",
/// "probe_skipped".
const char* to_string(OomEventKind kind);

/// One transition, for the log and metrics.jsonl.
struct OomEvent {
  OomEventKind kind = OomEventKind::kBackoff;
  int64_t old_micro_batch = 0, new_micro_batch = 0;
  int64_t old_accum_steps = 0, new_accum_steps = 0;
  bool old_checkpointing = false, new_checkpointing = false;
  int64_t limit_bytes = 0;  ///< the limit in force (0 = none); for kLimitChanged the new one
  int64_t peak_bytes = 0;   ///< the peak reported with the clean step that started a probe (else 0)
  std::string reason;       ///< one sentence for a human

  /// {"event": "oom", "kind": ..., "old_micro_batch": ..., ..., "reason": ...}
  nlohmann::json to_json() const;
};

/// What the step should do after an OOM.
struct OomAction {
  enum class Kind {
    kHalve,                ///< retry the step at the new, smaller micro-batch
    kEnableCheckpointing,  ///< retry the step with activation checkpointing on
    kRevertProbe,          ///< a probe failed: retry the step in the last good configuration
    kGiveUp,               ///< stop: event.reason says why and what to do
  };
  Kind kind = Kind::kGiveUp;
  int64_t micro_batch = 0;  ///< the configuration to retry with (unchanged for kGiveUp)
  int64_t accum_steps = 0;
  bool checkpointing = false;
  OomEvent event;
};

/// The probe in progress, if any.
enum class ProbeKind { kNone, kGrow, kCheckpointingOff };

/// The backoff / grow-back state machine (see the file comment). Not thread-safe; one per trainer.
class MicroBatchController {
 public:
  /// Throws std::invalid_argument naming the field if an option is out of range.
  explicit MicroBatchController(const MicroBatchOptions& options);

  int64_t global_batch() const { return opt_.global_batch; }
  int64_t min_micro_batch() const { return opt_.min_micro_batch; }
  /// The largest micro-batch grow-back probes: MicroBatchOptions::max_micro_batch, or global_batch.
  int64_t max_micro_batch() const { return opt_.max_micro_batch > 0 ? opt_.max_micro_batch : opt_.global_batch; }
  /// The micro-batch size for the next attempt.
  int64_t micro_batch() const { return micro_; }
  /// ceil(global_batch / micro_batch).
  int64_t accum_steps() const { return accum_steps_for(opt_.global_batch, micro_); }
  /// split_batch(global_batch, micro_batch).
  std::vector<int64_t> micro_batch_sizes() const { return split_batch(opt_.global_batch, micro_); }
  /// Whether the next attempt runs with activation checkpointing.
  bool checkpointing() const { return checkpointing_; }
  /// True if the ladder (not the config) turned checkpointing on.
  bool checkpointing_by_ladder() const { return ckpt_by_ladder_; }
  /// The probe the next step runs, kNone if none.
  ProbeKind probe() const { return probe_; }
  /// Smallest micro-batch that failed at the current limit and checkpointing setting (0 = none).
  int64_t failed_micro_batch() const { return failed_micro_; }
  /// The last limit seen (0 = none).
  int64_t limit() const { return limit_; }
  /// Clean steps since the last OOM, probe start or probe success.
  int64_t clean_steps() const { return clean_steps_; }
  /// The lowest step peak seen at each micro-batch, with activation checkpointing on or off (at most
  /// kMaxPeakSizes sizes each: the ones nearest the current micro-batch).
  const std::map<int64_t, int64_t>& peaks(bool checkpointing) const { return peaks_[checkpointing ? 1 : 0]; }
  /// A peak measured outside a step, at `micro_batch` with checkpointing on or off: kept as a clean
  /// step's would be. The run gives it the auto search's probes, which measure the step's worst
  /// micro-batch. Throws std::invalid_argument unless 1 <= micro_batch <= global_batch.
  void add_peak(int64_t micro_batch, bool checkpointing, int64_t peak_bytes);
  /// The largest micro-batch in [0, global_batch] that the line through peaks(checkpointing()) puts at or
  /// under the limit, or that peaked at or under it; global_batch without a limit, or while the peaks
  /// span less than a factor of two (the slope would be the allocator's rounding).
  int64_t largest_predicted_to_fit() const;
  /// The smallest probe size skipped as predicted over the current limit (0 = none); forgotten like
  /// failed sizes, when the limit rises.
  int64_t skipped_micro_batch() const { return skipped_micro_; }

  static constexpr size_t kMaxPeakSizes = 8;

  /// Call when an attempt ran out of memory, with the limit in force. During a probe this reverts it
  /// (kRevertProbe); otherwise it climbs the ladder. Records and returns the event.
  OomAction on_oom(int64_t limit_bytes);

  /// Call after each clean step with the limit in force and the step's peak bytes. The peak is kept for
  /// the size and setting the step ran at, and a clean probe step is accepted (on_probe_succeeded).
  /// Returns the micro-batch size of a probe that the next step runs (for a checkpointing-off probe: the
  /// unchanged size), or nullopt.
  std::optional<int64_t> maybe_grow(int64_t limit_bytes, int64_t peak_bytes);

  /// The probe OOMed: back to the last good configuration; a grow probe's size is remembered as failed.
  /// on_oom calls this during a probe. Throws std::logic_error if no probe is in progress.
  OomEvent on_probe_failed();
  /// The probe step was clean: keep its configuration. maybe_grow calls this during a probe. Throws
  /// std::logic_error if no probe is in progress.
  OomEvent on_probe_succeeded();
  /// Call when the limit may have changed (on_oom and maybe_grow do). When it rose (or became none) the
  /// remembered failures are forgotten and the next clean step probes. Returns the event if it changed.
  std::optional<OomEvent> on_limit_changed(int64_t new_limit);
  /// What the step holds besides its micro-batch shrank (the optimizer's state stored in fewer bytes): the
  /// sizes that failed may fit now, and the next clean step probes, as after a rise of the limit.
  void on_state_shrank();

  /// The events recorded since the last call, oldest first; the loop logs them and writes them to
  /// metrics.jsonl.
  std::vector<OomEvent> take_events();

  /// The whole state, options included (not the pending events), for checkpoints.
  nlohmann::json to_json() const;
  /// Restores a state written by to_json(). Throws std::invalid_argument naming the key when a key is
  /// missing or a value is out of range.
  static MicroBatchController from_json(const nlohmann::json& j);

 private:
  OomEvent make_event(OomEventKind kind, int64_t old_micro, bool old_ckpt, std::string reason) const;
  OomEvent record(OomEvent e);
  void remember_failure(int64_t micro);
  /// A grow probe's size (<= micro_: none), and why the line lowered it ("" if it did not).
  struct GrowTarget {
    int64_t micro_batch = 0;
    std::string lowered;
  };
  GrowTarget grow_target(int64_t peak_bytes);

  MicroBatchOptions opt_;
  int64_t micro_ = 0;
  bool checkpointing_ = false;
  bool ckpt_by_ladder_ = false;
  int64_t limit_ = 0;
  int64_t failed_micro_ = 0;
  bool ckpt_off_failed_ = false;
  bool limit_rose_ = false;
  int64_t clean_steps_ = 0;
  ProbeKind probe_ = ProbeKind::kNone;
  int64_t last_good_micro_ = 0;
  std::map<int64_t, int64_t> peaks_[2];  ///< [checkpointing]: micro-batch -> lowest clean step peak
  int64_t skipped_micro_ = 0;
  std::vector<OomEvent> events_;
};

/// The largest size in [lo, hi] for which fits(size) is true, assuming fits is monotone (true up to some
/// size, false above); 0 if fits(lo) is false. Without a start (0): doubles from lo until a size fails or
/// hi is reached, then bisects between the last size that fit and the first that failed, about
/// 2*log2(hi/lo) calls. With a start in [lo, hi] (a prediction, e.g. from a memory curve): tries it, then
/// gallops away from it (+1, +2, +4, ... while sizes fit; -1, -2, -4, ... while they fail) and bisects
/// the bracket, about 2*log2(|error| + 1) + 2 calls for a prediction off by |error|; a start outside
/// [lo, hi] is clamped into it. The answer is the same either way. For `train.micro_batch: auto`,
/// fits(mb) runs one forward and backward at mb under the cap and returns false on an OOM
/// (is_oom_error). Throws std::invalid_argument unless 1 <= lo <= hi.
int64_t find_max_micro_batch(const std::function<bool(int64_t)>& fits, int64_t lo, int64_t hi, int64_t start = 0);

}  // namespace trainer
