// The speed-measurement harness (`trainer bench`): runs a configured job through the real training loop
// (trainer::train) for warmup + timed optimizer steps, reads the steps back from metrics.jsonl and
// writes one JSON result; or, with --loader-only, measures the data pipeline alone. bench/reference.py
// writes the same schema for the same job in Python PyTorch, and bench/compare.py runs both in turn.
// docs/BENCHMARKS.md describes every field.
//
// What a timed step is: the optimizer steps after the first `warmup` ones. Per step, metrics.jsonl gives
// step_time_s (the compute of the step: train_step() from batch in hand to the update done, including
// the one host sync) and data_wait_s (time the loop waited for the loader). The wall time of the timed
// steps is taken from when their metrics lines appear in the file (watched with inotify), so it also
// counts what the loop does between steps; the final checkpoint train() writes is after the last timed
// line and is not measured.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "tools/percentile.h"
#include "trainer/config/config.h"

namespace trainer {

/// The name and version of the result schema, written as "schema" in every result.
inline constexpr const char* kBenchSchema = "trainer-bench/1";

struct BenchOptions {
  int64_t warmup = 5;         ///< optimizer steps (loader-only: batches) run first and not measured; >= 0
  int64_t steps = 20;         ///< timed optimizer steps (loader-only: timed batches); >= 1
  double peak_tflops = 0;     ///< the device's peak in TFLOP/s for MFU; 0 = known_peak_tflops() or none
  std::string run_dir;        ///< where train() writes; "" = a temporary folder, removed afterwards
  std::string config_path;    ///< recorded in the result ("" = the built-in job)
  std::vector<std::string> overrides;  ///< the --set assignments, recorded in the result
  std::string command_line;   ///< recorded in the result
  /// --profile: write a Chrome trace of the timed steps here (tools/bench/bench_profile.h); the result then has a
  /// "profile" object and its timings are taken under the profiler. "" = no profile.
  std::string profile_path;
};

/// One optimizer step's line of metrics.jsonl, as the harness reads it.
struct StepRecord {
  int64_t step = 0;            ///< 1-based optimizer step
  double step_time_s = 0;      ///< compute time of the step (seconds)
  double data_wait_s = 0;      ///< time waiting for the loader before the step (seconds)
  int64_t mem_peak_bytes = 0;  ///< the memory backend's peak during the step (bytes)
  int64_t micro_batch = 0;     ///< micro-batch the step completed with
  int64_t oom_retries = 0;     ///< attempts of the step that ran out of memory
  bool updated = true;         ///< false: the update was skipped (non-finite values)
  double loss = 0;
};

/// Reads the step lines (those without an "event" field) of a metrics.jsonl, in file order. Throws
/// std::runtime_error naming the path and line number for a missing file or a malformed line.
std::vector<StepRecord> read_step_records(const std::string& metrics_path);

/// Statistics of the timed steps, i.e. the records with step > warmup (exactly `steps` of them, or
/// std::runtime_error naming what is missing). `wall_s` is the wall time of those steps (<= 0: use the
/// sum of step_time + data_wait). Fields (seconds, bytes, samples per second):
///   timed_steps, step_time_s_{p50,p90,mean,min,max}, step_total_s_{p50,p90} (step_time + data_wait),
///   data_wait_s_sum, data_wait_share = sum data_wait / sum (step_time + data_wait),
///   samples_per_s_median = median over steps of global_batch / (step_time + data_wait),
///   samples_per_s_aggregate = steps * global_batch / wall_s, wall_s, wall_source, figures_basis (what the
///   headline figures are taken over: the wall time, or the summed step times without one),
///   mem_peak_bytes = max over the timed steps, micro_batch (of the last step), oom_retries (sum),
///   skipped_updates, loss_first, loss_last, losses (every record's loss in file order, warmup included).
nlohmann::json summarize_steps(const std::vector<StepRecord>& records, int64_t warmup, int64_t steps,
                               int64_t global_batch, double wall_s);

/// Dense peak TFLOP/s of a known GPU (by its CUDA device name) for `precision` "bf16" or "fp16" (tensor
/// cores, no sparsity): H100 SXM (name has "H100" and "HBM3" or "SXM") and H200 (not NVL) 989.4,
/// H100 PCIe 756.0, A100 312.0. 0 for anything else, fp32 and CPUs: give --peak-tflops then.
/// bench/reference.py holds the same table.
double known_peak_tflops(const std::string& device_name, const std::string& precision);

/// Where and with what a measurement ran: date (UTC, ISO 8601), host {hostname, cpu_model (from
/// /proc/cpuinfo), nproc (online CPUs), usable_cpus, load_avg [1, 5, 15 min]}, versions {trainer, torch,
/// cuda, cudnn ("" without CUDA), blas (the BLAS libraries mapped into the process, from /proc/self/maps,
/// comma-separated)}, and for a CUDA `device` its device_name ("" for the CPU).
nlohmann::json bench_environment(const std::string& device);

/// What the bench sets on top of the job: train.steps = warmup + steps, train.epochs = 0, data.test = ""
/// (no evaluation), checkpoint.every_steps = 0 and every_seconds = 0 (no periodic checkpoints), as
/// `--set` assignments.
std::vector<std::string> bench_overrides(const BenchOptions& opts);

/// Runs `cfg`, with bench_overrides(opts) applied (listed under "bench_overrides"), through
/// trainer::train() for opts.warmup + opts.steps optimizer steps, and returns the result: summarize_steps()
/// plus mode "train", implementation "trainer", model, sample_shape ((C, H, W), or (T) for data.kind tokens,
/// where a sample is one sequence), global_batch, precision (fp32 | bf16 |
/// fp16), channels_last, device, threads, loader_workers, warmup_steps, flops_per_sample_forward
/// (models::ModelImpl::forward_flops), flops_per_sample_train (3x forward), achieved_tflops (train FLOPs x
/// samples_per_s_aggregate / 1e12: by wall time), peak_tflops, peak_tflops_source, mfu (achieved / peak; null
/// when no peak is known), achieved_tflops_median_step and mfu_median_step (the same of the median step),
/// since_model_built_s (step 1's metrics line: from the model built to the first step's start; null if the
/// line has none) and first_step_time_s, rss_peak_bytes, config_yaml (resolved, with the bench overrides), config_file,
/// overrides, command_line, and bench_environment()'s fields; for a token job also context (T), vocab_size
/// (the token file's, which the model is built with), tokens_per_s_median and tokens_per_s_aggregate
/// (samples/s x T); with opts.profile_path, profile (StepProfiler::describe(): the trace of the timed
/// steps, CPU ops and on CUDA the device's activity) and profiled: true. Throws std::runtime_error when training
/// fails (the message names the run folder, which is then kept) and ConfigError for a bad config.
nlohmann::json bench_training(Config cfg, const BenchOptions& opts);

/// Measures the training data pipeline alone: a data::Loader over the config's training split with its
/// augmentation, workers (data.workers, 0 = usable CPUs) and prefetch; opts.warmup batches untimed, then
/// data::measure_loader_throughput over opts.steps batches. Returns mode "loader", samples_per_s,
/// batches, global_batch, sample_shape, workers, prefetch, the augmentation, config_yaml, and
/// bench_environment()'s fields. For data.kind tokens: data::TokenLoader::next() timed in the calling
/// thread (it has no workers), with tokens_per_s, workers 0, prefetch 0 and no augmentation.
nlohmann::json bench_loader(const Config& cfg, const BenchOptions& opts);

/// The optimizer's update alone (docs/BENCHMARKS.md "The optimizer's update"): the job's model built on its
/// device, a random gradient per parameter (seeded, scale 1e-3, copied in before each step outside the
/// timing), opts.warmup untimed then opts.steps timed Optimizer::step calls at optim.lr. Returns mode
/// "optimizer": optimizer, state_dtype, implementation_used, device, threads, parameters, tensors,
/// state_bytes (and per parameter), step_s (each timed step), step_s_median, ns_per_parameter (the median
/// step's), param_shapes ({shape, decay} per tensor, for a reference to time the same tensors),
/// config_yaml and bench_environment()'s fields.
nlohmann::json bench_optimizer(const Config& cfg, const BenchOptions& opts);

/// Options of the OOM recovery benchmark (bench_oom).
struct BenchOomOptions {
  int64_t rounds = 3;     ///< (backoff run, fresh run) pairs, alternating; >= 1
  int64_t warmup = 5;     ///< steps at the global batch before the cap is cut; >= 1
  int64_t low_steps = 4;  ///< steps after the OOM step before the cap is raised again; >= 1
  int64_t steps = 10;     ///< last steps of both runs whose throughput is compared; >= 1
  /// How the largest fitting micro-batch is found: "exhaustive" (every size, bench_search.h) or "bisect"
  /// (a bisection and `search_window` sizes either side: for jobs whose runs take seconds each).
  std::string search = "exhaustive";
  int64_t search_window = 4;
  std::string run_dir;    ///< keep every run's folder under here (new or empty); "" = temporary, removed
  std::string config_path;             ///< recorded in the result
  std::vector<std::string> overrides;  ///< recorded in the result
  std::string command_line;            ///< recorded in the result
};

/// The OOM recovery benchmark (docs/BENCHMARKS.md "OOM recovery"), under the real cap (memory.limit and
/// control.yaml), every run through trainer::train():
///   1. calibration: uncapped 3-step runs at micro-batches G (the global batch), h1 = ceil(G/2) and
///      h2 = ceil(h1/2) give their peaks p(.); the limits are high = 1.25 p(G), cut = (p(h2) + p(h1)) / 2
///      (h2 fits, h1 does not), mid = (p(h1) + p(G)) / 2;
///   2. under the cut and the mid limit: the largest micro-batch that fits, by an exhaustive search (a
///      fresh 2-step run at every size from G down to half the largest that fits, each pinned to its
///      size: floor = size, no recomputation; sizes below the largest that still fail are listed),
///      against what `train.micro_batch: auto` picks (and where it is after 3 steps);
///   3. `rounds` times: (A) a run at G under the high limit, cut through control.yaml after `warmup`
///      steps (OOMs, backoff), raised again `low_steps` steps after the OOM step (grow-back); (B) a run
///      that starts at A's final micro-batch under the high limit, with no growth; A then B in odd
///      rounds, B then A in even ones (B at the size A reached in the round before). Recovery = when the OOM step's
///      metrics line appeared - the time_unix_s of the step's first OOM memory report; against the median
///      step time of A's clean steps at the backed-off micro-batch before the raise (per round, and pooled
///      over the rounds) and of A's steps 2..warmup at G. Throughput: median samples/s of A's and B's last
///      `steps` steps, and the process's minor page faults per step over them.
/// Returns mode "oom": calibration_peak_bytes, limits_bytes, auto_vs_exhaustive (per limit), recovery and
/// grow_back (medians over the rounds), rounds (every figure per round), and the environment. Throws
/// std::runtime_error naming the run folder (which is then kept) when a run fails or the scenario did
/// not unfold, std::invalid_argument for bad options or a global batch below 4.
nlohmann::json bench_oom(Config cfg, const BenchOomOptions& opts);

/// Options of the memory curve benchmark (bench_memory_curve).
struct BenchCurveOptions {
  int64_t steps = 3;            ///< optimizer steps of every curve run (>= 2: the first carries no optimizer state)
  std::vector<int64_t> limits;  ///< --limit: predict under each (bytes)
  bool check = false;           ///< --check: measure every prediction against the exhaustive search
  int64_t rounds = 3;           ///< --check: auto runs with and without the fit's start, each, alternating; >= 1
  std::string run_dir;          ///< keep every run's folder under here (new or empty); "" = temporary, removed
  std::string config_path;             ///< recorded in the result
  std::vector<std::string> overrides;  ///< recorded in the result
  std::string command_line;            ///< recorded in the result
};

/// The memory curve (docs/BENCHMARKS.md "Memory curve"): the peak tensor memory of a training step of
/// the job (its global batch G) at micro-batch 1, 2, 4, ... and G, without and with activation
/// checkpointing ("none", "all"), each a fresh run of `steps` steps pinned to its size (no ladder), until
/// G or the first size that runs out of memory (under the job's own memory.limit, or the device's);
/// per point the largest step peak and the median step time of the steps after the first. Fits
/// peak = fixed + per_sample x micro-batch by least squares (trainer/memory/curve.h) with its residuals.
/// Per limit: the largest micro-batch predicted to fit for each setting, the samples/s each would train
/// at (the measured samples/s interpolated linearly in the micro-batch) and the choice (the faster; none
/// when neither fits). With `check`, per limit: the exhaustive search of each setting (bench_search.h),
/// the measured step time at each true largest (the true choice), and `rounds` x 2 runs of `micro_batch:
/// auto` (with the job's setting) alternating with and without memory.curve (the fit's start): picks,
/// probes and search time. The result (mode "memory_curve") is what memory.curve reads. Throws
/// std::runtime_error naming the run folder when a run fails, std::invalid_argument for bad options.
nlohmann::json bench_memory_curve(Config cfg, const BenchCurveOptions& opts);

/// `trainer bench --config FILE [--set k=v ...] [--warmup N] [--steps N] [--out FILE.json] [--loader-only | --optimizer]
/// [--peak-tflops X] [--run-dir DIR] [--profile TRACE.json]`, or `trainer bench --oom [--rounds N] ...` (bench_oom; --warmup and
/// --steps default to 5 and 10 there), or `trainer bench --memory-curve [--limit SIZE ...] [--check]
/// [--steps N] [--rounds N] ...` (bench_memory_curve; --steps defaults to 3): argv[0] is "bench". Prints a one-line summary to stderr and the
/// JSON to --out (or stdout). Returns the exit code; throws std::exception with a one-line message for
/// bad input.
int bench_main(int argc, char** argv);

}  // namespace trainer
