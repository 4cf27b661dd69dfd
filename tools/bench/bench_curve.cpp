// `trainer bench --memory-curve`: the peak memory of a training step against the micro-batch, without
// and with activation checkpointing, its fit, what the fit predicts under given limits, and (--check)
// how the predictions compare with the exhaustive search, whether the fit's start makes `micro_batch:
// auto` faster, and what a run with `activation_checkpointing: auto` picks from the curve. Phases: the
// curves, the predictions, the checks, the result (tools/bench/bench.h).
#include "tools/bench/bench.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <map>

#include "common/signals.h"
#include "tools/bench/bench_job.h"
#include "tools/bench/bench_search.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/curve.h"
#include "trainer/run/from_config.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace trainer {

using namespace bench;

namespace {

// memory.activation_checkpointing: the settings a curve is measured at.
const std::vector<std::string> kSettings = {mode_name(Checkpointing::kNone), mode_name(Checkpointing::kAll)};

// The job's own setting among those (every_k and auto count as none).
const std::string& own_setting(const Config& cfg) {
  return mode_name(cfg.memory.activation_checkpointing == Checkpointing::kAll ? Checkpointing::kAll : Checkpointing::kNone);
}

std::string curve_failed(const Job& j, const std::string& what) {
  return job_failed(j, "bench --memory-curve: " + what);
}

struct CurvePlan {
  Config cfg;  // the job, with evaluation and periodic checkpoints off
  BenchCurveOptions opts;
  RunFolder root;
  int64_t G = 0;               // the global batch: the largest micro-batch
  std::vector<int64_t> sizes;  // 1, 2, 4, ... below G, then G
};

CurvePlan plan_curve(Config cfg, const BenchCurveOptions& opts) {
  if (opts.steps < 2)
    throw std::invalid_argument("bench --memory-curve: --steps must be >= 2 (the first step runs without the "
                                "optimizer state), got " + std::to_string(opts.steps));
  if (opts.rounds < 1) throw std::invalid_argument("bench --memory-curve: --rounds must be >= 1, got " + std::to_string(opts.rounds));
  if (opts.check && opts.limits.empty())
    throw std::invalid_argument("bench --memory-curve: --check needs at least one --limit to check under");
  for (const auto& o : {"train.epochs=0", "data.test=", "checkpoint.every_steps=0", "checkpoint.every_seconds=0"})
    apply_override(cfg, o);
  validate(cfg);
  RunFolder::check_not_held(opts.run_dir);
  if (!opts.run_dir.empty() && fs::exists(opts.run_dir) && !fs::is_empty(opts.run_dir))
    throw std::runtime_error("bench --memory-curve: " + opts.run_dir + " is not empty; give --run-dir a new folder");
  CurvePlan p;
  p.cfg = cfg;
  p.opts = opts;
  p.root = RunFolder::make(opts.run_dir, "trainer-bench-curve");
  p.G = cfg.train.global_batch;
  for (int64_t m = 1; m < p.G; m *= 2) p.sizes.push_back(m);
  p.sizes.push_back(p.G);
  return p;
}

// The sets that pin a run to micro-batch m with checkpointing `setting`: no backoff, no recomputation
// rung, no growth.
std::vector<std::string> pinned(int64_t m, const std::string& setting) {
  return {"train.micro_batch=" + std::to_string(m), "memory.min_micro_batch=" + std::to_string(m), "memory.ladder_checkpointing=false",
          "memory.activation_checkpointing=" + setting, kNoGrowth, kQuiet};
}

// ---- 1. the curves ------------------------------------------------------------------------------------

struct Point {
  int64_t micro_batch = 0, peak_bytes = 0;
  double step_time_s = 0, samples_per_s = 0;
};

struct Curve {
  std::vector<Point> points;
  std::string stopped;            // why the curve ends
  std::optional<MemoryFit> fit;   // with two or more points
};

// The largest step peak of a run, and the median step time of its steps after the first.
Point point_of(const Job& j, int64_t m, int64_t global_batch) {
  Point pt;
  pt.micro_batch = m;
  std::vector<double> times;
  for (const auto& l : j.steps()) {
    pt.peak_bytes = std::max(pt.peak_bytes, l.value("mem_peak_bytes", int64_t{0}));
    if (l.value("step", int64_t{0}) > 1) times.push_back(l.at("step_time_s").get<double>());
  }
  pt.step_time_s = median_of(times);
  pt.samples_per_s = pt.step_time_s > 0 ? static_cast<double>(global_batch) / pt.step_time_s : 0.0;
  return pt;
}

Curve measure_curve(const CurvePlan& p, const std::string& setting) {
  Curve c;
  c.stopped = "the global batch";
  for (int64_t m : p.sizes) {
    std::vector<std::string> sets = pinned(m, setting);
    sets.push_back("train.steps=" + std::to_string(p.opts.steps));
    const fs::path d = p.root.path / ("curve_" + setting + "_mb" + std::to_string(m));
    Job j = run_job(p.cfg, sets, d);
    if (j.rc == kExitOomGaveUp) {
      c.stopped = "out of memory at micro-batch " + std::to_string(m);
      break;
    }
    if (j.rc != kExitOk) throw std::runtime_error(curve_failed(j, "the curve run at micro-batch " + std::to_string(m) + " failed"));
    c.points.push_back(point_of(j, m, p.G));
    std::cerr << "bench --memory-curve: " << setting << " micro-batch " << m << ": peak "
              << format_bytes(c.points.back().peak_bytes) << ", step " << c.points.back().step_time_s << " s"
              << std::endl;
  }
  std::vector<CurvePoint> pts;
  for (const auto& pt : c.points) pts.push_back({pt.micro_batch, pt.peak_bytes, pt.samples_per_s});
  if (pts.size() >= 2) c.fit = fit_memory_curve(pts);
  return c;
}

json curve_json(const Curve& c) {
  json points = json::array();
  for (size_t i = 0; i < c.points.size(); ++i) {
    const Point& pt = c.points[i];
    json j = {{"micro_batch", pt.micro_batch}, {"peak_bytes", pt.peak_bytes}, {"step_time_s", pt.step_time_s},
              {"samples_per_s", pt.samples_per_s}};
    if (c.fit) {
      j["fitted_bytes"] = c.fit->peak_at(pt.micro_batch);
      j["residual_bytes"] = c.fit->residuals_bytes[i];
      j["residual_fraction"] = c.fit->residuals_bytes[i] / static_cast<double>(pt.peak_bytes);
    }
    points.push_back(j);
  }
  return {{"points", points}, {"stopped", c.stopped}, {"fit", c.fit ? c.fit->to_json() : json(nullptr)}};
}

// ---- 2. the predictions -------------------------------------------------------------------------------

// The curves as `memory.curve` reads them back (trainer/memory/curve.h), for the predictions.
MemoryCurve as_memory_curve(const std::map<std::string, Curve>& curves) {
  MemoryCurve mc;
  for (const auto& [setting, c] : curves) {
    for (const auto& pt : c.points) mc.points[setting].push_back({pt.micro_batch, pt.peak_bytes, pt.samples_per_s});
    if (c.fit) mc.fits[setting] = *c.fit;
  }
  return mc;
}

// Under `limit`: per setting the largest micro-batch the fit predicts and the samples/s it would train
// at; the choice is the faster setting (choose_setting: what a run with activation_checkpointing: auto
// and this curve takes).
json predict(const CurvePlan& p, const std::map<std::string, Curve>& curves, int64_t limit) {
  const MemoryCurve mc = as_memory_curve(curves);
  json j = {{"limit_bytes", limit}};
  for (const auto& setting : kSettings) {
    const auto fit = mc.fits.find(setting);
    if (fit == mc.fits.end()) {
      j[setting] = nullptr;
      continue;
    }
    const int64_t m = predict_max_micro_batch(fit->second, limit, p.G);
    j[setting] = {{"micro_batch", m},
                  {"fitted_peak_bytes", m > 0 ? fit->second.peak_at(m) : 0.0},
                  {"samples_per_s_estimate", m > 0 ? interpolate_samples_per_s(mc.points.at(setting), m) : 0.0}};
  }
  j["choice"] = choose_setting(mc, limit, p.G).setting;
  return j;
}

// ---- 3. the checks ------------------------------------------------------------------------------------

// The true largest micro-batch of a setting under `limit`, and the step time measured there.
json truth_of(const CurvePlan& p, const std::string& setting, int64_t limit, const std::string& tag) {
  const Search s = exhaustive_search(p.cfg, {"memory.activation_checkpointing=" + setting}, p.G, limit, p.root.path,
                                     "search_" + tag + "_" + setting, /*below=*/false, p.root.temporary);
  json j = {{"micro_batch", s.largest}, {"searched", s.tried}, {"runs", s.tried.size()}};
  if (s.largest == 0) return j;
  std::vector<std::string> sets = pinned(s.largest, setting);
  sets.push_back("memory.limit=" + std::to_string(limit));
  sets.push_back("train.steps=" + std::to_string(p.opts.steps + 2));
  Job t = run_job(p.cfg, sets, p.root.path / ("time_" + tag + "_" + setting));
  if (t.rc != kExitOk) throw std::runtime_error(curve_failed(t, "the timing run at micro-batch " + std::to_string(s.largest) + " failed"));
  const Point pt = point_of(t, s.largest, p.G);
  j["step_time_s"] = pt.step_time_s;
  j["samples_per_s"] = pt.samples_per_s;
  j["ooms"] = t.events("oom").size();
  return j;
}

// One `micro_batch: auto` run (one step: the search comes before it), with or without the curve's start,
// with `extra` sets.
json auto_run(const CurvePlan& p, int64_t limit, const fs::path& curve_file, bool with_start, const std::string& name,
              const std::vector<std::string>& extra = {}) {
  std::vector<std::string> sets = {"train.micro_batch=auto", "memory.limit=" + std::to_string(limit), "train.steps=1", kNoGrowth,
                                   kQuiet};
  if (with_start) sets.push_back("memory.curve=" + curve_file.string());
  sets.insert(sets.end(), extra.begin(), extra.end());
  Job a = run_job(p.cfg, sets, p.root.path / name);
  if (a.rc != kExitOk) throw std::runtime_error(curve_failed(a, "the micro_batch: auto run failed"));
  const auto ev = a.events("auto_micro_batch");
  if (ev.empty()) throw std::runtime_error("bench --memory-curve: " + (a.dir / "metrics.jsonl").string() +
                                           " has no auto_micro_batch event");
  return {{"micro_batch", ev[0].at("micro_batch")}, {"start", ev[0].at("start")}, {"probes", ev[0].at("probes")},
          {"search_s", ev[0].at("search_s")}, {"checkpointing", ev[0].at("checkpointing")},
          {"checkpointing_from", ev[0].at("checkpointing_from")}, {"ooms_in_the_step", a.events("oom").size()}};
}

// A run with micro_batch: auto, activation_checkpointing: auto and the curve picks the setting and the
// size before its first step: against the exhaustive search's faster setting and its largest size.
json joint_run(const CurvePlan& p, int64_t limit, const fs::path& curve_file, const json& truth, const std::string& tag) {
  json j = auto_run(p, limit, curve_file, true, "joint_" + tag, {"memory.activation_checkpointing=auto"});
  const std::string setting = j["checkpointing"].get<bool>() ? "all" : "none";
  j["setting"] = setting;
  j["setting_agrees"] = setting == truth["best"];
  j["micro_batch_minus_exhaustive"] = j["micro_batch"].get<int64_t>() - truth[setting]["micro_batch"].get<int64_t>();
  return j;
}

// `rounds` pairs, the order alternating (with first in odd rounds): the picks must agree; the probes
// and search times side by side, with their medians.
json auto_side_by_side(const CurvePlan& p, int64_t limit, const fs::path& curve_file, const std::string& tag) {
  json rounds = json::array();
  std::map<bool, std::vector<double>> times, probes;
  for (int64_t r = 1; r <= p.opts.rounds; ++r) {
    json row = {{"round", r}, {"order", r % 2 == 1 ? "with start first" : "without start first"}};
    for (bool with_start : r % 2 == 1 ? std::vector<bool>{true, false} : std::vector<bool>{false, true}) {
      const std::string key = with_start ? "with_start" : "without_start";
      row[key] = auto_run(p, limit, curve_file, with_start, "auto_" + tag + "_" + key + "_r" + std::to_string(r));
      times[with_start].push_back(row[key]["search_s"].get<double>());
      probes[with_start].push_back(row[key]["probes"].get<double>());
    }
    // The same answer either way when the fits are monotone in the micro-batch (find_max_micro_batch).
    row["picks_agree"] = row["with_start"]["micro_batch"] == row["without_start"]["micro_batch"];
    rounds.push_back(row);
  }
  return {{"setting", own_setting(p.cfg)},
          {"rounds", rounds},
          {"search_s_median_with_start", median_of(times[true])},
          {"search_s_median_without_start", median_of(times[false])},
          {"probes_median_with_start", median_of(probes[true])},
          {"probes_median_without_start", median_of(probes[false])},
          {"speedup_median", median_of(times[false]) / std::max(1e-9, median_of(times[true]))}};
}

// The prediction under one limit against the exhaustive search and the measured step times.
json check(const CurvePlan& p, const json& prediction, int64_t limit, const fs::path& curve_file, size_t index) {
  const std::string tag = "limit" + std::to_string(index + 1);
  json truth = {{"limit_bytes", limit}};
  std::string best = "neither";
  double best_sps = 0;
  for (const auto& setting : kSettings) {
    truth[setting] = truth_of(p, setting, limit, tag);
    const double sps = truth[setting].value("samples_per_s", 0.0);
    if (truth[setting]["micro_batch"].get<int64_t>() > 0 && sps > best_sps) {
      best_sps = sps;
      best = setting;
    }
    if (!prediction[setting].is_null())
      truth[setting]["predicted_minus_exhaustive"] =
          prediction[setting]["micro_batch"].get<int64_t>() - truth[setting]["micro_batch"].get<int64_t>();
  }
  truth["best"] = best;
  truth["choice_agrees"] = prediction["choice"] == best;
  // micro_batch: auto runs with the job's own setting; when nothing fits there, it has nothing to find.
  const std::string& own = own_setting(p.cfg);
  truth["auto"] = truth[own]["micro_batch"].get<int64_t>() > 0 ? auto_side_by_side(p, limit, curve_file, tag)
                                                               : json(nullptr);
  truth["joint"] = best != "neither" ? joint_run(p, limit, curve_file, truth, tag) : json(nullptr);
  return truth;
}

// ---- 4. the result ------------------------------------------------------------------------------------

json curve_header(const CurvePlan& p, const std::map<std::string, Curve>& curves) {
  json j = describe_run(p.cfg, p.opts.config_path, p.opts.overrides, p.opts.command_line);
  j["mode"] = "memory_curve";
  j["precision"] = precision_of(p.cfg);
  j["device"] = device_name(p.cfg);
  j["threads"] = threads_of(p.cfg);
  j["steps_per_run"] = p.opts.steps;
  j["curves"] = json::object();
  for (const auto& [setting, c] : curves) j["curves"][setting] = curve_json(c);
  return j;
}

void write_json(const fs::path& path, const json& j) {
  std::ofstream f(path);
  f << j.dump(2) << '\n';
  if (!f.flush()) throw std::runtime_error(path.string() + ": cannot write the memory curve");
}

}  // namespace

json bench_memory_curve(Config cfg, const BenchCurveOptions& opts) {
  CurvePlan p = plan_curve(std::move(cfg), opts);
  const json env = bench_environment(device_name(p.cfg));
  const auto t_start = std::chrono::steady_clock::now();
  std::map<std::string, Curve> curves;
  for (const auto& setting : kSettings) curves[setting] = measure_curve(p, setting);
  json j = curve_header(p, curves);
  // What memory.curve reads, for the auto runs of the checks.
  const fs::path curve_file = p.root.path / "memory_curve.json";
  write_json(curve_file, j);
  j["predictions"] = json::array();
  for (size_t i = 0; i < opts.limits.size(); ++i) {
    json pred = predict(p, curves, opts.limits[i]);
    if (opts.check) pred["check"] = check(p, pred, opts.limits[i], curve_file, i);
    j["predictions"].push_back(pred);
  }
  j["config_yaml"] = to_yaml(p.cfg);
  j["wall_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  j.update(env);
  p.root.finish(j);
  return j;
}

}  // namespace trainer
