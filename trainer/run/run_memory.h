// The run's memory, one part of TrainingRun (run.h): the backend that counts and caps the tensors
// (trainer/memory/backend.h), the cap followed between steps (LimitFollower, limit_follower.h; control.yaml)
// and the lowest cap over all ranks that the ladder decides against, and what the first step needs first:
// train.micro_batch: auto's search (with memory.curve's prediction) and memory.cudnn_policy pretune.
// What poll() (limits.cpp) and the auto micro-batch (auto_batch.cpp) read.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "trainer/config/config.h"
#include "trainer/dist/dist.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/curve.h"
#include "trainer/memory/oom.h"
#include "trainer/memory/resources.h"
#include "trainer/run/limit_follower.h"

namespace trainer {

class RunMemory {
 public:
  explicit RunMemory(const Config& cfg) : cfg_(cfg) {}

  /// cuDNN's benchmark flag off until the step sets it; how a timing runs (memory.cudnn_benchmark_limit,
  /// memory.cudnn_empty_cache), once.
  void tune_cudnn();
  /// The backend of `device`, before the model exists so every tensor is counted.
  void make_backend(const torch::Device& device);
  /// memory.limit resolved and installed, and control.yaml in `run_dir` watched.
  void install_limit(const std::string& run_dir, bool cuda);
  /// Between steps: control.yaml (a memory.limit it names) and, under `auto`, what bounds the cap,
  /// `since_start_s` into the run; the cap installed again when it moved.
  void poll_limit(double since_start_s);
  /// The lowest cap over all ranks (`dist` null: this one's) into agreed_limit(); whether any rank's
  /// batch did not fit (this one's: `batch_failed`).
  bool agree_on_limit(bool batch_failed, Distributed* dist);
  /// train.micro_batch: auto: the search before the first step, and memory.curve read for it (its job is
  /// checked against this one's model, `sample_shape` and precision).
  void plan_micro_batch_search(const std::vector<int64_t>& sample_shape);
  /// Where the auto search starts: the curve's prediction for `rank_batch` samples under the agreed limit,
  /// with activation checkpointing or without (0 = no curve).
  int64_t curve_start(bool checkpointing, int64_t rank_batch) const;
  /// memory.activation_checkpointing: sets co.checkpointing; returns where the choice came from.
  std::string choose_checkpointing(MicroBatchOptions& co, int64_t rank_batch) const;

  MemoryBackend& backend() const { return *memory_; }
  LimitFollower& limit() const { return *limit_; }
  int64_t agreed_limit() const { return agreed_limit_; }  ///< the lowest cap over all ranks (0 = none)
  bool need_micro_batch_search() const { return need_micro_batch_search_; }
  void set_need_micro_batch_search(bool need) { need_micro_batch_search_ = need; }
  bool need_pretune() const { return need_pretune_; }
  void pretuned() { need_pretune_ = false; }
  bool cudnn_empty_cache_switch() const { return cudnn_empty_cache_switch_; }

 private:
  void load_memory_curve(const std::vector<int64_t>& sample_shape);

  const Config& cfg_;
  std::unique_ptr<MemoryBackend> memory_;
  std::unique_ptr<ControlFile> control_;
  // Declared after memory_, which it caps: destroyed before it.
  std::unique_ptr<LimitFollower> limit_;  // memory.limit: this process's cap, followed (limit_follower.h)
  int64_t agreed_limit_ = 0;          // the lowest cap over all ranks (0 = none): what the ladder sees
  bool need_micro_batch_search_ = false;  // train.micro_batch: auto, before the first step
  bool need_pretune_ = true;              // memory.cudnn_policy pretune: once, before this process's first step
  bool cudnn_empty_cache_switch_ = false; // this LibTorch has the switch memory.cudnn_empty_cache sets
  std::optional<MemoryCurve> curve_;      // memory.curve, read when the auto search will run
};

}  // namespace trainer
