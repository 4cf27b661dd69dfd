// The memory curve of a job: the peak tensor memory of one training step as a function of the
// micro-batch, fitted as fixed bytes (weights, gradients, optimizer state, the batch) plus bytes per
// sample (activations), and what it predicts: the largest micro-batch under a limit. `trainer bench
// --memory-curve` (tools/bench_curve.cpp) measures the points and writes them with their fits;
// `train.micro_batch: auto` may start its search at the prediction (memory.curve), and with
// `memory.activation_checkpointing: auto` take the setting the curve predicts faster (choose_setting).
// Pure arithmetic and one file reader; docs/MEMORY.md "The memory curve".
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
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
