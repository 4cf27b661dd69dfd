// The memory curve of a job: the peak tensor memory of one training step as a function of the
// micro-batch, fitted as fixed bytes (weights, gradients, optimizer state, the batch) plus bytes per
// sample (activations), and what it predicts: the largest micro-batch under a limit. `trainer bench
// --memory-curve` (tools/bench_curve.cpp) measures the points and writes them with their fits;
// `train.micro_batch: auto` may start its search at the prediction (memory.curve). Pure arithmetic
// and one file reader; docs/MEMORY.md "The memory curve".
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace trainer {

/// One measured point: the largest step peak (bytes) of a run at a micro-batch.
struct CurvePoint {
  int64_t micro_batch = 0;
  int64_t peak_bytes = 0;
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

/// What the trainer reads back from a `trainer bench --memory-curve` result: the job it was measured
/// on and the fit per activation checkpointing setting ("none", "all").
struct MemoryCurve {
  std::string path;
  std::string model;
  std::vector<int64_t> sample_shape;
  std::string precision;  ///< fp32 | bf16 | fp16
  std::map<std::string, MemoryFit> fits;
};

/// Reads `path` (the JSON of `trainer bench --memory-curve`: model, sample_shape, precision and
/// curves.<setting>.fit.{fixed_bytes, per_sample_bytes}). Throws std::runtime_error naming the file
/// when it cannot be read or is not such a result.
MemoryCurve read_memory_curve(const std::string& path);

}  // namespace trainer
