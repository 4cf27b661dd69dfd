#include "trainer/step/cudnn_policy.h"

#include "common/compat.h"
#include "trainer/memory/oom.h"

#include <ATen/Context.h>

#include <algorithm>
#include <stdexcept>

namespace trainer {

namespace {

std::string list_text(const std::vector<int64_t>& v) {
  std::string s;
  for (int64_t x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
  return s;
}

}  // namespace

const char* to_string(CudnnAttempt attempt) {
  switch (attempt) {
    case CudnnAttempt::kStep: return "step";
    case CudnnAttempt::kCalibrationProbe: return "calibration_probe";
    case CudnnAttempt::kConfirmProbe: return "confirm_probe";
    case CudnnAttempt::kPretune: return "pretune";
  }
  return "step";
}

std::vector<int64_t> distinct_sizes(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> out(sizes);
  std::sort(out.begin(), out.end(), std::greater<int64_t>());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

nlohmann::json CudnnDecision::to_json() const {
  return {{"event", "cudnn"},       {"attempt", to_string(attempt)}, {"sizes", sizes},
          {"new_sizes", new_sizes}, {"tuned_sizes", tuned_sizes()},  {"benchmark", benchmark},
          {"retry", retry},         {"reason", reason}};
}

CudnnPolicy::CudnnPolicy(const CudnnPolicyOptions& options) : opt_(options) {
  if (opt_.settle_steps < 1)
    throw std::invalid_argument("cuDNN policy: settle_steps must be >= 1, got " + std::to_string(opt_.settle_steps));
}

bool CudnnPolicy::benchmark_for(CudnnAttempt attempt, const std::vector<int64_t>& sizes,
                                const std::vector<int64_t>& fresh, std::string& reason) {
  const bool first_step = attempt == CudnnAttempt::kStep && !first_step_decided_;
  if (attempt == CudnnAttempt::kStep) first_step_decided_ = true;
  const std::string what = fresh.empty() ? "" : "micro-batch " + list_text(fresh);
  switch (opt_.mode) {
    case CudnnMode::kAlways:
      reason = fresh.empty() ? "benchmark mode is always on" : "benchmark mode is always on: timing " + what;
      return true;
    case CudnnMode::kOff:
      reason = "benchmark mode is off: the heuristics choose " + (fresh.empty() ? "nothing new" : what);
      return false;
    case CudnnMode::kStart:
    case CudnnMode::kPretune:
      if (fresh.empty()) {
        reason = "no new size";
        return false;
      }
      if (first_step) {
        reason = "the run starts at " + what + ": timing it";
        return true;
      }
      if (attempt == CudnnAttempt::kConfirmProbe) {
        reason = "the search's prediction " + what + " may be where the run starts: timing it";
        return true;
      }
      if (attempt == CudnnAttempt::kPretune) {
        reason = "pretuning " + what + ", a size the ladder can back off to";
        return true;
      }
      reason = "a new size " + what + " after the start: the heuristics choose, nothing waits for timing";
      return false;
    case CudnnMode::kSettle: {
      if (!fresh.empty() || attempt != CudnnAttempt::kStep) {
        reason = fresh.empty() ? "no new size" : "a new size " + what + ": the heuristics until it has held";
        return false;
      }
      std::vector<int64_t> due;
      for (int64_t s : sizes)
        if (!settled_.count(s) && held_.count(s) && held_.at(s) >= opt_.settle_steps) due.push_back(s);
      if (due.empty()) {
        reason = "no size due";
        return false;
      }
      for (int64_t s : due) settled_.insert(s);
      reason = "micro-batch " + list_text(due) + " held " + std::to_string(opt_.settle_steps) +
               " clean steps: one step with benchmark on";
      return true;
    }
  }
  return false;
}

CudnnDecision CudnnPolicy::decide(CudnnAttempt attempt, const std::vector<int64_t>& sizes) {
  for (int64_t s : sizes)
    if (s < 1) throw std::invalid_argument("cuDNN policy: a micro-batch size must be >= 1, got " + std::to_string(s));
  CudnnDecision d;
  d.attempt = attempt;
  d.sizes = distinct_sizes(sizes);
  for (int64_t s : d.sizes)
    if (!used_.count(s)) d.new_sizes.push_back(s);
  if (retry_pending_) {
    // The sizes are used now (their first attempt chose plans for some layers): the flag only decides
    // what the remaining layers get, and here that is the heuristics.
    retry_pending_ = false;
    d.retry = true;
    d.benchmark = false;
    d.reason = "the attempt that timed micro-batch " + list_text(last_.tuned_sizes()) +
               " ran out of memory: running it again with the heuristics before backing off";
    if (attempt == CudnnAttempt::kStep) first_step_decided_ = true;
  } else {
    d.benchmark = benchmark_for(attempt, d.sizes, d.new_sizes, d.reason);
  }
  for (int64_t s : d.new_sizes) {
    used_.insert(s);
    if (d.benchmark) tuned_.insert(s);
  }
  last_ = d;
  has_last_ = true;
  if (!d.new_sizes.empty() || d.retry || (d.benchmark && opt_.mode != CudnnMode::kAlways)) pending_.push_back(d);
  return d;
}

bool CudnnPolicy::on_oom() {
  if (!has_last_ || !opt_.retry_tuning_oom || opt_.mode == CudnnMode::kAlways) return false;
  if (last_.retry || last_.tuned_sizes().empty()) return false;
  retry_pending_ = true;
  return true;
}

void CudnnPolicy::on_clean_step(const std::vector<int64_t>& sizes) {
  const std::vector<int64_t> now = distinct_sizes(sizes);
  std::map<int64_t, int64_t> held;
  for (int64_t s : now) held[s] = (held_.count(s) ? held_.at(s) : 0) + 1;
  held_.swap(held);
}

std::vector<int64_t> CudnnPolicy::pretune_sizes(int64_t global, int64_t start, int64_t floor) const {
  if (opt_.mode != CudnnMode::kPretune) return {};
  if (floor < 1 || start < floor || global < start)
    throw std::invalid_argument("cuDNN policy: pretune needs 1 <= floor <= start <= global, got " +
                                std::to_string(floor) + ", " + std::to_string(start) + ", " + std::to_string(global));
  const std::vector<int64_t> own = split_batch(global, start);
  std::set<int64_t> out;
  int64_t m = start;
  for (int64_t r = 0; r < kPretuneRungs && m > floor; ++r) {
    m = std::max(floor, (m + 1) / 2);  // the ladder's halving (MicroBatchController::on_oom)
    for (int64_t s : split_batch(global, m))
      if (!used_.count(s) && std::find(own.begin(), own.end(), s) == own.end()) out.insert(s);
  }
  return distinct_sizes({out.begin(), out.end()});
}

std::vector<CudnnDecision> CudnnPolicy::take_decisions() {
  std::vector<CudnnDecision> out;
  out.swap(pending_);
  return out;
}

void set_cudnn_benchmark(bool on) { at::globalContext().setBenchmarkCuDNN(on); }

bool set_cudnn_tuning(int64_t benchmark_limit, bool empty_cache_after_benchmark) {
  if (benchmark_limit < 0)
    throw std::invalid_argument("cuDNN benchmark limit must be >= 0 (0: LibTorch's default), got " +
                                std::to_string(benchmark_limit));
  // LibTorch's own default is 10 plans; 0 here means "leave it".
  at::globalContext().setBenchmarkLimitCuDNN(benchmark_limit > 0 ? static_cast<int>(benchmark_limit) : 10);
  return compat::set_cudnn_benchmark_empty_cache(empty_cache_after_benchmark);
}

}  // namespace trainer
