// What `train.micro_batch: auto` has found so far, kept in the run folder (auto_search.json) as the search
// goes, so that a run stopped or killed during its search resumes it instead of probing again: each probe
// that ran to its end is written at once, under the conditions it ran in (the config less how long the
// run is, the limit, the device, the rank...). A restart under the same conditions takes those probes'
// outcomes as answered (MicroBatchSearcher::find, SearchControl::known); under other conditions it searches
// afresh and the file is rewritten. The file is a cache: one that cannot be read is set aside with a
// warning, never an error. docs/MEMORY.md "A stop during the search".
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>

#include "trainer/memory/curve.h"

namespace trainer {

class SearchFindings {
 public:
  /// Reads `path` if it exists. A file that is not what save() writes is ignored: `problem()` then says
  /// why in one line, and the next record() replaces it.
  explicit SearchFindings(std::string path);

  const std::string& path() const { return path_; }
  const std::string& problem() const { return problem_; }

  /// The outcomes found under exactly `conditions`, by micro-batch size (empty when none).
  std::map<int64_t, ProbeOutcome> known(const nlohmann::json& conditions) const;

  /// Adds one probe's outcome under `conditions` and writes the file (a temporary file renamed over it,
  /// so a kill leaves the old or the new one). Searches under other conditions are dropped: only the
  /// conditions of the current run can be resumed. Throws std::runtime_error naming the file when it
  /// cannot be written.
  void record(const nlohmann::json& conditions, int64_t micro_batch, const ProbeOutcome& outcome);

  /// {"searches": [{"conditions": {...}, "probes": [{"micro_batch", "fits", "peak_bytes"}, ...]}, ...]}
  const nlohmann::json& json() const { return doc_; }

 private:
  std::string path_;
  std::string problem_;
  nlohmann::json doc_;
};

}  // namespace trainer
