// The `trainer bench` command line.
#include "tools/bench/bench.h"

#include <cxxopts.hpp>

#include <fstream>
#include <iostream>

#include "common/signals.h"
#include "tools/bench/bench_decode.h"
#include "tools/bench/bench_job.h"
#include "trainer/dist/dist.h"
#include "trainer/memory/backend.h"

using nlohmann::json;

namespace trainer {

using namespace bench;

namespace {

cxxopts::Options bench_options() {
  cxxopts::Options o("trainer bench",
                     "Measure a job's training speed through the real loop (or its data pipeline alone) and "
                     "write one JSON result (docs/BENCHMARKS.md)");
  o.add_options()("c,config", "YAML config (default: the built-in job)", cxxopts::value<std::string>()->default_value(""))(
      "s,set", "override a key: --set train.global_batch=64 (repeatable)", cxxopts::value<std::string>())(
      "warmup", "optimizer steps (batches) run first, not measured", cxxopts::value<int64_t>()->default_value("5"))(
      "steps", "timed optimizer steps (batches)", cxxopts::value<int64_t>()->default_value("20"))(
      "out", "write the JSON here (default: stdout)", cxxopts::value<std::string>()->default_value(""))(
      "loader-only", "measure the data pipeline alone")(
      "optimizer", "measure the optimizer's update alone, on the job's model with random gradients")(
      "oom", "the OOM recovery benchmark: recovery time, auto micro-batch, throughput after grow-back")(
      "rounds", "--oom: alternating (backoff, fresh) run pairs; --memory-curve --check: auto runs with and without "
      "the fit's start", cxxopts::value<int64_t>()->default_value("3"))(
      "search", "--oom: how the largest micro-batch that fits is found: exhaustive (every size) or bisect (a "
      "bisection, then 4 sizes either side)", cxxopts::value<std::string>()->default_value("exhaustive"))(
      "memory-curve", "the peak memory of a step against the micro-batch, with and without activation "
      "checkpointing, fitted; predictions under --limit")(
      "limit", "--memory-curve: a memory limit to predict the micro-batch under (repeatable)",
      cxxopts::value<std::vector<std::string>>())(
      "check", "--memory-curve: check every prediction against the exhaustive search, and auto with and without "
      "the fit's start")(
      "profile", "write a Chrome trace of the timed steps (LibTorch's profiler; CUDA kernels too on a GPU) "
      "to this file; bench/profile_table.py compares it with bench/reference.py --profile's",
      cxxopts::value<std::string>()->default_value(""))(
      "peak-tflops", "the device's peak TFLOP/s, for MFU (default: a table of known GPUs)",
      cxxopts::value<double>()->default_value("0"))(
      "run-dir", "keep the run folder here (default: a temporary one, removed)",
      cxxopts::value<std::string>()->default_value(""))("h,help", "this help");
  return o;
}

// --set values are taken out before cxxopts sees them (it would split `data.shape=[3,64,64]` at commas):
// returns them, and leaves the other arguments in `rest`.
std::vector<std::string> take_sets(int argc, char** argv, std::vector<char*>& rest) {
  std::vector<std::string> sets;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if ((arg == "--set" || arg == "-s") && i + 1 < argc) sets.push_back(argv[++i]);
    else if (arg.rfind("--set=", 0) == 0) sets.push_back(arg.substr(6));
    else rest.push_back(argv[i]);
  }
  return sets;
}

void write_result(const json& j, const std::string& out) {
  if (out.empty()) {
    std::cout << j.dump(2) << std::endl;
    return;
  }
  std::ofstream f(out);
  f << j.dump(2) << '\n';
  if (!f.flush()) throw std::runtime_error(out + ": cannot write the bench result");
}

int run_oom(const cxxopts::ParseResult& a, const BenchOptions& opts, const Config& cfg) {
  BenchOomOptions oo;
  oo.rounds = a["rounds"].as<int64_t>();
  oo.search = a["search"].as<std::string>();
  oo.warmup = a.count("warmup") ? opts.warmup : 5;
  oo.steps = a.count("steps") ? opts.steps : 10;
  oo.run_dir = opts.run_dir;
  oo.config_path = opts.config_path;
  oo.overrides = opts.overrides;
  oo.command_line = opts.command_line;
  json j = bench_oom(cfg, oo);  // it sets steps, limits and micro-batches per run itself
  write_result(j, a["out"].as<std::string>());
  const auto& rec = j["recovery"];
  std::cerr << "bench --oom: " << cfg.model.name << " batch " << cfg.train.global_batch << ": recovery "
            << rec["recovery_s_median"].get<double>() << " s against a " << rec["normal_step_s_median"].get<double>()
            << " s step (median of " << oo.rounds << "), auto/largest";
  for (const auto& x : j["auto_vs_exhaustive"])
    std::cerr << " " << x["auto_micro_batch"] << "/" << x["largest_fitting_micro_batch"];
  std::cerr << ", throughput after grow-back / fresh " << j["grow_back"]["throughput_ratio_median"].get<double>()
            << std::endl;
  return kExitOk;
}

int run_curve(const cxxopts::ParseResult& a, const BenchOptions& opts, const Config& cfg) {
  BenchCurveOptions co;
  co.steps = a.count("steps") ? opts.steps : 3;
  co.rounds = a["rounds"].as<int64_t>();
  co.check = a.count("check") > 0;
  if (a.count("limit"))
    for (const auto& l : a["limit"].as<std::vector<std::string>>()) co.limits.push_back(parse_bytes(l));
  co.run_dir = opts.run_dir;
  co.config_path = opts.config_path;
  co.overrides = opts.overrides;
  co.command_line = opts.command_line;
  json j = bench_memory_curve(cfg, co);  // it sets steps, micro-batches and limits per run itself
  write_result(j, a["out"].as<std::string>());
  for (const auto& [setting, c] : j["curves"].items()) {
    std::cerr << "bench --memory-curve: " << cfg.model.name << " batch " << cfg.train.global_batch << ", checkpointing "
              << setting << ": " << c["points"].size() << " points, ending at " << c["stopped"].get<std::string>();
    if (!c["fit"].is_null())
      std::cerr << "; fit " << format_bytes(static_cast<int64_t>(c["fit"]["fixed_bytes"].get<double>())) << " + "
                << format_bytes(static_cast<int64_t>(c["fit"]["per_sample_bytes"].get<double>()))
                << " per sample, largest residual "
                << format_bytes(static_cast<int64_t>(c["fit"]["max_abs_residual_bytes"].get<double>()));
    std::cerr << std::endl;
  }
  for (const auto& pr : j["predictions"]) {
    std::cerr << "bench --memory-curve: under " << format_bytes(pr["limit_bytes"].get<int64_t>()) << ": micro-batch";
    for (const std::string s : {"none", "all"})
      std::cerr << " " << (pr[s].is_null() ? std::string("-") : pr[s]["micro_batch"].dump()) << " (" << s << ")";
    std::cerr << ", choose " << pr["choice"].get<std::string>();
    if (pr.contains("check")) {
      const json& c = pr["check"];
      std::cerr << "; exhaustive " << c["none"]["micro_batch"] << " / " << c["all"]["micro_batch"] << ", best "
                << c["best"].get<std::string>();
      if (!c["auto"].is_null())
        std::cerr << ", auto search " << c["auto"]["search_s_median_without_start"].get<double>() << " s -> "
                  << c["auto"]["search_s_median_with_start"].get<double>() << " s from the fit's start";
      if (!c["joint"].is_null())
        std::cerr << "; a run with activation_checkpointing: auto took " << c["joint"]["setting"].get<std::string>()
                  << " at " << c["joint"]["micro_batch"] << " (" << c["joint"]["ooms_in_the_step"] << " OOMs in its step)";
    }
    std::cerr << std::endl;
  }
  return kExitOk;
}

// The one-line summary of a training or loader result.
void print_summary(const json& j, const Config& cfg, const std::string& out) {
  if (j["mode"] == "loader") {
    std::cerr << "bench: loader " << mode_name(cfg.data.kind) << " " << j["samples_per_s"].get<double>() << " samples/s with "
              << j["workers"] << " workers" << (out.empty() ? "" : " -> " + out) << std::endl;
  } else if (j["mode"] == "optimizer") {
    std::cerr << "bench: " << j["optimizer"].get<std::string>() << " (" << j["state_dtype"].get<std::string>()
              << " state) on " << cfg.model.name << "'s " << j["parameters"] << " parameters, " << j["device"].get<std::string>()
              << ": " << j["step_s_median"].get<double>() << " s a step, " << j["ns_per_parameter"].get<double>()
              << " ns a parameter, state " << j["state_bytes_per_parameter"].get<double>() << " bytes a parameter"
              << (out.empty() ? "" : " -> " + out) << std::endl;
  } else {
    // The headline figures by wall time over the timed steps; the step times beside them.
    std::cerr << "bench: " << cfg.model.name << " batch " << cfg.train.global_batch << " on " << j["device"].get<std::string>()
              << ": " << j["samples_per_s_aggregate"].get<double>() << " samples/s";
    if (j.contains("tokens_per_s_aggregate")) std::cerr << ", " << j["tokens_per_s_aggregate"].get<double>() << " tokens/s";
    if (!j["mfu"].is_null()) std::cerr << ", MFU " << 100 * j["mfu"].get<double>() << "%";
    std::cerr << " (" << j["figures_basis"].get<std::string>() << ": " << j["timed_steps"] << " steps in "
              << j["wall_s"].get<double>() << " s); step p50 " << j["step_time_s_p50"].get<double>() << " s, p90 "
              << j["step_time_s_p90"].get<double>() << " s, data wait " << 100 * j["data_wait_share"].get<double>() << "%"
              << (out.empty() ? "" : " -> " + out) << std::endl;
    if (j.contains("profile"))
      std::cerr << "bench: profile of steps " << j["profile"]["first_step"] << ".." << j["profile"]["last_step"] << " ("
                << j["profile"]["writer"].get<std::string>() << ") -> " << j["profile"]["trace"].get<std::string>()
                << "; the timings above were taken under the profiler" << std::endl;
  }
}

}  // namespace

int bench_main(int argc, char** argv) {
  // The decoder alone (tools/bench/bench_decode.h) takes no config and has its own options.
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--decode-only") return bench_decode_main(argc, argv);
  cxxopts::Options o = bench_options();
  std::string command_line = "trainer";
  for (int i = 0; i < argc; ++i) command_line += std::string(" ") + argv[i];
  std::vector<char*> rest;
  const std::vector<std::string> sets = take_sets(argc, argv, rest);
  int rest_argc = static_cast<int>(rest.size());
  cxxopts::ParseResult a;
  try {
    a = o.parse(rest_argc, rest.data());
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("command line: ") + e.what() + " (see trainer bench --help)");
  }
  if (a.count("help")) {
    std::cout << o.help() << std::endl;
    return kExitOk;
  }
  if (!a.unmatched().empty())
    throw std::runtime_error("command line: unexpected argument '" + a.unmatched()[0] + "' (see trainer bench --help)");

  BenchOptions opts;
  opts.warmup = a["warmup"].as<int64_t>();
  opts.steps = a["steps"].as<int64_t>();
  opts.peak_tflops = a["peak-tflops"].as<double>();
  opts.run_dir = a["run-dir"].as<std::string>();
  opts.config_path = a["config"].as<std::string>();
  opts.overrides = sets;
  opts.command_line = command_line;
  opts.profile_path = a["profile"].as<std::string>();
  // Under torchrun every rank benches its own part: a rank past 0 writes its files beside rank 0's.
  const int64_t rank = dist_env_from().rank;
  const std::string rank_suffix = rank > 0 ? ".rank" + std::to_string(rank) : "";
  if (!opts.profile_path.empty()) opts.profile_path += rank_suffix;
  check_counts(opts);
  if (!opts.profile_path.empty() && (a.count("loader-only") || a.count("optimizer") || a.count("oom") || a.count("memory-curve")))
    throw std::runtime_error("command line: --profile profiles training steps; it does not go with --loader-only, "
                             "--optimizer, --oom or --memory-curve");
  // The bench's own settings go last, so the config validates with them (a job file may set epochs only).
  std::vector<std::string> all_sets = sets;
  for (const auto& o : bench_overrides(opts)) all_sets.push_back(o);
  Config cfg = load_config(opts.config_path, all_sets);

  if (a.count("oom")) return run_oom(a, opts, cfg);
  if (a.count("memory-curve")) return run_curve(a, opts, cfg);
  json j = a.count("loader-only") ? bench_loader(cfg, opts) : a.count("optimizer") ? bench_optimizer(cfg, opts) : bench_training(cfg, opts);
  const std::string out = a["out"].as<std::string>().empty() ? "" : a["out"].as<std::string>() + rank_suffix;
  write_result(j, out);
  print_summary(j, cfg, out);
  return kExitOk;
}

}  // namespace trainer
