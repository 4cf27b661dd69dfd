// `trainer bench`: a job through the real training loop, timed from its metrics lines.
#include "tools/bench.h"

#include <cstdlib>
#include <filesystem>
#include <map>

#include "common/log.h"
#include "common/signals.h"
#include "tools/bench_job.h"
#include "tools/host_info.h"
#include "tools/metrics_watch.h"
#include "trainer/from_config.h"
#include "trainer/train.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace trainer {

using namespace bench;

double known_peak_tflops(const std::string& name, const std::string& precision) {
  if (precision != "bf16" && precision != "fp16") return 0;
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  // Dense tensor-core figures from NVIDIA's data sheets (their headline figures assume 2:4 sparsity).
  if (has("H200") && !has("NVL")) return 989.4;
  if (has("H100") && (has("HBM3") || has("SXM"))) return 989.4;
  if (has("H100") && has("PCIe")) return 756.0;
  if (has("A100")) return 312.0;
  return 0;
}

std::vector<std::string> bench_overrides(const BenchOptions& opts) {
  // The job itself is untouched; only what would pollute the timing is switched off.
  return {"train.steps=" + std::to_string(opts.warmup + opts.steps), "train.epochs=0", "data.test=",
          "checkpoint.every_steps=0", "checkpoint.every_seconds=0"};
}

json bench_training(Config cfg, const BenchOptions& opts) {
  check_counts(opts);
  const std::vector<std::string> overrides = bench_overrides(opts);
  for (const auto& o : overrides) apply_override(cfg, o);
  validate(cfg);

  bool temporary = opts.run_dir.empty();
  fs::path run_dir = opts.run_dir;
  if (temporary) {
    std::string tmpl = (fs::temp_directory_path() / "trainer-bench-XXXXXX").string();
    if (!mkdtemp(tmpl.data())) throw std::runtime_error(tmpl + ": cannot create a temporary run folder");
    run_dir = tmpl;
  } else if (fs::exists(run_dir / "metrics.jsonl")) {
    throw std::runtime_error("bench: " + (run_dir / "metrics.jsonl").string() +
                             " exists; give --run-dir a new folder (the bench reads back every step line)");
  } else {
    fs::create_directories(run_dir);
  }

  RunOptions ro;
  ro.run_dir = run_dir.string();
  ro.no_resume = true;
  const json env = bench_environment(device_name(cfg));
  int rc;
  std::map<int64_t, double> stamps;
  std::string wall_source;
  {
    MetricsWatcher watcher(run_dir, "metrics.jsonl");
    rc = train(cfg, ro);
    watcher.stop();
    stamps = watcher.stamps();
    wall_source = watcher.source();
  }
  setup_logging("", cfg.log.level);  // let go of the run folder's train.log
  if (rc != kExitOk)
    throw std::runtime_error("bench: training exited with code " + std::to_string(rc) + "; see " +
                             (run_dir / "train.log").string());

  const int64_t last = opts.warmup + opts.steps;
  double wall = 0;
  if (opts.warmup > 0 && stamps.count(opts.warmup) && stamps.count(last)) wall = stamps[last] - stamps[opts.warmup];
  json j = describe_run(cfg, opts);
  j["mode"] = "train";
  j.update(summarize_steps(read_step_records((run_dir / "metrics.jsonl").string()), opts.warmup, opts.steps,
                           cfg.train.global_batch, wall));
  if (wall > 0) j["wall_source"] = wall_source;
  j["warmup_steps"] = opts.warmup;
  j["precision"] = precision_of(cfg);
  j["channels_last"] = cfg.model.channels_last;
  j["threads"] = threads_of(cfg);
  j["loader_workers"] = cfg.data.workers > 0 ? cfg.data.workers : threads_of(cfg);

  // FLOPs from the model's own count (built again here, with trainer/run.cpp's options: train() keeps
  // its model private).
  auto s = j["sample_shape"].get<std::vector<int64_t>>();
  const bool tokens = cfg.data.kind == "tokens";
  const int64_t vocab = tokens ? vocab_size(cfg) : 0;
  const double fwd = build_model(cfg, s, vocab)->forward_flops(s);
  if (tokens) {
    // A sample is a sequence of T tokens; metrics.jsonl's tokens_per_s is samples/s x T as well.
    j["context"] = cfg.model.context;
    j["vocab_size"] = vocab;
    j["tokens_per_s_median"] = j["samples_per_s_median"].get<double>() * static_cast<double>(cfg.model.context);
    j["tokens_per_s_aggregate"] = j["samples_per_s_aggregate"].get<double>() * static_cast<double>(cfg.model.context);
  }
  j["flops_per_sample_forward"] = fwd;
  j["flops_per_sample_train"] = 3 * fwd;  // backward ~ 2x forward (input and weight gradients)
  const double achieved = 3 * fwd * j["samples_per_s_median"].get<double>() / 1e12;
  j["achieved_tflops"] = achieved;
  double peak = opts.peak_tflops;
  std::string source = "--peak-tflops";
  if (peak <= 0) {
    peak = known_peak_tflops(env["device_name"].get<std::string>(), precision_of(cfg));
    source = "table: " + env["device_name"].get<std::string>() + " " + precision_of(cfg);
  }
  j["peak_tflops"] = peak > 0 ? json(peak) : json(nullptr);
  j["peak_tflops_source"] = peak > 0 ? json(source) : json(nullptr);
  j["mfu"] = peak > 0 ? json(achieved / peak) : json(nullptr);
  j["rss_peak_bytes"] = rss_peak_bytes();
  j["config_yaml"] = to_yaml(cfg);
  j["bench_overrides"] = overrides;
  j.update(env);
  j["run_dir"] = temporary ? json(nullptr) : json(run_dir.string());
  if (temporary) {
    std::error_code ec;
    fs::remove_all(run_dir, ec);
  }
  return j;
}

}  // namespace trainer
