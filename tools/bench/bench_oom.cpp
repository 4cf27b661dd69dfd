// `trainer bench --oom`: the OOM recovery benchmark (docs/BENCHMARKS.md "OOM recovery"), in the phases
// tools/bench/bench.h lists: calibration, auto against exhaustive search, the rounds, the result.
#include "tools/bench/bench.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>

#include "common/signals.h"
#include "tools/bench/bench_job.h"
#include "tools/bench/bench_search.h"
#include "tools/bench/host_info.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace trainer {

using namespace bench;

namespace {

std::string oom_failed(const Job& j, const std::string& what) { return job_failed(j, "bench --oom: " + what); }

// The operator's way to move the cap of a running trainer: control.yaml, written aside and renamed so the
// loop never reads half a file.
void write_control(const fs::path& dir, int64_t limit_bytes) {
  const fs::path tmp = dir / "control.yaml.tmp";
  {
    std::ofstream f(tmp);
    f << "memory:\n  limit: " << limit_bytes << "\n";
    if (!f.flush()) throw std::runtime_error(tmp.string() + ": cannot write the control file");
  }
  fs::rename(tmp, dir / "control.yaml");
}

// What every phase works from: the job, where its runs go, the calibrated limits and the rounds' length.
struct OomPlan {
  Config cfg;  // the job, with evaluation and periodic checkpoints off
  BenchOomOptions opts;
  RunFolder root;
  int64_t G = 0, h1 = 0, h2 = 0;    // the global batch and the two halvings the ladder takes
  std::map<int64_t, int64_t> peak;  // calibration: the largest step peak (bytes) at G, h1 and h2
  int64_t cap_high = 0, cap_cut = 0, cap_mid = 0;
  int64_t total = 0;         // steps of each run of a round
  int64_t window_start = 0;  // the first of the compared steps
};

void check_oom_options(const Config& cfg, const BenchOomOptions& opts) {
  auto at_least_1 = [](int64_t v, const std::string& what) {
    if (v < 1) throw std::invalid_argument("bench --oom: " + what + " must be >= 1, got " + std::to_string(v));
  };
  at_least_1(opts.rounds, "--rounds");
  at_least_1(opts.warmup, "--warmup");
  at_least_1(opts.steps, "--steps");
  at_least_1(opts.low_steps, "low_steps");
  at_least_1(opts.search_window, "the search window");
  if (opts.search != "exhaustive" && opts.search != "bisect")
    throw std::invalid_argument("bench --oom: --search must be exhaustive or bisect, got '" + opts.search + "'");
  if (cfg.train.global_batch < 4)
    throw std::invalid_argument("bench --oom: train.global_batch must be at least 4 (the cut backs off to a quarter "
                                "of it), got " + std::to_string(cfg.train.global_batch));
}

OomPlan plan_oom(Config cfg, const BenchOomOptions& opts) {
  // As in `trainer bench`: no evaluation, no periodic checkpoints; every run sets its own steps and limit.
  for (const auto& o : {"train.epochs=0", "data.test=", "checkpoint.every_steps=0", "checkpoint.every_seconds=0"})
    apply_override(cfg, o);
  validate(cfg);
  RunFolder::check_not_held(opts.run_dir);
  if (!opts.run_dir.empty() && fs::exists(opts.run_dir) && !fs::is_empty(opts.run_dir))
    throw std::runtime_error("bench --oom: " + opts.run_dir + " is not empty; give --run-dir a new folder");
  OomPlan p;
  p.cfg = cfg;
  p.opts = opts;
  p.root = RunFolder::make(opts.run_dir, "trainer-bench-oom");
  p.G = cfg.train.global_batch;
  p.h1 = (p.G + 1) / 2;
  p.h2 = (p.h1 + 1) / 2;
  // The steps of a round's runs: warmup, the OOM step and low_steps before the raise, room to grow back
  // from h2 to G (per doubling memory.grow_after clean steps and the probe, one doubling spare), the
  // compared steps, and a few steps of slack.
  int64_t doublings = 0;
  for (int64_t m = p.h2; m < p.G; m *= 2) ++doublings;
  const int64_t grow_budget = (doublings + 1) * (cfg.memory.grow_after + 1) + 2;
  p.total = opts.warmup + 2 + 1 + opts.low_steps + 2 + grow_budget + opts.steps;
  p.window_start = p.total - opts.steps + 1;
  return p;
}

// ---- 1. calibration ---------------------------------------------------------------------------------

// The peak tensor memory of uncapped runs at the global batch and two halvings of it (the sizes the
// ladder takes), to place the caps between them.
void calibrate(OomPlan& p) {
  for (int64_t m : {p.G, p.h1, p.h2}) {
    Job j = run_job(p.cfg, {"train.micro_batch=" + std::to_string(m), "memory.limit=none", "train.steps=3", kNoGrowth, kQuiet},
                    p.root.path / ("calibrate_mb" + std::to_string(m)));
    if (j.rc != kExitOk)
      throw std::runtime_error(oom_failed(j, "the uncapped run at micro-batch " + std::to_string(m) + " failed"));
    for (const auto& l : j.steps()) p.peak[m] = std::max(p.peak[m], l.value("mem_peak_bytes", int64_t{0}));
  }
  auto& peak = p.peak;
  if (!(peak[p.h2] < peak[p.h1] && peak[p.h1] < peak[p.G]))
    throw std::runtime_error("bench --oom: the peak memory does not grow with the micro-batch (" + std::to_string(peak[p.h2]) +
                             ", " + std::to_string(peak[p.h1]) + ", " + std::to_string(peak[p.G]) + " bytes at " + std::to_string(p.h2) + ", " +
                             std::to_string(p.h1) + ", " + std::to_string(p.G) + "), so no cap separates them; use a model or batch " +
                             "whose activations count");
  p.cap_high = peak[p.G] + peak[p.G] / 4;       // the global batch fits with room to spare
  p.cap_cut = (peak[p.h2] + peak[p.h1]) / 2;    // a quarter of the global batch fits, half does not
  p.cap_mid = (peak[p.h1] + peak[p.G]) / 2;     // half fits, the whole does not
}

// ---- 2. micro_batch: auto against an exhaustive search ------------------------------------------------

// Every micro-batch from the global batch down (bench_search.h). Not only down to the first that fits:
// a step's peak need not be monotone in the micro-batch (every micro-batch after the first runs with
// the step's gradients alive, so a split {12, 4} can peak below {8, 8}), so the search goes on to half
// the largest that fits, the range that decides whether auto's pick is "at least half", and lists the
// sizes there that still fail. (Further down every run is slower, and nothing there changes the figures.)
Search search_under(const OomPlan& p, const std::string& name, int64_t cap) {
  Search s = p.opts.search == "bisect"
                 ? bisect_search(p.cfg, {}, p.G, cap, p.root.path, "search_" + name, p.opts.search_window,
                                 /*remove_runs=*/p.root.temporary)
                 : exhaustive_search(p.cfg, {}, p.G, cap, p.root.path, "search_" + name, /*below=*/true,
                                     /*remove_runs=*/p.root.temporary);
  if (s.largest == 0) throw std::runtime_error("bench --oom: nothing fits under the " + name + " cap " + std::to_string(cap));
  return s;
}

// A 3-step run with `micro_batch: auto` under the same cap: its pick against the search's, how long its
// search took, and where it is after 3 steps (lower if the pick had to back off).
json auto_against(const OomPlan& p, const std::string& name, int64_t cap, const Search& s) {
  Job a = run_job(p.cfg, {"train.micro_batch=auto", "memory.limit=" + std::to_string(cap), "train.steps=3", kNoGrowth, kQuiet},
                  p.root.path / ("auto_" + name));
  if (a.rc != kExitOk) throw std::runtime_error(oom_failed(a, "the micro_batch: auto run failed"));
  const auto picked_ev = a.events("auto_micro_batch");
  if (picked_ev.empty())
    throw std::runtime_error("bench --oom: " + (a.dir / "metrics.jsonl").string() + " has no auto_micro_batch event");
  const int64_t picked = picked_ev.front().at("micro_batch").get<int64_t>();
  // The search's time: from the start event (after setup) to the pick (includes the first batch's wait).
  double t_start_ev = 0, t_pick = 0;
  for (size_t i = 0; i < a.lines.size(); ++i) {
    const std::string ev = a.lines[i].value("event", "");
    if (ev == "start" && t_start_ev == 0) t_start_ev = a.seen[i];
    if (ev == "auto_micro_batch" && t_pick == 0) t_pick = a.seen[i];
  }
  const int64_t after = a.steps().back().at("micro_batch").get<int64_t>();
  return {{"cap", name},
          {"limit_bytes", cap},
          {"largest_fitting_micro_batch", s.largest},
          {"auto_micro_batch", picked},
          {"auto_fraction", static_cast<double>(picked) / static_cast<double>(s.largest)},
          {"auto_search_s", t_pick - t_start_ev},
          {"auto_probes", picked_ev.front().value("probes", int64_t{0})},
          {"auto_ooms_in_3_steps", a.events("oom").size()},
          {"micro_batch_after_3_steps", after},
          {"fraction_after_3_steps", static_cast<double>(after) / static_cast<double>(s.largest)},
          {"failing_below_largest", s.failing_below},
          {"search", s.method},
          {"searched", s.tried}};
}

json auto_vs_exhaustive(const OomPlan& p) {
  json autos = json::array();
  for (const auto& [name, cap] : std::vector<std::pair<std::string, int64_t>>{{"cut", p.cap_cut}, {"mid", p.cap_mid}})
    autos.push_back(auto_against(p, name, cap, search_under(p, name, cap)));
  return autos;
}

// ---- 3. the rounds ------------------------------------------------------------------------------------
//
// Each round: (A) a run at the global batch whose cap is cut through control.yaml after `warmup` steps
// (an OOM, backoff to a quarter), raised again after `low_steps` clean steps (grow-back), and (B) a run
// that starts at the micro-batch A ended with, under the same high cap. The recovery comes from A;
// throughput is compared over the last `steps` steps of both.

// Run A, and what its hook saw: the step that ran out of memory under the cut, the micro-batch that
// step ended at, and the step after which the cap was raised again.
struct BackoffRun {
  Job job;
  bool cut = false, raised = false;
  int64_t oom_step = 0, low_micro = 0, raise_step = 0;
};

BackoffRun run_backoff(const OomPlan& p, int64_t r) {
  BackoffRun a;
  const fs::path da = p.root.path / ("round" + std::to_string(r) + "_backoff");
  auto hook = [&](const json& l) {
    if (l.contains("event")) {
      if (l.value("event", "") == "oom" && a.cut && a.oom_step == 0) a.oom_step = l.value("step", int64_t{0});
      return;
    }
    const int64_t s = l.value("step", int64_t{0});
    if (!a.cut) {
      if (s >= p.opts.warmup) {
        write_control(da, p.cap_cut);
        a.cut = true;
      }
    } else if (a.oom_step > 0 && !a.raised) {
      if (s == a.oom_step) a.low_micro = l.value("micro_batch", int64_t{0});
      if (s >= a.oom_step + p.opts.low_steps) {
        write_control(da, p.cap_high);
        a.raised = true;
        a.raise_step = s;
      }
    }
  };
  a.job = run_job(p.cfg, {"train.micro_batch=0", "memory.limit=" + std::to_string(p.cap_high), "train.steps=" + std::to_string(p.total)},
                  da, hook);
  if (a.job.rc != kExitOk) throw std::runtime_error(oom_failed(a.job, "the backoff run failed"));
  if (!a.cut || a.oom_step == 0 || !a.raised) {
    const std::string what = !a.cut ? "the cap was never cut"
                             : a.oom_step == 0 ? "the cut caused no OOM"
                                               : "the cap was never raised again";
    throw std::runtime_error("bench --oom: " + da.string() + ": " + what + "; give it more steps");
  }
  return a;
}

// Run B: from `micro` under the high cap, with no growth.
Job run_fresh(const OomPlan& p, int64_t r, int64_t micro) {
  Job b = run_job(p.cfg, {"train.micro_batch=" + std::to_string(micro), "memory.limit=" + std::to_string(p.cap_high),
                          "train.steps=" + std::to_string(p.total), kNoGrowth}, p.root.path / ("round" + std::to_string(r) + "_fresh"));
  if (b.rc != kExitOk) throw std::runtime_error(oom_failed(b, "the fresh run failed"));
  return b;
}

struct OomReports {
  int64_t count = 0;
  double first = 0, last = 0;  // time_unix_s of the first and the last
};

// The OOM was thrown just before its memory report was built (the first thing the step does when it
// catches one); the report's time_unix_s marks it. Several OOMs in the step: several reports.
OomReports oom_reports(const fs::path& dir, int64_t step) {
  OomReports out;
  const std::string prefix = "memory_report_" + std::to_string(step);
  for (const auto& f : fs::directory_iterator(dir)) {
    const std::string n = f.path().filename().string();
    if (n.rfind(prefix, 0) != 0 || f.path().extension() != ".json") continue;
    const std::string rest = n.substr(prefix.size());
    if (rest != ".json" && rest.rfind("_", 0) != 0) continue;  // memory_report_12.json, _12_2.json, not _123.json
    std::ifstream in(f.path());
    const json rep = json::parse(in);
    if (rep.value("reason", "") != "oom") continue;
    ++out.count;
    const double t = rep.at("time_unix_s").get<double>();
    out.first = out.first == 0 ? t : std::min(out.first, t);
    out.last = std::max(out.last, t);
  }
  if (out.first == 0) throw std::runtime_error("bench --oom: " + dir.string() + ": no memory report for the OOM step");
  return out;
}

struct Recovery {
  double oom_step_time_s = 0;
  OomReports reports;
  double recovery_s = 0;   // when the OOM step's line appeared - its first OOM
  double normal_s = 0;     // median of low_times
  std::vector<double> low_times;     // A's clean steps at the backed-off size before the raise
  std::vector<double> before_times;  // A's steps 2..warmup, at the global batch
};

Recovery recovery_of(const OomPlan& p, const BackoffRun& a, const std::vector<json>& a_steps) {
  Recovery rec;
  const json* oom_line = nullptr;
  for (const auto& l : a_steps)
    if (l.value("step", int64_t{0}) == a.oom_step) oom_line = &l;
  if (!oom_line) throw std::runtime_error("bench --oom: " + a.job.dir.string() + ": no step line for the OOM step");
  rec.oom_step_time_s = oom_line->at("step_time_s").get<double>();
  rec.reports = oom_reports(a.job.dir, a.oom_step);
  // A normal step at the backed-off size: A's clean steps at it before the raise (a grow-back probe may
  // end them early). And at the global batch: A's steps before the cut, the first one left out.
  for (const auto& l : a_steps) {
    const int64_t s = l.value("step", int64_t{0});
    if (s > a.oom_step && s <= a.raise_step && l.value("micro_batch", int64_t{0}) == a.low_micro &&
        l.value("oom_retries", int64_t{0}) == 0)
      rec.low_times.push_back(l.at("step_time_s").get<double>());
    if (s > 1 && s <= p.opts.warmup) rec.before_times.push_back(l.at("step_time_s").get<double>());
  }
  if (rec.low_times.empty())
    throw std::runtime_error("bench --oom: " + a.job.dir.string() + ": no clean step at the backed-off micro-batch "
                             "before the raise; raise memory.grow_after");
  rec.recovery_s = a.job.seen[a.job.step_line(a.oom_step)] - rec.reports.first;
  rec.normal_s = median_of(rec.low_times);
  return rec;
}

struct GrowBack {
  int64_t final_micro = 0;  // the micro-batch A ended at
  int64_t settled = 0;      // the first step of A's last run of clean steps at final_micro
};

// The run must have settled at its final micro-batch before the compared window; in a round that ran B
// first, at the size B started at (the one A reached in the round before).
GrowBack grow_back_of(const OomPlan& p, const BackoffRun& a, const std::vector<json>& a_steps, bool fresh_first,
                      int64_t last_final_micro) {
  GrowBack g;
  g.final_micro = a_steps.back().at("micro_batch").get<int64_t>();
  g.settled = a_steps.back().at("step").get<int64_t>();
  for (auto it = a_steps.rbegin(); it != a_steps.rend(); ++it) {
    if (it->at("micro_batch").get<int64_t>() != g.final_micro || it->value("oom_retries", int64_t{0}) != 0) break;
    g.settled = it->at("step").get<int64_t>();
  }
  const std::string da = a.job.dir.string();
  if (g.settled > p.window_start)
    throw std::runtime_error("bench --oom: " + da + ": the run settled at micro-batch " + std::to_string(g.final_micro) +
                             " only at step " + std::to_string(g.settled) + ", after the compared steps began (" +
                             std::to_string(p.window_start) + "); lower memory.grow_after");
  if (fresh_first && g.final_micro != last_final_micro)
    throw std::runtime_error("bench --oom: " + da + ": grew back to micro-batch " + std::to_string(g.final_micro) + ", not to " +
                             std::to_string(last_final_micro) + " as in the round before, at which the fresh run of this round "
                             "started; run --rounds 1 to see why");
  return g;
}

struct Window {
  double step_p50 = 0, sps_p50 = 0, faults_per_step = 0;
};

// Median step time and samples/s of the compared steps, and minor page faults per step over them
// (process-wide, read when each line appeared: glibc handing freed memory back and faulting it in again
// costs time, docs/BENCHMARKS.md).
Window compared_window(const OomPlan& p, const Job& j) {
  std::vector<double> st_times, sps;
  int64_t f0 = -1, f1 = 0;
  for (size_t i = 0; i < j.lines.size(); ++i) {
    const json& l = j.lines[i];
    if (l.contains("event")) continue;
    const int64_t s = l.value("step", int64_t{0});
    if (s == p.window_start - 1) f0 = j.minflt[i];
    if (s < p.window_start) continue;
    f1 = j.minflt[i];
    const double t = l.at("step_time_s").get<double>(), w = l.value("data_wait_s", 0.0);
    st_times.push_back(t);
    sps.push_back(static_cast<double>(p.G) / (t + w));
  }
  return {median_of(st_times), median_of(sps),
          f0 < 0 ? 0.0 : static_cast<double>(f1 - f0) / static_cast<double>(p.opts.steps)};
}

// A's grow-back probes from the raise on.
json grow_events(const Job& a, int64_t raise_step) {
  json out = json::array();
  for (const auto& kind : {"probe", "probe_succeeded", "probe_failed"})
    for (const auto& e : a.events(kind))
      if (e.value("step", int64_t{0}) >= raise_step)
        out.push_back({{"event", kind}, {"step", e.value("step", int64_t{0})},
                       {"new_micro_batch", e.value("new_micro_batch", int64_t{0})}});
  return out;
}

struct Round {
  json row;  // every figure of the round
  Recovery rec;
  int64_t final_micro = 0;
  double step_ratio = 0, sps_ratio = 0;
};

// The order alternates (A B, then B A, ...) so that running second is no advantage to either. B first
// starts at the size A grew back to in the round before.
Round run_round(const OomPlan& p, int64_t r, int64_t last_final_micro) {
  const std::vector<double> load = load_avg();
  const bool fresh_first = r % 2 == 0;
  Job b;
  if (fresh_first) b = run_fresh(p, r, last_final_micro);
  const BackoffRun a = run_backoff(p, r);
  const std::vector<json> a_steps = a.job.steps();
  Round out;
  out.rec = recovery_of(p, a, a_steps);
  const GrowBack g = grow_back_of(p, a, a_steps, fresh_first, last_final_micro);
  if (!fresh_first) b = run_fresh(p, r, g.final_micro);
  const Window wa = compared_window(p, a.job), wb = compared_window(p, b);
  const Recovery& rec = out.rec;
  out.final_micro = g.final_micro;
  out.step_ratio = wa.step_p50 / wb.step_p50;
  out.sps_ratio = wa.sps_p50 / wb.sps_p50;
  out.row = {{"round", r},
             {"load_avg", load},
             {"oom_step", a.oom_step},
             {"ooms_in_step", rec.reports.count},
             {"micro_batch_before", p.G},
             {"micro_batch_after", a.low_micro},
             {"recovery_s", rec.recovery_s},
             {"first_to_last_oom_s", rec.reports.last - rec.reports.first},
             {"normal_step_s", rec.normal_s},
             {"normal_steps", rec.low_times.size()},
             {"step_before_cut_s", median_of(rec.before_times)},
             {"recovery_over_normal", rec.recovery_s / rec.normal_s},
             {"oom_step_time_s", rec.oom_step_time_s},
             {"raised_after_step", a.raise_step},
             {"final_micro_batch", g.final_micro},
             {"settled_at_step", g.settled},
             {"grow_events", grow_events(a.job, a.raise_step)},
             {"compared_steps", json::array({p.window_start, p.total})},
             {"backoff_run_step_time_s_p50", wa.step_p50},
             {"fresh_run_step_time_s_p50", wb.step_p50},
             {"backoff_run_samples_per_s_p50", wa.sps_p50},
             {"fresh_run_samples_per_s_p50", wb.sps_p50},
             {"fresh_run_ooms", b.events("oom").size()},
             {"order", fresh_first ? "fresh first" : "backoff first"},
             {"backoff_run_page_faults_per_step", wa.faults_per_step},
             {"fresh_run_page_faults_per_step", wb.faults_per_step},
             {"step_time_ratio", out.step_ratio},
             {"throughput_ratio", out.sps_ratio}};
  std::cerr << "bench --oom: round " << r << ": recovery " << rec.recovery_s << " s (normal step " << rec.normal_s
            << " s), grew back to " << g.final_micro << ", throughput ratio " << out.sps_ratio << std::endl;
  return out;
}

// ---- 4. the result ------------------------------------------------------------------------------------

// The rounds' figures, pooled for the medians of the result.
struct Pools {
  std::vector<double> recovery, normal, normal_pooled, before, over, overhead, step_ratio, sps_ratio;
  json rounds = json::array();

  void add(const Round& r) {
    const Recovery& rec = r.rec;
    recovery.push_back(rec.recovery_s);
    normal.push_back(rec.normal_s);
    normal_pooled.insert(normal_pooled.end(), rec.low_times.begin(), rec.low_times.end());
    before.insert(before.end(), rec.before_times.begin(), rec.before_times.end());
    over.push_back(rec.recovery_s / rec.normal_s);
    overhead.push_back(rec.recovery_s - rec.normal_s);
    step_ratio.push_back(r.step_ratio);
    sps_ratio.push_back(r.sps_ratio);
    rounds.push_back(r.row);
  }
};

json oom_result(const OomPlan& p, const json& autos, const Pools& pools) {
  json j = describe_run(p.cfg, p.opts.config_path, p.opts.overrides, p.opts.command_line);
  j["mode"] = "oom";
  j["calibration_peak_bytes"] = {{std::to_string(p.G), p.peak.at(p.G)}, {std::to_string(p.h1), p.peak.at(p.h1)}, {std::to_string(p.h2), p.peak.at(p.h2)}};
  j["limits_bytes"] = {{"high", p.cap_high}, {"cut", p.cap_cut}, {"mid", p.cap_mid}};
  j["auto_vs_exhaustive"] = autos;
  j["recovery"] = {{"recovery_s_median", median_of(pools.recovery)},
                   {"normal_step_s_median", median_of(pools.normal)},
                   {"normal_step_s_pooled_median", median_of(pools.normal_pooled)},
                   {"normal_steps_pooled", pools.normal_pooled.size()},
                   {"step_before_cut_s_median", median_of(pools.before)},
                   {"recovery_over_normal_median", median_of(pools.over)},
                   {"overhead_s_median", median_of(pools.overhead)}};
  j["grow_back"] = {{"step_time_ratio_median", median_of(pools.step_ratio)},
                    {"throughput_ratio_median", median_of(pools.sps_ratio)},
                    {"compared_steps", p.opts.steps}};
  j["rounds"] = pools.rounds;
  j["options"] = {{"rounds", p.opts.rounds}, {"warmup", p.opts.warmup}, {"low_steps", p.opts.low_steps},
                  {"steps", p.opts.steps}, {"steps_per_run", p.total}};
  j["threads"] = threads_of(p.cfg);
  j["config_yaml"] = to_yaml(p.cfg);
  return j;
}

}  // namespace

json bench_oom(Config cfg, const BenchOomOptions& opts) {
  check_oom_options(cfg, opts);
  OomPlan p = plan_oom(std::move(cfg), opts);
  const json env = bench_environment(device_name(p.cfg));
  const auto t_start = std::chrono::steady_clock::now();
  calibrate(p);
  const json autos = auto_vs_exhaustive(p);
  Pools pools;
  int64_t last_final_micro = p.G;
  for (int64_t r = 1; r <= opts.rounds; ++r) {
    const Round round = run_round(p, r, last_final_micro);
    last_final_micro = round.final_micro;
    pools.add(round);
  }
  json j = oom_result(p, autos, pools);
  j["wall_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  j.update(env);
  p.root.finish(j);
  return j;
}

}  // namespace trainer
