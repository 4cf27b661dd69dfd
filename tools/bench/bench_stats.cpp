// The statistics of `trainer bench`: the step lines of metrics.jsonl and the timed steps' summary
// (percentile() is tools/percentile.cpp's).
#include "tools/bench/bench.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>
#include <stdexcept>

using nlohmann::json;

namespace trainer {

std::vector<StepRecord> read_step_records(const std::string& metrics_path) {
  std::ifstream in(metrics_path);
  if (!in) throw std::runtime_error(metrics_path + ": cannot read the metrics file");
  std::vector<StepRecord> out;
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    try {
      auto j = json::parse(line);
      if (j.contains("event")) continue;
      StepRecord r;
      r.step = j.at("step").get<int64_t>();
      r.step_time_s = j.at("step_time_s").get<double>();
      r.data_wait_s = j.value("data_wait_s", 0.0);
      r.mem_peak_bytes = j.value("mem_peak_bytes", int64_t{0});
      r.micro_batch = j.value("micro_batch", int64_t{0});
      r.oom_retries = j.value("oom_retries", int64_t{0});
      r.updated = j.value("updated", true);
      r.loss = j.value("loss", 0.0);
      out.push_back(r);
    } catch (const json::exception& e) {
      throw std::runtime_error(metrics_path + ":" + std::to_string(n) + ": not a metrics line (" + e.what() + ")");
    }
  }
  return out;
}

json summarize_steps(const std::vector<StepRecord>& records, int64_t warmup, int64_t steps, int64_t global_batch,
                     double wall_s) {
  std::vector<StepRecord> timed;
  for (const auto& r : records)
    if (r.step > warmup) timed.push_back(r);
  if (static_cast<int64_t>(timed.size()) != steps)
    throw std::runtime_error("bench: expected " + std::to_string(steps) + " timed steps after " +
                             std::to_string(warmup) + " warmup steps in metrics.jsonl, found " +
                             std::to_string(timed.size()));
  std::vector<double> step_time, total, sps;
  double wait_sum = 0, total_sum = 0, loss_first = timed.front().loss, loss_last = timed.back().loss;
  int64_t mem_peak = 0, ooms = 0, skipped = 0;
  for (const auto& r : timed) {
    step_time.push_back(r.step_time_s);
    total.push_back(r.step_time_s + r.data_wait_s);
    sps.push_back(static_cast<double>(global_batch) / (r.step_time_s + r.data_wait_s));
    wait_sum += r.data_wait_s;
    total_sum += r.step_time_s + r.data_wait_s;
    mem_peak = std::max(mem_peak, r.mem_peak_bytes);
    ooms += r.oom_retries;
    skipped += r.updated ? 0 : 1;
  }
  json j;
  j["timed_steps"] = steps;
  j["step_time_s_p50"] = percentile(step_time, 50);
  j["step_time_s_p90"] = percentile(step_time, 90);
  j["step_time_s_mean"] = std::accumulate(step_time.begin(), step_time.end(), 0.0) / static_cast<double>(steps);
  j["step_time_s_min"] = *std::min_element(step_time.begin(), step_time.end());
  j["step_time_s_max"] = *std::max_element(step_time.begin(), step_time.end());
  j["step_total_s_p50"] = percentile(total, 50);
  j["step_total_s_p90"] = percentile(total, 90);
  j["data_wait_s_sum"] = wait_sum;
  j["data_wait_share"] = total_sum > 0 ? wait_sum / total_sum : 0.0;
  j["samples_per_s_median"] = percentile(sps, 50);
  if (wall_s > 0) {
    j["wall_s"] = wall_s;
  } else {
    j["wall_s"] = total_sum;
    j["wall_source"] = "sum of step_time + data_wait";
  }
  j["samples_per_s_aggregate"] = static_cast<double>(steps * global_batch) / j["wall_s"].get<double>();
  j["figures_basis"] = wall_s > 0 ? "wall time over the timed steps"
                                  : "sum of step_time + data_wait (no warmup step starts the clock)";
  j["mem_peak_bytes"] = mem_peak;
  j["micro_batch"] = timed.back().micro_batch;
  j["oom_retries"] = ooms;
  j["skipped_updates"] = skipped;
  j["loss_first"] = loss_first;
  j["loss_last"] = loss_last;
  // Every step's loss, the warmup's first: two runs of one job (a CUDA graph on and off) compare them.
  json losses = json::array();
  for (const auto& r : records) losses.push_back(r.loss);
  j["losses"] = losses;
  return j;
}

}  // namespace trainer
