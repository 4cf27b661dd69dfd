// The exhaustive search for the largest micro-batch that fits under a cap: the reference that
// `micro_batch: auto` (bench --oom) and the memory curve's prediction (bench --memory-curve) are
// measured against. Every size is a fresh run through trainer::train(); nothing is assumed about how
// the peak grows with the micro-batch.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "tools/bench/bench_job.h"
#include "trainer/config/config.h"

namespace trainer::bench {

/// `--set`s every short measuring run takes: errors only in the log (the many runs would bury the
/// output in OOM reports), and no grow-back probes.
inline const char* const kQuiet = "log.level=error";
inline const char* const kNoGrowth = "memory.grow_after=1000000";

/// "<what> (exit code N); see <run folder>/train.log", for a run that did not end as it should.
std::string job_failed(const Job& j, const std::string& what);

/// What a search found.
struct Search {
  std::string method = "exhaustive";          ///< how: "exhaustive" or "bisect"
  int64_t largest = 0;                        ///< the largest micro-batch that fits (0: none)
  nlohmann::json tried = nlohmann::json::array();          ///< [{micro_batch, fits}], in the order run
  nlohmann::json failing_below = nlohmann::json::array();  ///< sizes below `largest` that did not fit
};

/// Every micro-batch from `from` down, each a fresh 2-step run of `base` with `sets` under the cap
/// `cap_bytes` (the second step carries the optimizer state the first created), pinned to its size
/// (memory.min_micro_batch = the size, no recomputation rung): it fits iff the run completes without an
/// OOM. Stops at the first size that fits, or with `below` goes on to half of it, listing the sizes
/// there that still fail (a step's peak need not be monotone in the micro-batch; docs/MEMORY.md). Runs
/// go into `dir`/`prefix`_mb<size>, removed afterwards when `remove_runs`. Throws std::runtime_error
/// (naming the run folder) when a run fails other than by running out of memory.
Search exhaustive_search(const Config& base, const std::vector<std::string>& sets, int64_t from, int64_t cap_bytes,
                         const std::filesystem::path& dir, const std::string& prefix, bool below, bool remove_runs);

/// The same runs, fewer of them, for jobs where one run costs seconds (a GPU at ImageNet size, where the
/// exhaustive search takes a hundred runs or more): a bisection over [1, from] for the largest size that
/// fits, as if the peak grew with the micro-batch, then every size within `window` above it (one that
/// fits there is a non-monotone step: the largest becomes that size) and within `window` below it (those
/// that fail are listed in failing_below). About log2(from) + 2 * window runs.
Search bisect_search(const Config& base, const std::vector<std::string>& sets, int64_t from, int64_t cap_bytes,
                     const std::filesystem::path& dir, const std::string& prefix, int64_t window, bool remove_runs);

}  // namespace trainer::bench
