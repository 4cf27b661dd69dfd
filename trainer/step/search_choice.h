// `memory.auto_search: auto`, as pure logic: which search `train.micro_batch: auto` runs after its first
// two probes (doubling and bisection where probes are cheap, the curve where they are dear), and which of
// the sizes that fit the job then runs at (the fastest measured, preferring the largest). Nothing here
// touches tensors: the step (MicroBatchSearcher::find) runs the passes and hands in what a clock measured
// around them, so the rules are tested with a fake clock. docs/MEMORY.md "How auto chooses".
//
// The search: doubling when its projected time is at most kAutoSearchBudgetS. The projection prices each
// probe doubling and bisection would still run (from the second probe up to the largest size the line
// through the first two probes' peaks predicts) at fixed + per_sample x samples, the line through the
// seconds of a warm pass at each of the first two sizes. Measured, not guessed from the device: on an H200
// a ResNet-50 pass is milliseconds and doubling found the exact answer in 3.2-4.7 s where the curve took
// 17.4-19.7 s; on a CPU a pass of a large micro-batch takes seconds and the curve's few probes win.
//
// The speed: the largest size whose samples/s, measured in a warm timed pass, is within kSpeedMargin of
// the fastest measured. Candidates are the largest size that fits and its halvings (the sizes the ladder
// backs off to), as many as kSpeedBudgetS of projected pass time allows.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "trainer/config/config.h"  // AutoSearch

namespace trainer {

/// Doubling is chosen when the probes it would still run are projected to take at most this long (the
/// issue's floor for `auto` under a cut cap, on a GPU, is 8 s for the whole search).
inline constexpr double kAutoSearchBudgetS = 8.0;
/// The speed table's passes (a warm-up where a size never ran, then the timed pass) are projected to take
/// at most this long together: sizes beyond it are not timed.
inline constexpr double kSpeedBudgetS = 4.0;
/// A smaller micro-batch is chosen over a larger one only when the larger is more than this fraction
/// slower than the fastest measured: timing noise never picks a small size.
inline constexpr double kSpeedMargin = 0.04;
/// The speed table's candidates: the largest size that fits and its next halvings, this many at most.
inline constexpr int64_t kSpeedRungs = 4;
/// A size's speed is the fastest of its timed passes, repeated until they add up to this many seconds (at
/// most kSpeedMaxRepeats passes): one pass of a few milliseconds is at the mercy of the machine's load.
inline constexpr double kSpeedMinTimedS = 0.1;
inline constexpr int64_t kSpeedMaxRepeats = 5;

/// The seconds of one forward and backward pass at micro-batch m: fixed_s + per_sample_s x m.
struct PassCost {
  double fixed_s = 0;
  double per_sample_s = 0;

  double at(int64_t m) const { return fixed_s + per_sample_s * static_cast<double>(m); }
  /// The line through two warm passes (m1, s1) and (m2, s2), m1 != m2. A negative slope (noise at two
  /// sizes that cost the same) is taken as 0, and a negative intercept as 0 with the slope through the
  /// larger point: never a pass that costs less than nothing. Throws std::invalid_argument when m1 == m2
  /// or a size is below 1.
  static PassCost through(int64_t m1, double s1, int64_t m2, double s2);
  /// {fixed_s, per_sample_s}
  nlohmann::json to_json() const;
};

/// Times a pass with an injected clock (seconds) and, around it, an injected synchronization (on CUDA,
/// the device's: queued kernels are not a pass's time until they ran). The trainer passes the steady
/// clock; tests pass a fake one.
class PassTimer {
 public:
  using Clock = std::function<double()>;
  explicit PassTimer(Clock clock, std::function<void()> sync = {});
  /// The steady clock's seconds, with `sync` around each pass.
  static PassTimer steady(std::function<void()> sync = {});
  /// sync, clock, pass, sync, clock: the seconds between the two clock readings.
  double time(const std::function<void()>& pass) const;
  /// The fewest seconds of `pass` timed again and again until the timed passes add up to `min_total_s`,
  /// `max_repeats` passes at most (at least one).
  double fastest(const std::function<void()>& pass, double min_total_s = kSpeedMinTimedS,
                 int64_t max_repeats = kSpeedMaxRepeats) const;

 private:
  Clock clock_;
  std::function<void()> sync_;
};

/// The micro-batch sizes of a probe at m on a batch of `batch` samples: m, and a second micro-batch
/// (min(m, batch - m)) when the step accumulates. MicroBatchSearcher::find's probe runs these.
std::vector<int64_t> probe_pass_sizes(int64_t m, int64_t batch);

/// Seconds that find_max_micro_batch(fits, lo, hi) is projected to spend in probes if every size up to
/// `largest` fits and none above, each probe priced at the sum of cost.at over probe_pass_sizes; the probe
/// at `lo` is not counted (it has run). Throws std::invalid_argument unless 1 <= lo <= hi <= batch.
double projected_doubling_s(const PassCost& cost, int64_t lo, int64_t hi, int64_t largest, int64_t batch);

/// Which search `auto` runs after its first two probes, and why.
struct SearchChoice {
  AutoSearch method = AutoSearch::kCurve;  ///< kDoubling | kCurve
  bool timed = false;            ///< false: the first probes were not timed (found before a restart)
  double projected_s = 0;        ///< doubling's projected seconds from the second probe on
  double budget_s = kAutoSearchBudgetS;
  PassCost cost;
  int64_t predicted = 0;  ///< the largest size the projection assumes fits
  std::string reason;     ///< one sentence for the log and the auto_micro_batch event
  /// {method, timed, projected_s, budget_s, cost, predicted, reason}
  nlohmann::json to_json() const;
};

/// `memory.auto_search: auto` after its first two probes, the floor `lo` and `second` (whether it fitted:
/// `second_fits`), with `cost` through their warm passes and `predicted` the largest size their peaks'
/// line puts under the limit (hi without a limit): doubling when projected_doubling_s of the rest (from
/// `second` up to `predicted` if it fitted, else from `lo` below `second`) is at most `budget_s`, the curve
/// otherwise. A projection equal to the budget is doubling.
SearchChoice choose_search(const PassCost& cost, int64_t lo, int64_t second, bool second_fits, int64_t hi,
                           int64_t predicted, int64_t batch, double budget_s = kAutoSearchBudgetS);

/// The choice when the first probes carry no timing (their outcomes were read back after a restart): the
/// curve, the search for dear probes, whose few probes a stopped search most likely needed.
SearchChoice untimed_search_choice();

/// One size of the speed table.
struct SpeedPoint {
  int64_t micro_batch = 0;
  bool fits = false;         ///< its passes ran without running out of memory
  double samples_per_s = 0;  ///< micro_batch / the warm timed pass's seconds (0: not measured)
};

/// The size the job runs at, among those measured.
struct SpeedChoice {
  int64_t micro_batch = 0;
  int64_t largest = 0;             ///< the largest size that fits (the memory search's answer)
  std::vector<SpeedPoint> table;   ///< largest first
  std::string reason;
  /// {micro_batch, largest, margin, table: [{micro_batch, fits, samples_per_s}], reason}
  nlohmann::json to_json() const;
};

/// `largest` and its halvings (ceil(m / 2)), not below `floor`, largest first, at most kSpeedRungs sizes.
std::vector<int64_t> speed_candidates(int64_t largest, int64_t floor);

/// The prefix of `candidates` whose passes are projected to fit in `budget_s` together: a size in `warm`
/// (it ran already in this process) costs its timed passes, any other a warm-up pass too; the timed
/// passes of a size cost one pass, or kSpeedMinTimedS where that is more (PassTimer::fastest).
std::vector<int64_t> speed_sizes_within(const PassCost& cost, const std::vector<int64_t>& candidates,
                                        const std::set<int64_t>& warm, double budget_s = kSpeedBudgetS);

/// The largest size that fitted whose samples/s is at least fastest / (1 + margin), where fastest is the
/// best samples/s among the sizes that fitted: a smaller size wins only by more than the margin, a tie
/// goes to the larger, a size that did not fit is never chosen. `largest` when nothing was measured.
SpeedChoice choose_fastest(const std::vector<SpeedPoint>& table, int64_t largest, double margin = kSpeedMargin);

}  // namespace trainer
