// RunMemory: the run's memory, its cap agreed over ranks, and what the first step needs first
// (run_memory.h).
#include "trainer/run/run_memory.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>

#include "trainer/memory/report.h"
#include "trainer/run/from_config.h"
#include "trainer/step/cudnn_policy.h"

namespace fs = std::filesystem;

namespace trainer {

void RunMemory::tune_cudnn() {
  // cuDNN's benchmark flag is the step's to set, attempt by attempt (memory.cudnn_policy, Step::apply_cudnn);
  // off until then. How a timing runs is set once here.
  set_cudnn_benchmark(false);
  cudnn_empty_cache_switch_ = set_cudnn_tuning(cfg_.memory.cudnn_benchmark_limit, cfg_.memory.cudnn_empty_cache);
}

void RunMemory::make_backend(const torch::Device& device) {
  // The cap is installed before the model exists so every tensor is counted. PhasePeakBackend measures
  // the per-phase peaks the memory reports list.
  memory_ = std::make_unique<PhasePeakBackend>(make_memory_backend(device));
}

void RunMemory::install_limit(const std::string& run_dir, bool cuda) {
  limit_ = LimitFollower::make(cfg_, *memory_, cuda);
  agreed_limit_ = limit_->install();
  control_ = std::make_unique<ControlFile>((fs::path(run_dir) / "control.yaml").string());
}

void RunMemory::poll_limit(double since_start_s) {
  // control.yaml is how an operator (or a container resize hook) changes the cap of a running job; under
  // `auto` the follower also reads again what bounds the cap (limit_follower.h).
  ControlPoll poll = control_->poll();
  if (!poll.warning.empty()) spdlog::warn("{}", poll.warning);
  std::optional<std::string> spec;
  if (poll.update && poll.update->memory_limit) spec = *poll.update->memory_limit;
  limit_->poll(spec, since_start_s);
}

bool RunMemory::agree_on_limit(bool batch_failed, Distributed* dist) {
  // Every rank's ladder must take the same decisions, so it sees the same inputs: the lowest cap of all
  // ranks (each rank's allocator still enforces its own). The same collective says whether any rank's
  // batch did not fit.
  const int64_t limit = limit_->bytes();
  agreed_limit_ = limit;
  if (!dist) return batch_failed;
  auto a = dist->all_max({limit > 0 ? -static_cast<double>(limit) : -1e300, batch_failed ? 1.0 : 0.0},
                         "the memory limit agreement");
  agreed_limit_ = a[0] <= -1e299 ? 0 : static_cast<int64_t>(-a[0]);
  return a[1] > 0;
}

void RunMemory::plan_micro_batch_search(const std::vector<int64_t>& sample_shape) {
  need_micro_batch_search_ = cfg_.train.micro_batch == -1;
  if (need_micro_batch_search_ && agreed_limit_ == 0)
    spdlog::warn("train.micro_batch auto with no memory limit (memory.limit: {}): nothing bounds the search, which "
                 "takes the whole batch, and the kernel may kill the run; set memory.limit to auto or a size",
                 limit_->spec().empty() ? "none" : limit_->spec());
  if (need_micro_batch_search_ && !cfg_.memory.curve.empty()) load_memory_curve(sample_shape);
}

void RunMemory::load_memory_curve(const std::vector<int64_t>& sample_shape) {
  // A curve of another job would only start the search far off (the answer is the search's either way),
  // but it is almost certainly a wrong path: say so rather than run slowly.
  MemoryCurve c = read_memory_curve(cfg_.memory.curve);
  auto describe = [](const std::string& model, const std::vector<int64_t>& shape, const std::string& precision) {
    std::string s = model + " on ";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? "x" : "") + std::to_string(shape[i]);
    return s + " in " + precision;
  };
  const std::string job = describe(cfg_.model.name, sample_shape, precision_of(cfg_));
  const std::string measured = describe(c.model, c.sample_shape, c.precision);
  if (job != measured)
    throw ConfigError("memory.curve: " + c.path + " was measured for " + measured + ", and this job is " + job +
                      "; measure this job with trainer bench --memory-curve");
  curve_ = std::move(c);
}

int64_t RunMemory::curve_start(bool checkpointing, int64_t rank_batch) const {
  if (!curve_ || cfg_.memory.activation_checkpointing == Checkpointing::kEveryK) return 0;  // no curve of that setting
  const auto it = curve_->fits.find(checkpointing ? "all" : "none");
  if (it == curve_->fits.end()) return 0;
  // Predicted not to fit at all: start at the floor, which the search then checks first.
  return std::max<int64_t>(1, predict_max_micro_batch(it->second, agreed_limit_, rank_batch));
}

std::string RunMemory::choose_checkpointing(MicroBatchOptions& co, int64_t rank_batch) const {
  // memory.activation_checkpointing: auto picks the setting with the size, before the first step: the
  // memory curve's faster setting under the limit; without a curve (or where it predicts nothing fits),
  // recomputation only where not even the floor fits without it, the ladder's order. Every rank reaches
  // the same choice: the curve, the agreed limit and the search's outcome are the same on all.
  if (cfg_.memory.activation_checkpointing != Checkpointing::kAuto) return "config";
  if (curve_) {
    const CurveChoice c = choose_setting(*curve_, agreed_limit_, rank_batch);
    if (c.setting != "neither") {
      co.checkpointing = c.setting == "all";
      return "curve";
    }
  }
  return "floor_fits";
}

}  // namespace trainer
