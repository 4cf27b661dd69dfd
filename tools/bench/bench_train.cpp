// `trainer bench`: a job through the real training loop, timed from its metrics lines.
#include "tools/bench/bench.h"

#include <filesystem>

#include "common/signals.h"
#include "tools/bench/bench_job.h"
#include "tools/bench/bench_profile.h"
#include "tools/bench/host_info.h"
#include "trainer/run/from_config.h"

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
          "checkpoint.every_steps=0", "checkpoint.every_seconds=0", "checkpoint.final=false"};
}

namespace {

// The wall time of the timed steps: from the last warmup step's line to the last timed step's line
// (0 without warmup steps, or if a line was not seen: summarize_steps then sums the step times).
double timed_wall_s(const Job& job, const BenchOptions& opts) {
  if (opts.warmup <= 0) return 0;
  const int64_t first = job.step_line(opts.warmup), last = job.step_line(opts.warmup + opts.steps);
  return first >= 0 && last >= 0 ? job.elapsed[last] - job.elapsed[first] : 0;
}

// FLOPs per sample from the model's own count, the achieved TFLOP/s and MFU; for a token job the
// context, vocabulary and tokens/s.
void add_flops(json& j, const Config& cfg, const BenchOptions& opts, const std::string& gpu_name) {
  // The model is built again here, with trainer/run/run.cpp's options: train() keeps its model private.
  auto s = j["sample_shape"].get<std::vector<int64_t>>();
  const bool tokens = token_job(cfg);
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
  // By wall time over the timed steps (samples_per_s_aggregate), as every headline figure; the median
  // step's beside it, named so.
  const double achieved = 3 * fwd * j["samples_per_s_aggregate"].get<double>() / 1e12;
  const double achieved_median = 3 * fwd * j["samples_per_s_median"].get<double>() / 1e12;
  j["achieved_tflops"] = achieved;
  j["achieved_tflops_median_step"] = achieved_median;
  double peak = opts.peak_tflops;
  std::string source = "--peak-tflops";
  if (peak <= 0) {
    peak = known_peak_tflops(gpu_name, precision_of(cfg));
    source = "table: " + gpu_name + " " + precision_of(cfg);
  }
  j["peak_tflops"] = peak > 0 ? json(peak) : json(nullptr);
  j["peak_tflops_source"] = peak > 0 ? json(source) : json(nullptr);
  j["mfu"] = peak > 0 ? json(achieved / peak) : json(nullptr);
  j["mfu_median_step"] = peak > 0 ? json(achieved_median / peak) : json(nullptr);
}

// The run's start: step 1's since_model_built_s (from the model built to the step's start: the first
// batch, the micro-batch search, cuDNN's pretuning) and the step's own time (cuDNN's timings at `start`).
void add_first_step(json& j, const Job& job) {
  const int64_t i = job.step_line(1);
  const json* first = i >= 0 ? &job.lines[static_cast<size_t>(i)] : nullptr;
  j["since_model_built_s"] = first && first->contains("since_model_built_s") ? (*first)["since_model_built_s"] : json(nullptr);
  j["first_step_time_s"] = first ? json(first->value("step_time_s", 0.0)) : json(nullptr);
}

}  // namespace

json bench_training(Config cfg, const BenchOptions& opts) {
  check_counts(opts);
  const std::vector<std::string> overrides = bench_overrides(opts);
  for (const auto& o : overrides) apply_override(cfg, o);
  validate(cfg);
  const fs::path metrics = fs::path(opts.run_dir) / "metrics.jsonl";
  RunFolder::check_not_held(opts.run_dir);
  if (!opts.run_dir.empty() && fs::exists(metrics))
    throw std::runtime_error("bench: " + metrics.string() +
                             " exists; give --run-dir a new folder (the bench reads back every step line)");
  const RunFolder folder = RunFolder::make(opts.run_dir, "trainer-bench");

  const json env = bench_environment(device_name(cfg));
  std::unique_ptr<StepProfiler> profiler;
  if (!opts.profile_path.empty())
    profiler = std::make_unique<StepProfiler>(opts.warmup + 1, opts.warmup + opts.steps, opts.profile_path,
                                              resolve_device(cfg.train.device).is_cuda());
  const Job job = run_job(cfg, {}, folder.path, nullptr, profiler.get());
  if (job.rc != kExitOk)
    throw std::runtime_error("bench: training exited with code " + std::to_string(job.rc) + "; see " +
                             (folder.path / "train.log").string());

  const double wall = timed_wall_s(job, opts);
  json j = describe_run(cfg, opts.config_path, opts.overrides, opts.command_line);
  j["mode"] = "train";
  j.update(summarize_steps(read_step_records((rank_metrics_dir(folder.path) / "metrics.jsonl").string()), opts.warmup, opts.steps,
                           cfg.train.global_batch, wall));
  if (wall > 0) j["wall_source"] = job.watch_source;
  j["warmup_steps"] = opts.warmup;
  j["precision"] = precision_of(cfg);
  j["channels_last"] = cfg.model.channels_last;
  j["threads"] = threads_of(cfg);
  j["loader_workers"] = cfg.data.workers > 0 ? cfg.data.workers : threads_of(cfg);
  add_flops(j, cfg, opts, env["device_name"].get<std::string>());
  add_first_step(j, job);
  j["rss_peak_bytes"] = host_rss_peak_bytes();
  j["config_yaml"] = to_yaml(cfg);
  j["bench_overrides"] = overrides;
  if (profiler) {
    j["profile"] = profiler->describe();
    j["profiled"] = true;  // the timings above include the profiler's overhead
  }
  j.update(env);
  folder.finish(j);
  return j;
}

}  // namespace trainer
