// `trainer bench --profile FILE`: LibTorch's profiler over chosen optimizer steps of the real loop, written
// as a Chrome trace that bench/profile_table.py reads beside bench/reference.py's (docs/BENCHMARKS.md,
// "Profiling a step").
//
// What the trace holds: every ATen op (and its CUDA kernels, copies and runtime calls when the device is
// CUDA) of steps [first, last], each step inside a user scope "ProfilerStep#<step>" (1-based, as
// reference.py names its steps), spanning the loop's whole turn: fetch, step, record. Where LibTorch has
// Kineto (the pip wheels) its own Chrome trace is written; where it does not (Debian's 1.13) the
// collected events are written in the same format, CPU ops only (writer "events").
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "trainer/run/train.h"

namespace at {
struct RecordFunction;
}

namespace trainer::bench {

class StepProfiler : public StepObserver {
 public:
  /// Profiles steps first..last (1-based, first <= last) into `path`, recording CUDA activity too when
  /// `cuda`. The profiler is prepared one step ahead (at first - 1) when there is one, so that the
  /// start-up of CUPTI falls outside the profiled steps.
  StepProfiler(int64_t first, int64_t last, std::string path, bool cuda);
  /// Disables a profile that did not reach `last` (the run ended early); writes nothing then.
  ~StepProfiler() override;
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  void before_step(int64_t step) override;
  void after_step(int64_t step) override;

  /// True once the trace is written.
  bool written() const { return written_; }
  /// {trace, first_step, last_step, activities ["cpu"(, "cuda")], writer ("kineto" | "events"), events}
  /// for the bench result. Throws std::runtime_error when the trace was not written (names the steps).
  nlohmann::json describe() const;

 private:
  void finish();

  int64_t first_, last_;
  std::string path_;
  bool cuda_;
  bool prepared_ = false, enabled_ = false, written_ = false;
  std::string scope_name_;  // alive as long as scope_, which may keep a view of it
  std::unique_ptr<at::RecordFunction> scope_;
  std::string writer_;
  int64_t events_ = 0;
};

/// Writes `events` (name, start and duration in microseconds, thread, user scope or not) as a Chrome
/// trace {"traceEvents": [...]} with Kineto's field names (ph "X", cat "cpu_op" or "user_annotation",
/// ts, dur, pid, tid), for a LibTorch whose profiler cannot save one. Throws std::runtime_error naming
/// `path` when it cannot be written.
struct TraceEvent {
  std::string name;
  double start_us = 0, duration_us = 0;
  uint64_t thread = 0;
  bool user_scope = false;
};
void write_chrome_trace(const std::string& path, const std::vector<TraceEvent>& events, const std::string& trace_name);

}  // namespace trainer::bench
