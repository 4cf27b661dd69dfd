#include "tools/bench/bench_profile.h"

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include <spdlog/spdlog.h>

#include <fstream>
#include <set>
#include <stdexcept>

#include "common/compat.h"
#include "common/log.h"

namespace trainer::bench {

namespace kp = torch::autograd::profiler;
namespace pi = torch::profiler::impl;

namespace {

pi::ProfilerConfig profiler_config() {
  return pi::ProfilerConfig(pi::ProfilerState::KINETO, /*report_input_shapes=*/false, /*profile_memory=*/false,
                            /*with_stack=*/false, /*with_flops=*/false, /*with_modules=*/false);
}

std::set<pi::ActivityType> activities(bool cuda) {
  std::set<pi::ActivityType> a{pi::ActivityType::CPU};
  if (cuda) a.insert(pi::ActivityType::CUDA);
  return a;
}

}  // namespace

void write_chrome_trace(const std::string& path, const std::vector<TraceEvent>& events, const std::string& trace_name) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& e : events)
    list.push_back({{"ph", "X"},
                    {"cat", e.user_scope ? "user_annotation" : "cpu_op"},
                    {"name", e.name},
                    {"pid", 0},
                    {"tid", e.thread},
                    {"ts", e.start_us},
                    {"dur", e.duration_us},
                    {"args", nlohmann::json::object()}});
  std::ofstream f(path);
  f << nlohmann::json{{"traceName", trace_name}, {"displayTimeUnit", "ms"}, {"traceEvents", list}}.dump() << '\n';
  if (!f.flush()) throw std::runtime_error(path + ": cannot write the profile trace");
}

StepProfiler::StepProfiler(int64_t first, int64_t last, std::string path, bool cuda)
    : first_(first), last_(last), path_(std::move(path)), cuda_(cuda) {
  if (first < 1 || last < first)
    throw std::invalid_argument("StepProfiler: steps must satisfy 1 <= first <= last, got " + std::to_string(first) +
                                ".." + std::to_string(last));
}

StepProfiler::~StepProfiler() {
  scope_.reset();
  if (enabled_) {
    try {
      kp::disableProfiler();
    } catch (const std::exception& e) {
      spdlog::warn("profiler: could not be disabled after an unfinished profile: {}", error_message(e));
    }
  }
}

void StepProfiler::before_step(int64_t step) {
  if (!prepared_ && (step == first_ - 1 || step == first_)) {
    kp::prepareProfiler(profiler_config(), activities(cuda_));
    prepared_ = true;
  }
  if (step == first_) {
    kp::enableProfiler(profiler_config(), activities(cuda_));
    enabled_ = true;
  }
  if (enabled_ && step >= first_ && step <= last_) {
    // The name reference.py gives its steps, and torch.profiler's schedule its own.
    scope_name_ = "ProfilerStep#" + std::to_string(step);
    scope_ = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
    if (scope_->isActive()) scope_->before(scope_name_.c_str());
  }
}

void StepProfiler::after_step(int64_t step) {
  if (!enabled_ || step < first_ || step > last_) return;
  scope_.reset();  // ends the step's scope
  if (step == last_) finish();
}

void StepProfiler::finish() {
  std::unique_ptr<kp::ProfilerResult> result = kp::disableProfiler();
  enabled_ = false;
  events_ = static_cast<int64_t>(result->events().size());
  try {
    result->save(path_);
    writer_ = "kineto";
  } catch (const c10::Error& e) {
    // Debian's LibTorch 1.13 is built without Kineto: its profiler collects the CPU events but cannot
    // save them ("requires ... Kineto support"). Write them in Kineto's format ourselves.
    spdlog::info("profiler: LibTorch cannot save a trace ({}); writing its {} CPU events instead",
                 error_message(e).substr(0, 120), events_);
    std::vector<TraceEvent> events;
    events.reserve(result->events().size());
    for (const auto& ev : result->events()) {
      if (ev.deviceType() != c10::DeviceType::CPU) continue;
      events.push_back({ev.name(), compat::profiler_event_start_us(ev), compat::profiler_event_duration_us(ev),
                        ev.startThreadId(), ev.scope() == static_cast<uint8_t>(at::RecordScope::USER_SCOPE)});
    }
    write_chrome_trace(path_, events, "trainer bench --profile (LibTorch " + compat::torch_version() + ", events)");
    writer_ = "events";
  }
  written_ = true;
  spdlog::info("profiler: steps {}..{} ({} events) -> {} ({})", first_, last_, events_, path_, writer_);
}

nlohmann::json StepProfiler::describe() const {
  if (!written_)
    throw std::runtime_error("bench --profile: the run ended before step " + std::to_string(last_) +
                             "; no trace was written to " + path_);
  nlohmann::json a = nlohmann::json::array({"cpu"});
  if (cuda_) a.push_back("cuda");
  return {{"trace", path_}, {"first_step", first_}, {"last_step", last_}, {"activities", a},
          {"writer", writer_}, {"events", events_}};
}

}  // namespace trainer::bench
