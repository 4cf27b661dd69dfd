// The memory plan of a job, before anything is allocated: the bytes that do not depend on the micro-batch
// (weights, gradients, optimizer state, the EMA, the batches in flight), the bytes per sample (activations
// and the sample itself, without and with every block recomputed), and against a cap the rung the OOM
// ladder will settle on: the micro-batch, and whether activations are recomputed. Pure arithmetic on what
// trainer/run/memory_plan.h counts from the config and the model's shape (models/footprint.h); `trainer
// plan` and `trainer --dry-run` print it. docs/MEMORY.md "The memory plan".
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace trainer {

/// One row of the plan: what, how many bytes, and how they were counted.
struct PlanLine {
  std::string what;
  int64_t bytes = 0;
  std::string how;
};

/// What the plan is computed from.
struct PlanJob {
  std::vector<PlanLine> fixed;              ///< bytes that do not depend on the micro-batch, gradients aside
  /// The gradients, all parameters': they are freed after each update (set to none), so a step of one
  /// micro-batch holds them only as its backward makes them, while it frees the activations; a step of
  /// several holds them through every micro-batch after the first.
  int64_t gradient_bytes = 0;
  /// The largest parameter's gradient as its backward makes it, before it is added to what is there (both
  /// of a tied weight's: the embedding's and the output projection's).
  int64_t largest_gradient_bytes = 0;
  double per_sample_bytes = 0;              ///< activations and the sample itself, nothing recomputed
  double per_sample_checkpointed_bytes = 0; ///< the same with every block recomputed in backward
  int64_t rank_batch = 1;                   ///< samples per step on one rank (the global batch / ranks)
  int64_t micro_batch = 0;                  ///< the micro-batch the run starts at; 0: train.micro_batch auto
  int64_t min_micro_batch = 1;              ///< the ladder's floor
  bool checkpointing = false;               ///< every block recomputed from the start
  bool ladder_checkpointing = true;         ///< the ladder may turn recomputation on at the floor
  int64_t cap = 0;                          ///< the tensor memory the run may use; 0: no cap
};

/// The rung the job is planned to run on, and its peak.
struct MemoryPlan {
  int64_t fixed_bytes = 0;       ///< sum of the fixed lines (gradients aside)
  int64_t cap = 0;               ///< the job's cap (0: none)
  bool fits = false;             ///< some rung's peak is at most the cap (always, without a cap)
  int64_t micro_batch = 0;       ///< the rung's micro-batch (the floor when nothing fits)
  int64_t accum_steps = 0;       ///< micro-batches per step at that size
  bool checkpointing = false;    ///< the rung recomputes activations
  int64_t peak_bytes = 0;        ///< fixed + micro_batch x per-sample bytes of that rung
  int64_t start_peak_bytes = 0;  ///< the peak at the micro-batch the run starts at (fixed micro-batch only)
  int64_t short_bytes = 0;       ///< when nothing fits: how far the smallest rung's peak is over the cap
  std::string rung;              ///< one line: "micro-batch 64 (x4), activations kept" and the like
};

/// The planned peak of a step at micro-batch m with per-sample bytes `per_sample`: fixed + the largest
/// gradient + (several micro-batches) gradients + m x per_sample, or (one) the larger of the two.
int64_t planned_peak(const PlanJob& job, double per_sample, int64_t m);

/// Plans `job`: with a fixed micro-batch m, the first size the ladder reaches by halving from m (rounded
/// up, not below the floor) whose peak is at most the cap, activations kept; else the largest of those
/// sizes that fits with every block recomputed, when the ladder may turn recomputation on (or it is on
/// from the start). With `auto`, the largest micro-batch in [floor, rank_batch] whose peak fits, kept
/// before recomputed. Without a cap the starting size fits. Throws std::invalid_argument for a batch,
/// floor or micro-batch out of order.
MemoryPlan plan_memory(const PlanJob& job);

/// The plan as a table for a terminal: one row per fixed line, the per-sample rows, the rung and its peak
/// against the cap, and "does not fit" with the shortfall when nothing fits.
std::string render_plan(const PlanJob& job, const MemoryPlan& plan);

/// {fixed: [{what, bytes, how}], fixed_bytes, per_sample_bytes, per_sample_checkpointed_bytes, cap, fits,
/// micro_batch, accum_steps, checkpointing, peak_bytes, start_peak_bytes, short_bytes, rung}.
nlohmann::json plan_to_json(const PlanJob& job, const MemoryPlan& plan);

}  // namespace trainer
