// The memory curve of a job: the peak tensor memory of one training step as a function of the
// micro-batch, fitted as fixed bytes (weights, gradients, optimizer state, the batch) plus bytes per
// sample (activations), and what it predicts: the largest micro-batch under a limit. `trainer bench
// --memory-curve` (tools/bench/bench_curve.cpp) measures the points and writes them with their fits;
// `train.micro_batch: auto` may start its search at the prediction (memory.curve), and with
// `memory.activation_checkpointing: auto` take the setting the curve predicts faster (choose_setting).
// Pure arithmetic and one file reader; docs/MEMORY.md "The memory curve".
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace trainer {

/// One measured point: the largest step peak (bytes) of a run at a micro-batch, and its speed.
struct CurvePoint {
  int64_t micro_batch = 0;
  int64_t peak_bytes = 0;
  double samples_per_s = 0;  ///< the run's median step, in samples per second (0: not measured)
};

/// peak(m) ~ fixed_bytes + per_sample_bytes * m, by ordinary least squares.
struct MemoryFit {
  double fixed_bytes = 0;
  double per_sample_bytes = 0;
  std::vector<double> residuals_bytes;  ///< measured - fitted, one per point, in the points' order
  double max_abs_residual_bytes = 0;
  double rms_residual_bytes = 0;

  /// The fitted peak at micro-batch m (bytes).
  double peak_at(int64_t m) const { return fixed_bytes + per_sample_bytes * static_cast<double>(m); }
  /// {fixed_bytes, per_sample_bytes, residuals_bytes, max_abs_residual_bytes, rms_residual_bytes}.
  nlohmann::json to_json() const;
};

/// Least-squares fit of the points (at least two distinct micro-batches, or std::invalid_argument).
MemoryFit fit_memory_curve(const std::vector<CurvePoint>& points);

/// The largest micro-batch in [0, hi] whose fitted peak is at most `limit_bytes`:
/// floor((limit - fixed) / per_sample), clamped to [0, hi]; 0 when not even one sample fits; hi when
/// limit_bytes is 0 (no limit) or the fit does not grow with the micro-batch.
int64_t predict_max_micro_batch(const MemoryFit& fit, int64_t limit_bytes, int64_t hi);

/// Samples/s at micro-batch m, from points sorted by micro-batch: linear between the two around m, the
/// nearest end's outside them; 0 without points.
double interpolate_samples_per_s(const std::vector<CurvePoint>& points, int64_t m);

// ---- the auto search from the curve of its own probes --------------------------------------------------

/// What one probe of the auto search found: whether the micro-batch fitted under the cap and, if it did,
/// the probe's peak tensor bytes.
struct ProbeOutcome {
  bool fits = false;
  int64_t peak_bytes = 0;
};

/// Why a probe runs: to measure a point of the curve (the floor, a second size), to confirm a prediction
/// (the size the search will likely return, and the run start at), or to bisect what a prediction left.
enum class ProbeRole { kCalibrate, kConfirm, kBisect };

/// "calibrate", "confirm", "bisect".
const char* to_string(ProbeRole role);

struct ProbeRecord {
  int64_t micro_batch = 0;
  ProbeRole role = ProbeRole::kCalibrate;
  bool fits = false;
  int64_t peak_bytes = 0;
};

/// What find_max_micro_batch_by_curve did.
struct CurveSearch {
  int64_t micro_batch = 0;          ///< the largest size that fitted in a probe (0: not even the floor)
  std::vector<ProbeRecord> probes;  ///< in the order they ran
  /// How it ended: "floor" (the floor did not fit), "whole" (the largest size allowed fitted),
  /// "predicted" (a confirmed prediction the refitted curve puts within kPredictedAccept of the largest),
  /// "bracket" (within `accept` of the smallest size that failed).
  std::string ended;
  /// {micro_batch, ended, probes: [{micro_batch, role, fits, peak_bytes}]}.
  nlohmann::json to_json() const;
};

/// The second size the search measures: 8 x the floor (clamped to the range). Larger than 2 or 4 so that
/// the slope is not lost in the allocator's rounding and in workspaces that change with the size.
inline constexpr int64_t kCurveSecondPoint = 8;
/// At most this many rounds of prediction and confirmation before the search bisects what is left.
inline constexpr int64_t kCurveMaxConfirms = 3;
/// A confirmed prediction is kept when the refitted line puts the largest size that fits at most
/// 1 / kPredictedAccept above it (a tighter bound than a bracket's `accept`: it rests on the line).
inline constexpr double kPredictedAccept = 0.95;


/// `train.micro_batch: auto` in a few probes (memory.auto_search: curve): the largest size in [lo, hi]
/// that fits, to within `accept` (0.9: at least 90% of the largest size that fits, if fitting is monotone
/// in the size), from a straight-line fit of the probes' peaks:
///   1. probe lo and min(hi, kCurveSecondPoint x lo) and fit peak = fixed + per_sample x m;
///   2. probe the size that fit predicts under `limit_bytes` (a confirm probe). If it fits, refit with it
///      (a point near the limit: what is left is interpolation) and stop when the new prediction is at most
///      1 / kPredictedAccept above it; if it fails, probe ceil(accept x (failed - 1)): if that fits it is
///      within `accept` of the largest, which is below the failure;
///   3. after kCurveMaxConfirms rounds, or when a prediction fails twice, bisect between the largest size
///      that fitted and the smallest that failed until the first is within `accept` of the second.
/// Three to five probes where the peak is close to a line (the second and the confirm probes are the only
/// large ones), against 2 x log2(hi / lo) for doubling and bisecting. The answer is always a size that
/// fitted in a probe, never an unprobed prediction. A size is probed once. `probe(m, role)` runs the
/// probe (MicroBatchSearcher::find, trainer/step/search.h: the step's worst micro-batch under the cap). With no limit
/// (`limit_bytes` 0) the prediction is hi. Throws std::invalid_argument unless 1 <= lo <= hi and
/// 0 < accept < 1.
CurveSearch find_max_micro_batch_by_curve(const std::function<ProbeOutcome(int64_t, ProbeRole)>& probe, int64_t lo,
                                          int64_t hi, int64_t limit_bytes, double accept = 0.9);

/// What the trainer reads back from a `trainer bench --memory-curve` result: the job it was measured
/// on, and per activation checkpointing setting ("none", "all") the points and their fit.
struct MemoryCurve {
  std::string path;
  std::string model;
  std::vector<int64_t> sample_shape;
  std::string precision;  ///< fp32 | bf16 | fp16
  std::map<std::string, MemoryFit> fits;                 ///< settings with two or more points
  std::map<std::string, std::vector<CurvePoint>> points;  ///< every setting measured, by micro-batch
};

/// The micro-batch and the activation checkpointing setting, predicted together under a limit.
struct CurveChoice {
  std::string setting = "neither";  ///< "none" | "all" | "neither" (nothing predicted to fit)
  int64_t micro_batch = 0;          ///< predict_max_micro_batch of that setting's fit
  double samples_per_s = 0;         ///< interpolate_samples_per_s at that micro-batch
};

/// Per setting with a fit ("none" first, then "all"): the largest micro-batch in [0, hi] predicted to fit
/// under `limit_bytes` and the samples/s the points give there; the faster wins, "none" on a tie (it
/// recomputes nothing). "neither" when no setting has a micro-batch of 1 or more with a measured speed.
CurveChoice choose_setting(const MemoryCurve& curve, int64_t limit_bytes, int64_t hi);

/// Reads `path` (the JSON of `trainer bench --memory-curve`: model, sample_shape, precision and
/// curves.<setting>.{points[].{micro_batch, peak_bytes, samples_per_s}, fit.{fixed_bytes,
/// per_sample_bytes}}). Throws std::runtime_error naming the file when it cannot be read or is not such a
/// result.
MemoryCurve read_memory_curve(const std::string& path);

}  // namespace trainer
