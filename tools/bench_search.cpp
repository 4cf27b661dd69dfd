#include "tools/bench_search.h"

#include "common/signals.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace trainer::bench {

std::string job_failed(const Job& j, const std::string& what) {
  return what + " (exit code " + std::to_string(j.rc) + "); see " + (j.dir / "train.log").string();
}

Search exhaustive_search(const Config& base, const std::vector<std::string>& sets, int64_t from, int64_t cap_bytes,
                         const fs::path& dir, const std::string& prefix, bool below, bool remove_runs) {
  Search s;
  for (int64_t m = from; m >= 1; --m) {
    if (s.largest != 0 && (!below || 2 * m < s.largest)) break;
    const fs::path d = dir / (prefix + "_mb" + std::to_string(m));
    std::vector<std::string> run_sets = sets;
    for (const std::string& x :
         {"train.micro_batch=" + std::to_string(m), "memory.min_micro_batch=" + std::to_string(m),
          std::string("memory.ladder_checkpointing=false"), "memory.limit=" + std::to_string(cap_bytes),
          std::string("train.steps=2"), std::string(kNoGrowth), std::string(kQuiet)})
      run_sets.push_back(x);
    Job j = run_job(base, run_sets, d);
    if (j.rc != kExitOk && j.rc != kExitOomGaveUp)
      throw std::runtime_error(job_failed(j, "the search run at micro-batch " + std::to_string(m) + " failed"));
    const bool fits = j.rc == kExitOk && j.events("oom").empty();
    s.tried.push_back({{"micro_batch", m}, {"fits", fits}});
    if (fits && s.largest == 0) s.largest = m;
    else if (!fits && s.largest != 0) s.failing_below.push_back(m);
    if (remove_runs) fs::remove_all(d);
  }
  return s;
}

}  // namespace trainer::bench
