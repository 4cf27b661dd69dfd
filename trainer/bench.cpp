#include "trainer/bench.h"

#include <cxxopts.hpp>
#include <spdlog/spdlog.h>

#include <torch/torch.h>

#ifdef TRAINER_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/detail/CUDAHooksInterface.h>
#endif

#include <fcntl.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>

#include "data/dataset.h"
#include "data/image_h5.h"
#include "data/loader.h"
#include "models/registry.h"
#include "trainer/checkpoint.h"
#include "trainer/compat.h"
#include "trainer/log.h"
#include "trainer/memory.h"
#include "trainer/resources.h"
#include "trainer/signals.h"
#include "trainer/train.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;

// ---- reading the timed steps' wall time -------------------------------------------------------------
//
// train() only writes metrics.jsonl; the wall time of the timed steps is the time between the appearance
// of the last warmup step's line and the last timed step's line. A thread watches the file (inotify on
// its folder; polling every millisecond where inotify is unavailable) and stamps each step line when it
// appears. MetricsLog flushes every line, so the stamp trails the write by the wake-up latency only.
class MetricsWatcher {
 public:
  MetricsWatcher(const fs::path& dir, const std::string& name) : path_((dir / name).string()), t0_(Clock::now()) {
    fd_ = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fd_ >= 0 && inotify_add_watch(fd_, dir.c_str(), IN_MODIFY | IN_CREATE) < 0) {
      close(fd_);
      fd_ = -1;
    }
    thread_ = std::thread([this] { loop(); });
  }
  ~MetricsWatcher() {
    stop();
    if (fd_ >= 0) close(fd_);
    if (file_ >= 0) close(file_);
  }
  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  /// Seconds since construction at which each step's line was first seen.
  std::map<int64_t, double> stamps() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stamps_;
  }
  std::string source() const { return fd_ >= 0 ? "metrics lines (inotify)" : "metrics lines (polling)"; }

 private:
  void loop() {
    while (!stop_) {
      if (fd_ >= 0) {
        pollfd p{fd_, POLLIN, 0};
        ::poll(&p, 1, 20);  // the timeout only bounds how long stop() waits
        char buf[4096];
        while (::read(fd_, buf, sizeof buf) > 0) {
        }
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      drain(std::chrono::duration<double>(Clock::now() - t0_).count());
    }
    drain(std::chrono::duration<double>(Clock::now() - t0_).count());
  }

  void drain(double t) {
    if (file_ < 0) file_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (file_ < 0) return;
    char buf[65536];
    ssize_t n;
    while ((n = ::read(file_, buf, sizeof buf)) > 0) pending_.append(buf, static_cast<size_t>(n));
    size_t start = 0, end;
    while ((end = pending_.find('\n', start)) != std::string::npos) {
      const std::string line = pending_.substr(start, end - start);
      start = end + 1;
      if (line.find("\"event\"") != std::string::npos) continue;
      auto j = json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.contains("step")) {
        std::lock_guard<std::mutex> lock(mu_);
        stamps_.emplace(j["step"].get<int64_t>(), t);
      }
    }
    pending_.erase(0, start);
  }

  std::string path_;
  Clock::time_point t0_;
  int fd_ = -1, file_ = -1;
  std::string pending_;
  std::atomic<bool> stop_{false};
  mutable std::mutex mu_;
  std::map<int64_t, double> stamps_;
  std::thread thread_;
};

// ---- the host -------------------------------------------------------------------------------------

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos) {
        auto v = line.substr(colon + 1);
        v.erase(0, v.find_first_not_of(" \t"));
        return v;
      }
    }
  }
  return "";
}

std::vector<double> load_avg() {
  double l[3] = {0, 0, 0};
  if (getloadavg(l, 3) != 3) return {};
  return {l[0], l[1], l[2]};
}

#ifdef TRAINER_WITH_CUDA
// First line of a command's output ("" if it fails): only used for the GPU driver's version.
std::string first_line_of(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>/dev/null").c_str(), "r");
  if (!p) return "";
  char buf[256] = {0};
  std::string out = fgets(buf, sizeof buf, p) ? buf : "";
  pclose(p);
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r' || out.back() == ' ')) out.pop_back();
  return out;
}
#endif

int64_t rss_peak_bytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;  // Linux reports kilobytes
}

std::string resolve_device(const std::string& spec) {
  torch::Device d = spec == "auto" ? (torch::cuda::is_available() ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU))
                                   : torch::Device(spec);
  if (d.is_cuda() && !d.has_index()) d = torch::Device(torch::kCUDA, 0);
  return d.str();
}

std::string precision_of(const Config& cfg) { return cfg.amp.enabled ? cfg.amp.dtype : "fp32"; }

std::array<int64_t, 3> sample_shape_of(const Config& cfg) {
  if (cfg.data.kind == "synthetic") return {cfg.data.shape[0], cfg.data.shape[1], cfg.data.shape[2]};
  return data::ImageH5Dataset(cfg.data.train, /*in_memory=*/false).sample_shape();
}

int threads_of(const Config& cfg) {
  return cfg.train.threads > 0 ? static_cast<int>(cfg.train.threads) : usable_cpus();
}

void check_counts(const BenchOptions& opts) {
  if (opts.warmup < 0)
    throw std::invalid_argument("bench: --warmup must be >= 0, got " + std::to_string(opts.warmup));
  if (opts.steps < 1) throw std::invalid_argument("bench: --steps must be >= 1, got " + std::to_string(opts.steps));
}

json describe_run(const Config& cfg, const BenchOptions& opts) {
  json j;
  j["schema"] = kBenchSchema;
  j["implementation"] = "trainer";
  j["model"] = cfg.model.name;
  auto s = sample_shape_of(cfg);
  j["sample_shape"] = {s[0], s[1], s[2]};
  j["global_batch"] = cfg.train.global_batch;
  j["config_file"] = opts.config_path;
  j["overrides"] = opts.overrides;
  j["command_line"] = opts.command_line;
  return j;
}

}  // namespace

// ---- statistics -----------------------------------------------------------------------------------

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

double percentile(std::vector<double> values, double q) {
  if (values.empty()) throw std::invalid_argument("percentile: no values");
  if (!(q >= 0 && q <= 100)) throw std::invalid_argument("percentile: q must lie in [0, 100], got " + std::to_string(q));
  std::sort(values.begin(), values.end());
  const double rank = q / 100.0 * static_cast<double>(values.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, values.size() - 1);
  return values[lo] + (rank - static_cast<double>(lo)) * (values[hi] - values[lo]);
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
  j["mem_peak_bytes"] = mem_peak;
  j["micro_batch"] = timed.back().micro_batch;
  j["oom_retries"] = ooms;
  j["skipped_updates"] = skipped;
  j["loss_first"] = loss_first;
  j["loss_last"] = loss_last;
  return j;
}

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

json bench_environment(const std::string& device) {
  json j;
  j["date"] = utc_now_iso();
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  j["host"] = {{"hostname", host},
               {"cpu_model", cpu_model()},
               {"nproc", static_cast<int64_t>(sysconf(_SC_NPROCESSORS_ONLN))},
               {"usable_cpus", usable_cpus()},
               {"load_avg", load_avg()}};
  std::string cuda, cudnn, name, driver;
#ifdef TRAINER_WITH_CUDA
  try {
    if (at::hasCUDA()) {
      const long v = at::detail::getCUDAHooks().versionCUDART();  // e.g. 12040
      cuda = std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
      if (at::detail::getCUDAHooks().compiledWithCuDNN()) cudnn = std::to_string(at::detail::getCUDAHooks().versionCuDNN());
    }
    torch::Device d(device);
    if (d.is_cuda()) {
      name = at::cuda::getDeviceProperties(d.has_index() ? d.index() : 0)->name;
      driver = first_line_of("nvidia-smi --query-gpu=driver_version --format=csv,noheader");
    }
  } catch (const std::exception& e) {
    spdlog::warn("bench: could not read the CUDA versions or device name: {}", e.what());
  }
#endif
  j["versions"] = {{"trainer", TRAINER_VERSION}, {"torch", compat::torch_version()}, {"cuda", cuda}, {"cudnn", cudnn}};
  j["device"] = device;
  j["device_name"] = name;
  if (!driver.empty()) j["driver"] = driver;
  return j;
}

// ---- the measurements -----------------------------------------------------------------------------

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
  const json env = bench_environment(resolve_device(cfg.train.device));
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

  // FLOPs from the model's own count (built again here: train() keeps its model private).
  auto s = j["sample_shape"].get<std::vector<int64_t>>();
  auto model = models::create_model(cfg.model.name, models::ModelOptions()
                                                        .num_classes(cfg.model.num_classes)
                                                        .in_channels(s[0])
                                                        .zero_init_residual(cfg.model.zero_init_residual));
  const double fwd = model->forward_flops(s);
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

json bench_loader(const Config& cfg_in, const BenchOptions& opts) {
  check_counts(opts);
  Config cfg = cfg_in;
  validate(cfg);
  const std::string device = resolve_device(cfg.train.device);
  const int threads = threads_of(cfg);
  apply_cpu_threads(threads);
  // On the CPU the training loop's batches come from the capped allocator; measure with it too.
  std::unique_ptr<MemoryBackend> memory;
  if (device == "cpu") memory = make_memory_backend(torch::Device(torch::kCPU));

  std::shared_ptr<data::ImageDataset> ds;
  if (cfg.data.kind == "synthetic")
    ds = std::make_shared<data::SyntheticImageDataset>(cfg.data.synthetic_size, cfg.data.shape[0], cfg.data.shape[1],
                                                       cfg.data.shape[2], cfg.model.num_classes, cfg.seed);
  else
    ds = std::make_shared<data::ImageH5Dataset>(cfg.data.train, cfg.data.in_memory);
  // The same options as the training loop's loader (trainer/run.cpp).
  data::LoaderOptions lo;
  lo.global_batch = cfg.train.global_batch;
  lo.seed = cfg.seed;
  lo.workers = cfg.data.workers > 0 ? cfg.data.workers : threads;
  lo.prefetch = cfg.data.prefetch;
  lo.augment.random_crop_padding = cfg.data.crop_padding;
  lo.augment.hflip = cfg.data.hflip;
  lo.augment.normalize = cfg.data.normalize;
  lo.pin_memory = device != "cpu";
  data::Loader loader(ds, lo);
  for (int64_t i = 0; i < opts.warmup; ++i) loader.next();
  const double sps = data::measure_loader_throughput(loader, static_cast<int>(opts.steps));

  json j = describe_run(cfg, opts);
  j["mode"] = "loader";
  j["samples_per_s"] = sps;
  j["batches"] = opts.steps;
  j["warmup_batches"] = opts.warmup;
  j["workers"] = lo.workers;
  j["prefetch"] = lo.prefetch;
  j["augment"] = {{"crop_padding", lo.augment.random_crop_padding},
                  {"hflip", lo.augment.hflip},
                  {"normalize", lo.augment.normalize},
                  {"pin_memory", loader.pinned()}};
  j["threads"] = threads;
  j["config_yaml"] = to_yaml(cfg);
  j.update(bench_environment(device));
  return j;
}

// ---- the command line -----------------------------------------------------------------------------

int bench_main(int argc, char** argv) {
  cxxopts::Options o("trainer bench",
                     "Measure a job's training speed through the real loop (or its data pipeline alone) and "
                     "write one JSON result (docs/BENCHMARKS.md)");
  o.add_options()("c,config", "YAML config (default: the built-in job)", cxxopts::value<std::string>()->default_value(""))(
      "s,set", "override a key: --set train.global_batch=64 (repeatable)", cxxopts::value<std::string>())(
      "warmup", "optimizer steps (batches) run first, not measured", cxxopts::value<int64_t>()->default_value("5"))(
      "steps", "timed optimizer steps (batches)", cxxopts::value<int64_t>()->default_value("20"))(
      "out", "write the JSON here (default: stdout)", cxxopts::value<std::string>()->default_value(""))(
      "loader-only", "measure the data pipeline alone")(
      "peak-tflops", "the device's peak TFLOP/s, for MFU (default: a table of known GPUs)",
      cxxopts::value<double>()->default_value("0"))(
      "run-dir", "keep the run folder here (default: a temporary one, removed)",
      cxxopts::value<std::string>()->default_value(""))("h,help", "this help");
  std::string command_line = "trainer";
  for (int i = 0; i < argc; ++i) command_line += std::string(" ") + argv[i];
  // --set values are taken out before cxxopts sees them (it would split `data.shape=[3,64,64]` at commas).
  std::vector<std::string> sets;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if ((arg == "--set" || arg == "-s") && i + 1 < argc) sets.push_back(argv[++i]);
    else if (arg.rfind("--set=", 0) == 0) sets.push_back(arg.substr(6));
    else rest.push_back(argv[i]);
  }
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
  check_counts(opts);
  // The bench's own settings go last, so the config validates with them (a job file may set epochs only).
  std::vector<std::string> all_sets = sets;
  for (const auto& o : bench_overrides(opts)) all_sets.push_back(o);
  Config cfg = load_config(opts.config_path, all_sets);

  json j = a.count("loader-only") ? bench_loader(cfg, opts) : bench_training(cfg, opts);
  const std::string out = a["out"].as<std::string>();
  if (out.empty()) {
    std::cout << j.dump(2) << std::endl;
  } else {
    std::ofstream f(out);
    f << j.dump(2) << '\n';
    if (!f.flush()) throw std::runtime_error(out + ": cannot write the bench result");
  }
  if (j["mode"] == "loader") {
    std::cerr << "bench: loader " << cfg.data.kind << " " << j["samples_per_s"].get<double>() << " samples/s with "
              << j["workers"] << " workers" << (out.empty() ? "" : " -> " + out) << std::endl;
  } else {
    std::cerr << "bench: " << cfg.model.name << " batch " << cfg.train.global_batch << " on " << j["device"].get<std::string>()
              << ": step p50 " << j["step_time_s_p50"].get<double>() << " s, p90 " << j["step_time_s_p90"].get<double>()
              << " s, " << j["samples_per_s_median"].get<double>() << " samples/s (median), "
              << j["samples_per_s_aggregate"].get<double>() << " (aggregate), data wait "
              << 100 * j["data_wait_share"].get<double>() << "%" << (out.empty() ? "" : " -> " + out) << std::endl;
  }
  return kExitOk;
}

}  // namespace trainer
