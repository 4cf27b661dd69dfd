#include "tools/bench/bench_search.h"

#include "common/signals.h"

#include <map>

namespace fs = std::filesystem;
using nlohmann::json;

namespace trainer::bench {

std::string job_failed(const Job& j, const std::string& what) {
  return what + " (exit code " + std::to_string(j.rc) + "); see " + (j.dir / "train.log").string();
}

namespace {

// One pinned 2-step run at micro-batch m under the cap: true iff it completed without an OOM.
bool fits_at(const Config& base, const std::vector<std::string>& sets, int64_t m, int64_t cap_bytes, const fs::path& d,
             bool remove_runs) {
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
  if (remove_runs) fs::remove_all(d);
  return fits;
}

}  // namespace

Search exhaustive_search(const Config& base, const std::vector<std::string>& sets, int64_t from, int64_t cap_bytes,
                         const fs::path& dir, const std::string& prefix, bool below, bool remove_runs) {
  Search s;
  for (int64_t m = from; m >= 1; --m) {
    if (s.largest != 0 && (!below || 2 * m < s.largest)) break;
    const bool fits = fits_at(base, sets, m, cap_bytes, dir / (prefix + "_mb" + std::to_string(m)), remove_runs);
    s.tried.push_back({{"micro_batch", m}, {"fits", fits}});
    if (fits && s.largest == 0) s.largest = m;
    else if (!fits && s.largest != 0) s.failing_below.push_back(m);
  }
  return s;
}

Search bisect_search(const Config& base, const std::vector<std::string>& sets, int64_t from, int64_t cap_bytes,
                     const fs::path& dir, const std::string& prefix, int64_t window, bool remove_runs) {
  Search s;
  s.method = "bisect";
  std::map<int64_t, bool> seen;
  auto fits = [&](int64_t m) {
    if (auto it = seen.find(m); it != seen.end()) return it->second;
    const bool ok = fits_at(base, sets, m, cap_bytes, dir / (prefix + "_mb" + std::to_string(m)), remove_runs);
    s.tried.push_back({{"micro_batch", m}, {"fits", ok}});
    return seen[m] = ok;
  };
  int64_t lo = 0, hi = from + 1;  // lo fits (0: none known to), hi does not (from + 1: past the end)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  s.largest = lo;
  for (int64_t m = lo + 1; m <= std::min(from, lo + window); ++m)
    if (fits(m)) s.largest = m;  // the peak is not monotone here
  for (int64_t m = s.largest - 1; m >= std::max<int64_t>(1, s.largest - window); --m)
    if (!fits(m)) s.failing_below.push_back(m);
  return s;
}

}  // namespace trainer::bench
