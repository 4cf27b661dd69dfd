#include "tools/bench/bench_job.h"

#include <torch/torch.h>

#include <cstdlib>
#include <stdexcept>

#include "common/log.h"
#include "tools/bench/host_info.h"
#include "tools/metrics_watch.h"
#include "trainer/dist/dist.h"
#include "trainer/run/from_config.h"
#include "trainer/run/train.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace trainer::bench {

std::string device_name(const Config& cfg) {
  torch::Device d = resolve_device(cfg.train.device);
  if (d.is_cuda() && !d.has_index()) d = torch::Device(torch::kCUDA, 0);
  return d.str();
}

int threads_of(const Config& cfg) { return cpu_threads(cfg, /*local_world_size=*/1); }

void check_counts(const BenchOptions& opts) {
  if (opts.warmup < 0)
    throw std::invalid_argument("bench: --warmup must be >= 0, got " + std::to_string(opts.warmup));
  if (opts.steps < 1) throw std::invalid_argument("bench: --steps must be >= 1, got " + std::to_string(opts.steps));
}

json describe_run(const Config& cfg, const std::string& config_path, const std::vector<std::string>& overrides,
                  const std::string& command_line) {
  json j;
  j["schema"] = kBenchSchema;
  j["implementation"] = "trainer";
  j["model"] = cfg.model.name;
  j["sample_shape"] = sample_shape(cfg);
  j["global_batch"] = cfg.train.global_batch;
  j["config_file"] = config_path;
  j["overrides"] = overrides;
  j["command_line"] = command_line;
  return j;
}

void RunFolder::check_not_held(const std::string& dir) {
  if (dir.empty()) return;
  if (auto holder = RunFolderLock::held_by_other(dir)) throw RunFolderBusy(RunFolderLock::busy_message(dir, *holder, 0));
}

RunFolder RunFolder::make(const std::string& dir, const std::string& prefix) {
  if (!dir.empty()) {
    RunLockOptions lo;
    lo.command = prefix;
    return {dir, false, RunFolderLock::acquire(dir, lo)};
  }
  std::string tmpl = (fs::temp_directory_path() / (prefix + "-XXXXXX")).string();
  if (!mkdtemp(tmpl.data())) throw std::runtime_error(tmpl + ": cannot create a temporary run folder");
  return {tmpl, true, nullptr};  // a folder of its own: no other process knows its name
}

void RunFolder::finish(json& result) const {
  result["run_dir"] = temporary ? json(nullptr) : json(path.string());
  if (temporary) {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
}

std::vector<json> Job::steps() const {
  std::vector<json> out;
  for (const auto& l : lines)
    if (!l.contains("event")) out.push_back(l);
  return out;
}

std::vector<json> Job::events(const std::string& kind) const {
  std::vector<json> out;
  for (const auto& l : lines)
    if (l.value("event", "") == kind) out.push_back(l);
  return out;
}

int64_t Job::step_line(int64_t step) const {
  for (size_t i = 0; i < lines.size(); ++i)
    if (!lines[i].contains("event") && lines[i].value("step", int64_t{-1}) == step) return static_cast<int64_t>(i);
  return -1;
}

fs::path rank_metrics_dir(const fs::path& dir) {
  const int64_t rank = dist_env_from().rank;
  return rank > 0 ? dir / ("rank" + std::to_string(rank)) : dir;
}

Job run_job(const Config& base, const std::vector<std::string>& sets, const fs::path& dir, const LineHook& hook,
            StepObserver* observer) {
  Config cfg = base;
  for (const auto& s : sets) apply_override(cfg, s);
  validate(cfg);
  fs::create_directories(dir);
  Job job;
  job.dir = dir;
  RunOptions ro;
  ro.run_dir = dir.string();
  ro.no_resume = true;
  ro.observer = observer;
  {
    // `job` is written on the watcher's thread only until stop() joins it.
    fs::create_directories(rank_metrics_dir(dir));
    MetricsWatcher watcher(rank_metrics_dir(dir), "metrics.jsonl", [&](const json& line, double unix_s, double elapsed_s) {
      job.lines.push_back(line);
      job.seen.push_back(unix_s);
      job.elapsed.push_back(elapsed_s);
      job.minflt.push_back(minor_page_faults());
      if (hook) hook(line);
    });
    job.rc = train(cfg, ro);
    watcher.stop();
    job.watch_source = watcher.source();
  }
  setup_logging("", mode_name(base.log.level));  // let go of the run folder's train.log
  return job;
}

}  // namespace trainer::bench
