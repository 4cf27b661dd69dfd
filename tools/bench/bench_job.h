// What the bench's measurements share: the settings a job is described by in a result, the folder its
// runs go into, and a run through trainer::train() with every metrics line read back as it appears.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <functional>
#include <string>
#include <vector>

#include "common/run_lock.h"
#include "tools/bench/bench.h"
#include "trainer/config/config.h"
#include "trainer/run/train.h"

namespace trainer::bench {

/// The device a job runs on, as a name with its index ("cuda:0", "cpu").
std::string device_name(const Config& cfg);

/// The host threads a one-process run of the job uses.
int threads_of(const Config& cfg);

/// Throws std::invalid_argument for warmup < 0 or steps < 1.
void check_counts(const BenchOptions& opts);

/// The fields every result starts with: schema, implementation, model, sample_shape, global_batch,
/// config_file, overrides and command_line (the last three as given).
nlohmann::json describe_run(const Config& cfg, const std::string& config_path,
                            const std::vector<std::string>& overrides, const std::string& command_line);

/// Where a measurement's runs go: the folder the user gave, or a new temporary one.
struct RunFolder {
  std::filesystem::path path;
  bool temporary = false;
  std::shared_ptr<RunFolderLock> lock;  ///< the user's folder is this bench's alone (common/run_lock.h)

  /// Throws RunFolderBusy (exit 2) if another process holds `dir` (""  = a temporary folder: never).
  /// Called before a bench looks at what the folder holds, so a second bench names the first.
  static void check_not_held(const std::string& dir);
  /// `dir` (created if missing, and locked for this bench's life: its jobs share the lock), or for ""
  /// a new folder `prefix`-XXXXXX in the temporary directory. Throws std::runtime_error if the folder
  /// cannot be made, RunFolderBusy if another process holds it.
  static RunFolder make(const std::string& dir, const std::string& prefix);
  /// Sets the result's run_dir (null for a temporary folder) and removes a temporary folder. Called
  /// only when the measurement succeeded: a failed one keeps its folder for the error to name.
  void finish(nlohmann::json& result) const;
};

/// One training run: its exit code, every metrics line and when each appeared.
struct Job {
  int rc = 0;
  std::filesystem::path dir;
  std::vector<nlohmann::json> lines;  ///< metrics.jsonl in file order
  std::vector<double> seen;           ///< wall time (seconds since 1970) at which lines[i] appeared
  std::vector<double> elapsed;        ///< steady-clock seconds since the run started at which lines[i] appeared
  std::vector<int64_t> minflt;        ///< the process's minor page faults so far when lines[i] appeared
  std::string watch_source;           ///< MetricsWatcher::source()

  /// The step lines (those without an "event" field).
  std::vector<nlohmann::json> steps() const;
  /// The lines of event `kind`.
  std::vector<nlohmann::json> events(const std::string& kind) const;
  /// Index into `lines` of the step line of `step`, or -1 if it never appeared.
  int64_t step_line(int64_t step) const;
};

/// Called on the watcher's thread with every metrics line as it appears.
using LineHook = std::function<void(const nlohmann::json& line)>;

/// Runs the job with `sets` on top of `base` into the folder `dir` (created), through trainer::train()
/// (the real loop, no resume), calling `hook` with every metrics line as it appears and telling
/// `observer` (optional) of every step on the training thread. Logging goes back to the console at
/// `base`'s level afterwards.
/// Where this process's metrics.jsonl goes in run folder `dir`: `dir` itself, or under torchrun for a rank
/// past 0, dir/rank<r> (each rank of `trainer bench` under torchrun reads its own step lines).
std::filesystem::path rank_metrics_dir(const std::filesystem::path& dir);

Job run_job(const Config& base, const std::vector<std::string>& sets, const std::filesystem::path& dir,
            const LineHook& hook = nullptr, StepObserver* observer = nullptr);

}  // namespace trainer::bench
