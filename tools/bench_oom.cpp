// `trainer bench --oom`: the OOM recovery benchmark (docs/BENCHMARKS.md "OOM recovery").
#include "tools/bench.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>

#include "common/signals.h"
#include "tools/bench_job.h"
#include "tools/host_info.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace trainer {

using namespace bench;
using Clock = std::chrono::steady_clock;

namespace {

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

double median_of(const std::vector<double>& v) { return v.empty() ? 0.0 : percentile(v, 50); }

std::string job_failed(const Job& j, const std::string& what) {
  return "bench --oom: " + what + " (exit code " + std::to_string(j.rc) + "); see " + (j.dir / "train.log").string();
}

}  // namespace

json bench_oom(Config cfg, const BenchOomOptions& opts) {
  auto at_least_1 = [](int64_t v, const std::string& what) {
    if (v < 1) throw std::invalid_argument("bench --oom: " + what + " must be >= 1, got " + std::to_string(v));
  };
  at_least_1(opts.rounds, "--rounds");
  at_least_1(opts.warmup, "--warmup");
  at_least_1(opts.steps, "--steps");
  at_least_1(opts.low_steps, "low_steps");
  const int64_t G = cfg.train.global_batch;
  if (G < 4)
    throw std::invalid_argument("bench --oom: train.global_batch must be at least 4 (the cut backs off to a quarter "
                                "of it), got " + std::to_string(G));
  // As in `trainer bench`: no evaluation, no periodic checkpoints; every run sets its own steps and limit.
  const std::vector<std::string> common = {"train.epochs=0", "data.test=", "checkpoint.every_steps=0",
                                           "checkpoint.every_seconds=0"};
  for (const auto& o : common) apply_override(cfg, o);
  validate(cfg);

  if (!opts.run_dir.empty() && fs::exists(opts.run_dir) && !fs::is_empty(opts.run_dir))
    throw std::runtime_error("bench --oom: " + opts.run_dir + " is not empty; give --run-dir a new folder");
  const RunFolder folder = RunFolder::make(opts.run_dir, "trainer-bench-oom");
  const fs::path& root = folder.path;
  const json env = bench_environment(device_name(cfg));
  const auto t_start = Clock::now();
  const std::string quiet = "log.level=error";  // the many short runs would bury the output in OOM reports
  const std::string no_growth = "memory.grow_after=1000000";
  auto num = [](int64_t v) { return std::to_string(v); };

  // 1. Calibration: the peak tensor memory of uncapped runs at the global batch and two halvings of it
  //    (the sizes the ladder takes), to place the caps between them.
  const int64_t h1 = (G + 1) / 2, h2 = (h1 + 1) / 2;
  std::map<int64_t, int64_t> peak;
  for (int64_t m : {G, h1, h2}) {
    Job j = run_job(cfg, {"train.micro_batch=" + num(m), "memory.limit=none", "train.steps=3", no_growth, quiet},
                    root / ("calibrate_mb" + num(m)));
    if (j.rc != kExitOk)
      throw std::runtime_error(job_failed(j, "the uncapped run at micro-batch " + num(m) + " failed"));
    for (const auto& l : j.steps()) peak[m] = std::max(peak[m], l.value("mem_peak_bytes", int64_t{0}));
  }
  if (!(peak[h2] < peak[h1] && peak[h1] < peak[G]))
    throw std::runtime_error("bench --oom: the peak memory does not grow with the micro-batch (" + num(peak[h2]) + ", " +
                             num(peak[h1]) + ", " + num(peak[G]) + " bytes at " + num(h2) + ", " + num(h1) + ", " +
                             num(G) + "), so no cap separates them; use a model or batch whose activations count");
  const int64_t cap_high = peak[G] + peak[G] / 4;       // the global batch fits with room to spare
  const int64_t cap_cut = (peak[h2] + peak[h1]) / 2;    // a quarter of the global batch fits, half does not
  const int64_t cap_mid = (peak[h1] + peak[G]) / 2;     // half fits, the whole does not

  // 2. micro_batch: auto against an exhaustive search under the same cap: every micro-batch from the global
  //    batch down, each a fresh 2-step run (the second step carries the optimizer state the first one
  //    created) that may not back off (floor = that size, no recomputation). Not only down to the first
  //    that fits: a step's peak need not be monotone in the micro-batch (every micro-batch after the
  //    first runs with the step's gradients alive, so a split {12, 4} can peak below {8, 8}), so the
  //    search goes on to half the largest that fits, the range that decides whether auto's pick is "at
  //    least half", and lists the sizes there that still fail. (Further down every run is slower, and
  //    nothing there changes the figures.)
  json autos = json::array();
  for (const auto& [name, cap] : std::vector<std::pair<std::string, int64_t>>{{"cut", cap_cut}, {"mid", cap_mid}}) {
    json tried = json::array(), failing_below = json::array();
    int64_t largest = 0;
    for (int64_t m = G; m >= 1 && (largest == 0 || 2 * m >= largest); --m) {
      const fs::path d = root / ("search_" + name + "_mb" + num(m));
      Job j = run_job(cfg, {"train.micro_batch=" + num(m), "memory.min_micro_batch=" + num(m),
                            "memory.ladder_checkpointing=false", "memory.limit=" + num(cap), "train.steps=2",
                            no_growth, quiet}, d);
      if (j.rc != kExitOk && j.rc != kExitOomGaveUp)
        throw std::runtime_error(job_failed(j, "the search run at micro-batch " + num(m) + " failed"));
      const bool fits = j.rc == kExitOk && j.events("oom").empty();
      tried.push_back({{"micro_batch", m}, {"fits", fits}});
      if (fits && largest == 0) largest = m;
      if (!fits && largest != 0) failing_below.push_back(m);
      if (folder.temporary) fs::remove_all(d);
    }
    if (largest == 0) throw std::runtime_error("bench --oom: nothing fits under the " + name + " cap " + num(cap));
    Job a = run_job(cfg, {"train.micro_batch=auto", "memory.limit=" + num(cap), "train.steps=3", no_growth, quiet},
                    root / ("auto_" + name));
    if (a.rc != kExitOk) throw std::runtime_error(job_failed(a, "the micro_batch: auto run failed"));
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
    autos.push_back({{"cap", name},
                     {"limit_bytes", cap},
                     {"largest_fitting_micro_batch", largest},
                     {"auto_micro_batch", picked},
                     {"auto_fraction", static_cast<double>(picked) / static_cast<double>(largest)},
                     {"auto_search_s", t_pick - t_start_ev},
                     {"auto_ooms_in_3_steps", a.events("oom").size()},
                     {"micro_batch_after_3_steps", after},
                     {"fraction_after_3_steps", static_cast<double>(after) / static_cast<double>(largest)},
                     {"failing_below_largest", failing_below},
                     {"searched", tried}});
  }

  // 3. Rounds, alternating: (A) a run at the global batch whose cap is cut through control.yaml after
  //    `warmup` steps (an OOM, backoff to a quarter), raised again after `low_steps` clean steps (grow-back),
  //    then (B) a run that starts at the micro-batch A ended with, under the same high cap. The recovery
  //    comes from A; throughput is compared over the last `steps` steps of both.
  int64_t doublings = 0;
  for (int64_t m = h2; m < G; m *= 2) ++doublings;
  const int64_t grow_budget = (doublings + 1) * (cfg.memory.grow_after + 1) + 2;
  const int64_t total = opts.warmup + 2 + 1 + opts.low_steps + 2 + grow_budget + opts.steps;
  const int64_t window_start = total - opts.steps + 1;
  json rounds = json::array();
  int64_t last_final_micro = G;
  std::vector<double> recovery, normal, normal_pooled, before, over, overhead, step_ratio, sps_ratio;
  for (int64_t r = 1; r <= opts.rounds; ++r) {
    const std::vector<double> load = load_avg();
    struct {
      bool cut = false, raised = false;
      int64_t oom_step = 0, low_micro = 0, raise_step = 0;
    } st;
    const fs::path da = root / ("round" + num(r) + "_backoff");
    auto hook = [&](const json& l) {
      if (l.contains("event")) {
        if (l.value("event", "") == "oom" && st.cut && st.oom_step == 0) st.oom_step = l.value("step", int64_t{0});
        return;
      }
      const int64_t s = l.value("step", int64_t{0});
      if (!st.cut) {
        if (s >= opts.warmup) {
          write_control(da, cap_cut);
          st.cut = true;
        }
      } else if (st.oom_step > 0 && !st.raised) {
        if (s == st.oom_step) st.low_micro = l.value("micro_batch", int64_t{0});
        if (s >= st.oom_step + opts.low_steps) {
          write_control(da, cap_high);
          st.raised = true;
          st.raise_step = s;
        }
      }
    };
    // The order alternates (A B, then B A, ...) so that running second is no advantage to either. B first
    // starts at the size A grew back to in the round before.
    const bool fresh_first = r % 2 == 0;
    auto run_fresh = [&](int64_t micro) {
      Job b = run_job(cfg, {"train.micro_batch=" + num(micro), "memory.limit=" + num(cap_high),
                            "train.steps=" + num(total), no_growth}, root / ("round" + num(r) + "_fresh"));
      if (b.rc != kExitOk) throw std::runtime_error(job_failed(b, "the fresh run failed"));
      return b;
    };
    Job b;
    if (fresh_first) b = run_fresh(last_final_micro);
    Job a = run_job(cfg, {"train.micro_batch=0", "memory.limit=" + num(cap_high), "train.steps=" + num(total)}, da,
                    hook);
    if (a.rc != kExitOk) throw std::runtime_error(job_failed(a, "the backoff run failed"));
    if (!st.cut || st.oom_step == 0 || !st.raised) {
      const std::string what = !st.cut ? "the cap was never cut"
                               : st.oom_step == 0 ? "the cut caused no OOM"
                                                  : "the cap was never raised again";
      throw std::runtime_error("bench --oom: " + da.string() + ": " + what + "; give it more steps");
    }
    const auto a_steps = a.steps();
    const json* oom_line = nullptr;
    for (const auto& l : a_steps)
      if (l.value("step", int64_t{0}) == st.oom_step) oom_line = &l;
    if (!oom_line) throw std::runtime_error("bench --oom: " + da.string() + ": no step line for the OOM step");
    // The OOM was thrown just before its memory report was built (the first thing the step does when it
    // catches one); the report's time_unix_s marks it. Several OOMs in the step: the first one.
    double t_throw = 0, t_last_throw = 0;
    int64_t ooms = 0;
    for (const auto& f : fs::directory_iterator(da)) {
      const std::string n = f.path().filename().string();
      const std::string prefix = "memory_report_" + num(st.oom_step);
      if (n.rfind(prefix, 0) != 0 || f.path().extension() != ".json") continue;
      const std::string rest = n.substr(prefix.size());
      if (rest != ".json" && rest.rfind("_", 0) != 0) continue;  // memory_report_12.json, _12_2.json, not _123.json
      std::ifstream in(f.path());
      const json rep = json::parse(in);
      if (rep.value("reason", "") != "oom") continue;
      ++ooms;
      const double t = rep.at("time_unix_s").get<double>();
      t_throw = t_throw == 0 ? t : std::min(t_throw, t);
      t_last_throw = std::max(t_last_throw, t);
    }
    if (t_throw == 0) throw std::runtime_error("bench --oom: " + da.string() + ": no memory report for the OOM step");
    const double t_done = a.seen[a.step_line(st.oom_step)];
    // A normal step at the backed-off size: A's clean steps at it before the raise (a grow-back probe may
    // end them early). And at the global batch: A's steps before the cut, the first one left out.
    std::vector<double> low_times, before_times;
    for (const auto& l : a_steps) {
      const int64_t s = l.value("step", int64_t{0});
      if (s > st.oom_step && s <= st.raise_step && l.value("micro_batch", int64_t{0}) == st.low_micro &&
          l.value("oom_retries", int64_t{0}) == 0)
        low_times.push_back(l.at("step_time_s").get<double>());
      if (s > 1 && s <= opts.warmup) before_times.push_back(l.at("step_time_s").get<double>());
    }
    if (low_times.empty())
      throw std::runtime_error("bench --oom: " + da.string() + ": no clean step at the backed-off micro-batch before "
                               "the raise; raise memory.grow_after");
    const double rec = t_done - t_throw, norm = median_of(low_times);
    normal_pooled.insert(normal_pooled.end(), low_times.begin(), low_times.end());
    before.insert(before.end(), before_times.begin(), before_times.end());

    // Grow-back: the run must have settled at its final micro-batch before the compared window.
    const int64_t final_micro = a_steps.back().at("micro_batch").get<int64_t>();
    int64_t settled = a_steps.back().at("step").get<int64_t>();
    for (auto it = a_steps.rbegin(); it != a_steps.rend(); ++it) {
      if (it->at("micro_batch").get<int64_t>() != final_micro || it->value("oom_retries", int64_t{0}) != 0) break;
      settled = it->at("step").get<int64_t>();
    }
    if (settled > window_start)
      throw std::runtime_error("bench --oom: " + da.string() + ": the run settled at micro-batch " + num(final_micro) +
                               " only at step " + num(settled) + ", after the compared steps began (" +
                               num(window_start) + "); lower memory.grow_after");
    if (fresh_first && final_micro != last_final_micro)
      throw std::runtime_error("bench --oom: " + da.string() + ": grew back to micro-batch " + num(final_micro) +
                               ", not to " + num(last_final_micro) + " as in the round before, at which the fresh "
                               "run of this round started; run --rounds 1 to see why");
    if (!fresh_first) b = run_fresh(final_micro);
    last_final_micro = final_micro;
    // Median step time and samples/s of the compared steps, and minor page faults per step over them
    // (process-wide, read when each line appeared: glibc handing freed memory back and faulting it in
    // again costs time, docs/BENCHMARKS.md).
    auto window = [&](const Job& j, double& step_p50, double& sps_p50, double& faults) {
      std::vector<double> st_times, sps;
      int64_t f0 = -1, f1 = 0;
      for (size_t i = 0; i < j.lines.size(); ++i) {
        const json& l = j.lines[i];
        if (l.contains("event")) continue;
        const int64_t s = l.value("step", int64_t{0});
        if (s == window_start - 1) f0 = j.minflt[i];
        if (s < window_start) continue;
        f1 = j.minflt[i];
        const double t = l.at("step_time_s").get<double>(), w = l.value("data_wait_s", 0.0);
        st_times.push_back(t);
        sps.push_back(static_cast<double>(G) / (t + w));
      }
      step_p50 = median_of(st_times);
      sps_p50 = median_of(sps);
      faults = f0 < 0 ? 0.0 : static_cast<double>(f1 - f0) / static_cast<double>(opts.steps);
    };
    double a_step, a_sps, a_faults, b_step, b_sps, b_faults;
    window(a, a_step, a_sps, a_faults);
    window(b, b_step, b_sps, b_faults);

    recovery.push_back(rec);
    normal.push_back(norm);
    over.push_back(rec / norm);
    overhead.push_back(rec - norm);
    step_ratio.push_back(a_step / b_step);
    sps_ratio.push_back(a_sps / b_sps);
    json grow_events = json::array();
    for (const auto& kind : {"probe", "probe_succeeded", "probe_failed"})
      for (const auto& e : a.events(kind))
        if (e.value("step", int64_t{0}) >= st.raise_step)
          grow_events.push_back({{"event", kind}, {"step", e.value("step", int64_t{0})},
                                 {"new_micro_batch", e.value("new_micro_batch", int64_t{0})}});
    rounds.push_back({{"round", r},
                      {"load_avg", load},
                      {"oom_step", st.oom_step},
                      {"ooms_in_step", ooms},
                      {"micro_batch_before", G},
                      {"micro_batch_after", st.low_micro},
                      {"recovery_s", rec},
                      {"first_to_last_oom_s", t_last_throw - t_throw},
                      {"normal_step_s", norm},
                      {"normal_steps", low_times.size()},
                      {"step_before_cut_s", median_of(before_times)},
                      {"recovery_over_normal", rec / norm},
                      {"oom_step_time_s", oom_line->at("step_time_s").get<double>()},
                      {"raised_after_step", st.raise_step},
                      {"final_micro_batch", final_micro},
                      {"settled_at_step", settled},
                      {"grow_events", grow_events},
                      {"compared_steps", json::array({window_start, total})},
                      {"backoff_run_step_time_s_p50", a_step},
                      {"fresh_run_step_time_s_p50", b_step},
                      {"backoff_run_samples_per_s_p50", a_sps},
                      {"fresh_run_samples_per_s_p50", b_sps},
                      {"fresh_run_ooms", b.events("oom").size()},
                      {"order", fresh_first ? "fresh first" : "backoff first"},
                      {"backoff_run_page_faults_per_step", a_faults},
                      {"fresh_run_page_faults_per_step", b_faults},
                      {"step_time_ratio", a_step / b_step},
                      {"throughput_ratio", a_sps / b_sps}});
    std::cerr << "bench --oom: round " << r << ": recovery " << rec << " s (normal step " << norm
              << " s), grew back to " << final_micro << ", throughput ratio " << a_sps / b_sps << std::endl;
  }

  json j = describe_run(cfg, opts.config_path, opts.overrides, opts.command_line);
  j["mode"] = "oom";
  j["calibration_peak_bytes"] = {{num(G), peak[G]}, {num(h1), peak[h1]}, {num(h2), peak[h2]}};
  j["limits_bytes"] = {{"high", cap_high}, {"cut", cap_cut}, {"mid", cap_mid}};
  j["auto_vs_exhaustive"] = autos;
  j["recovery"] = {{"recovery_s_median", median_of(recovery)},
                   {"normal_step_s_median", median_of(normal)},
                   {"normal_step_s_pooled_median", median_of(normal_pooled)},
                   {"normal_steps_pooled", normal_pooled.size()},
                   {"step_before_cut_s_median", median_of(before)},
                   {"recovery_over_normal_median", median_of(over)},
                   {"overhead_s_median", median_of(overhead)}};
  j["grow_back"] = {{"step_time_ratio_median", median_of(step_ratio)},
                    {"throughput_ratio_median", median_of(sps_ratio)},
                    {"compared_steps", opts.steps}};
  j["rounds"] = rounds;
  j["options"] = {{"rounds", opts.rounds}, {"warmup", opts.warmup}, {"low_steps", opts.low_steps},
                  {"steps", opts.steps}, {"steps_per_run", total}};
  j["threads"] = threads_of(cfg);
  j["wall_s"] = std::chrono::duration<double>(Clock::now() - t_start).count();
  j["config_yaml"] = to_yaml(cfg);
  j.update(env);
  folder.finish(j);
  return j;
}

}  // namespace trainer
