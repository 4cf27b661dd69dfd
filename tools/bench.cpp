#include "tools/bench.h"

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
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>

#include "data/dataset.h"
#include "data/image_h5.h"
#include "data/loader.h"
#include "data/tokens.h"
#include "models/registry.h"
#include "common/clock.h"
#include "common/compat.h"
#include "common/log.h"
#include "trainer/checkpoint/store.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/resources.h"
#include "common/signals.h"
#include "trainer/from_config.h"
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
  /// Called on the watcher's thread with every line of the file (events too) as it appears, and the wall
  /// time (seconds since 1970, the system clock) at which it was seen.
  using LineCallback = std::function<void(const json& line, double unix_s)>;

  MetricsWatcher(const fs::path& dir, const std::string& name, LineCallback on_line = nullptr)
      : path_((dir / name).string()), t0_(Clock::now()), on_line_(std::move(on_line)) {
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
      if (on_line_) {
        auto j = json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (j.is_object()) on_line_(j, unix_now());
      }
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
  LineCallback on_line_;
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

// The BLAS libraries mapped into this process (LibTorch's Linear layers call libblas.so.3's sgemm, which
// Debian's update-alternatives points at netlib's reference BLAS or at OpenBLAS: a 10-100x difference).
std::string loaded_blas() {
  std::ifstream in("/proc/self/maps");
  std::string line, out;
  std::vector<std::string> seen;
  while (std::getline(in, line)) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    const std::string base = path.substr(path.rfind('/') + 1);
    if (base.find("blas") == std::string::npos || std::find(seen.begin(), seen.end(), path) != seen.end()) continue;
    seen.push_back(path);
    out += (out.empty() ? "" : ", ") + path;
  }
  return out;
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

// The device a job runs on, as a name with its index ("cuda:0", "cpu").
std::string device_name(const Config& cfg) {
  torch::Device d = resolve_device(cfg.train.device);
  if (d.is_cuda() && !d.has_index()) d = torch::Device(torch::kCUDA, 0);
  return d.str();
}

std::string precision_of(const Config& cfg) { return cfg.amp.enabled ? cfg.amp.dtype : "fp32"; }

int threads_of(const Config& cfg) { return cpu_threads(cfg, /*local_world_size=*/1); }

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
  j["sample_shape"] = sample_shape(cfg);
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
  j["versions"] = {{"trainer", TRAINER_VERSION}, {"torch", compat::torch_version()}, {"cuda", cuda}, {"cudnn", cudnn},
                   {"blas", loaded_blas()}};
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
  const std::string device = device_name(cfg);
  const int threads = threads_of(cfg);
  apply_cpu_threads(threads);
  // On the CPU the training loop's batches come from the capped allocator; measure with it too.
  std::unique_ptr<MemoryBackend> memory;
  if (device == "cpu") memory = make_memory_backend(torch::Device(torch::kCPU));

  if (token_job(cfg)) {
    // The token loader has no workers: next() cuts the windows in the caller's thread, as in training.
    std::shared_ptr<data::TokenSource> tds;
    if (cfg.data.kind == "synthetic") tds = synthetic_tokens(cfg);
    else tds = std::make_shared<data::TokenDataset>(cfg.data.train, cfg.data.in_memory);
    data::TokenLoaderOptions to;
    to.global_batch = cfg.train.global_batch;
    to.context = cfg.model.context;
    to.seed = cfg.seed;
    data::TokenLoader loader(tds, to);
    for (int64_t i = 0; i < opts.warmup; ++i) loader.next();
    const auto t0 = Clock::now();
    int64_t samples = 0;
    for (int64_t i = 0; i < opts.steps; ++i) samples += loader.next().images.size(0);
    const double sps = static_cast<double>(samples) / std::chrono::duration<double>(Clock::now() - t0).count();
    json j = describe_run(cfg, opts);
    j["mode"] = "loader";
    j["samples_per_s"] = sps;
    j["tokens_per_s"] = sps * static_cast<double>(cfg.model.context);
    j["batches"] = opts.steps;
    j["warmup_batches"] = opts.warmup;
    j["workers"] = 0;
    j["prefetch"] = 0;
    j["threads"] = threads;
    j["config_yaml"] = to_yaml(cfg);
    j.update(bench_environment(device));
    return j;
  }
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

// ---- OOM recovery ---------------------------------------------------------------------------------

namespace {

// One training run of the OOM benchmark: its exit code, every metrics line and when each appeared.
struct Job {
  int rc = 0;
  fs::path dir;
  std::vector<json> lines;     // metrics.jsonl in file order
  std::vector<double> seen;    // wall time (seconds since 1970) at which lines[i] appeared
  std::vector<int64_t> minflt;  // the process's minor page faults so far when lines[i] appeared

  std::vector<json> steps() const {
    std::vector<json> out;
    for (const auto& l : lines)
      if (!l.contains("event")) out.push_back(l);
    return out;
  }
  std::vector<json> events(const std::string& kind) const {
    std::vector<json> out;
    for (const auto& l : lines)
      if (l.value("event", "") == kind) out.push_back(l);
    return out;
  }
  // When the step line of `step` appeared (0 if it never did).
  double seen_step(int64_t step) const {
    for (size_t i = 0; i < lines.size(); ++i)
      if (!lines[i].contains("event") && lines[i].value("step", int64_t{-1}) == step) return seen[i];
    return 0;
  }
};

// Runs the job with `sets` on top of `base` into the new folder `dir`, through trainer::train() (the real
// loop), calling `hook` on the watcher's thread with every metrics line as it appears.
Job run_job(const Config& base, const std::vector<std::string>& sets, const fs::path& dir,
            const std::function<void(const json&)>& hook = nullptr) {
  Config cfg = base;
  for (const auto& s : sets) apply_override(cfg, s);
  validate(cfg);
  fs::create_directories(dir);
  Job job;
  job.dir = dir;
  std::mutex mu;
  RunOptions ro;
  ro.run_dir = dir.string();
  ro.no_resume = true;
  {
    MetricsWatcher watcher(dir, "metrics.jsonl", [&](const json& line, double t) {
      rusage ru{};
      getrusage(RUSAGE_SELF, &ru);
      {
        std::lock_guard<std::mutex> lock(mu);
        job.lines.push_back(line);
        job.seen.push_back(t);
        job.minflt.push_back(static_cast<int64_t>(ru.ru_minflt));
      }
      if (hook) hook(line);
    });
    job.rc = train(cfg, ro);
    watcher.stop();
  }
  setup_logging("", base.log.level);  // let go of the run folder's train.log
  return job;
}

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

  const bool temporary = opts.run_dir.empty();
  fs::path root = opts.run_dir;
  if (temporary) {
    std::string tmpl = (fs::temp_directory_path() / "trainer-bench-oom-XXXXXX").string();
    if (!mkdtemp(tmpl.data())) throw std::runtime_error(tmpl + ": cannot create a temporary folder");
    root = tmpl;
  } else if (fs::exists(root) && !fs::is_empty(root)) {
    throw std::runtime_error("bench --oom: " + root.string() + " is not empty; give --run-dir a new folder");
  }
  fs::create_directories(root);
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
      if (temporary) fs::remove_all(d);
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
    const double t_done = a.seen_step(st.oom_step);
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

  json j;
  j["schema"] = kBenchSchema;
  j["mode"] = "oom";
  j["implementation"] = "trainer";
  j["model"] = cfg.model.name;
  const auto shape = sample_shape(cfg);
  j["sample_shape"] = {shape[0], shape[1], shape[2]};
  j["global_batch"] = G;
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
  j["config_file"] = opts.config_path;
  j["overrides"] = opts.overrides;
  j["command_line"] = opts.command_line;
  j["config_yaml"] = to_yaml(cfg);
  j.update(env);
  j["run_dir"] = temporary ? json(nullptr) : json(root.string());
  if (temporary) {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
  return j;
}

// ---- the command line -----------------------------------------------------------------------------

namespace {
void write_result(const json& j, const std::string& out) {
  if (out.empty()) {
    std::cout << j.dump(2) << std::endl;
    return;
  }
  std::ofstream f(out);
  f << j.dump(2) << '\n';
  if (!f.flush()) throw std::runtime_error(out + ": cannot write the bench result");
}
}  // namespace

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
      "oom", "the OOM recovery benchmark: recovery time, auto micro-batch, throughput after grow-back")(
      "rounds", "--oom: alternating (backoff, fresh) run pairs", cxxopts::value<int64_t>()->default_value("3"))(
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

  if (a.count("oom")) {
    BenchOomOptions oo;
    oo.rounds = a["rounds"].as<int64_t>();
    oo.warmup = a.count("warmup") ? opts.warmup : 5;
    oo.steps = a.count("steps") ? opts.steps : 10;
    oo.run_dir = opts.run_dir;
    oo.config_path = opts.config_path;
    oo.overrides = sets;
    oo.command_line = command_line;
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
  json j = a.count("loader-only") ? bench_loader(cfg, opts) : bench_training(cfg, opts);
  const std::string out = a["out"].as<std::string>();
  write_result(j, out);
  if (j["mode"] == "loader") {
    std::cerr << "bench: loader " << cfg.data.kind << " " << j["samples_per_s"].get<double>() << " samples/s with "
              << j["workers"] << " workers" << (out.empty() ? "" : " -> " + out) << std::endl;
  } else {
    std::cerr << "bench: " << cfg.model.name << " batch " << cfg.train.global_batch << " on " << j["device"].get<std::string>()
              << ": step p50 " << j["step_time_s_p50"].get<double>() << " s, p90 " << j["step_time_s_p90"].get<double>()
              << " s, " << j["samples_per_s_median"].get<double>() << " samples/s (median), ";
    if (j.contains("tokens_per_s_median")) std::cerr << j["tokens_per_s_median"].get<double>() << " tokens/s (median), ";
    std::cerr
              << j["samples_per_s_aggregate"].get<double>() << " (aggregate), data wait "
              << 100 * j["data_wait_share"].get<double>() << "%" << (out.empty() ? "" : " -> " + out) << std::endl;
  }
  return kExitOk;
}

}  // namespace trainer
