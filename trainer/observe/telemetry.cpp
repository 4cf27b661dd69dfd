#include "trainer/observe/telemetry.h"

#include <unistd.h>

#include <spdlog/fmt/fmt.h>

#include <cmath>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "common/clock.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/resources.h"

namespace trainer {
namespace {

double seconds_between(Telemetry::Clock::time_point a, Telemetry::Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Prometheus label values escape backslash, double quote and newline.
std::string escape_label(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

// A value the exposition format accepts and a test can compare exactly: the shortest text that reads
// back as the same double. Non-finite values never reach here (they would break naive scrapers); they
// are written as 0.
std::string format_value(double v) {
  if (!std::isfinite(v)) v = 0;
  return fmt::format("{}", v);
}

/// Appends one metric family with a single sample.
void family(std::string& out, const std::string& name, const char* type, const char* help, double value,
            const std::string& labels = "") {
  out += "# HELP " + name + " " + help + "\n";
  out += "# TYPE " + name + " " + type + "\n";
  out += name;
  if (!labels.empty()) out += "{" + labels + "}";
  out += " " + format_value(value) + "\n";
}

template <typename T>
bool get_number(const nlohmann::json& j, const char* key, T& out) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number()) return false;
  out = it->get<T>();
  return true;
}

}  // namespace


// ---- Telemetry --------------------------------------------------------------------------------------

Telemetry::Telemetry(double heartbeat_timeout_s) : heartbeat_timeout_s_(heartbeat_timeout_s) {
  if (!(heartbeat_timeout_s > 0))
    throw std::invalid_argument("telemetry: heartbeat timeout must be > 0 seconds, got " +
                                std::to_string(heartbeat_timeout_s));
  created_ = heartbeat_ = last_checkpoint_ = Clock::now();
  counters_.phase = "setup";
}

void Telemetry::on_step(const StepTelemetry& s) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t total = s.total_steps > 0 ? s.total_steps : step_.total_steps;
  step_ = s;
  step_.total_steps = total;
  heartbeat_ = now;
  counters_.phase = "train";
}

void Telemetry::set_memory(const DeviceMemoryTelemetry& m) {
  std::lock_guard<std::mutex> lock(mu_);
  memory_ = m;
}

void Telemetry::set_total_steps(int64_t total_steps) {
  std::lock_guard<std::mutex> lock(mu_);
  step_.total_steps = total_steps;
}

void Telemetry::observe(const nlohmann::json& r) {
  if (!r.is_object()) return;
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  heartbeat_ = now;
  auto ev = r.find("event");
  if (ev == r.end()) {
    // A step line: only the fields it has move.
    if (!get_number(r, "step", step_.step)) return;
    get_number(r, "epoch", step_.epoch);
    get_number(r, "samples_seen", step_.samples_seen);
    get_number(r, "loss", step_.loss);
    get_number(r, "lr", step_.lr);
    get_number(r, "samples_per_s", step_.samples_per_s);
    get_number(r, "step_time_s", step_.step_time_s);
    get_number(r, "data_wait_s", step_.data_wait_s);
    get_number(r, "micro_batch", step_.micro_batch);
    get_number(r, "accum_steps", step_.accum_steps);
    get_number(r, "mem_peak_bytes", memory_.peak);
    get_number(r, "mem_limit_bytes", memory_.limit);
    counters_.phase = "train";
    return;
  }
  if (!ev->is_string()) return;
  const std::string kind = ev->get<std::string>();
  if (kind == "oom") {
    // The step writes one "oom" line per failed attempt, with the ladder's answer as "kind" (the
    // controller's own event for it is not written separately).
    ++counters_.ooms;
    auto k = r.find("kind");
    const std::string answer = k != r.end() && k->is_string() ? k->get<std::string>() : "";
    if (answer == "backoff" || answer == "checkpointing_on") ++counters_.backoffs;
    else if (answer == "probe_failed") ++counters_.probes_failed;
  } else if (kind == "backoff" || kind == "checkpointing_on") {
    ++counters_.backoffs;
  } else if (kind == "probe") {
    ++counters_.probes;
  } else if (kind == "probe_failed") {
    ++counters_.probes_failed;
  } else if (kind == "limit_changed") {
    ++counters_.limit_changes;
  } else if (kind == "checkpoint") {
    ++counters_.checkpoints;
    last_checkpoint_ = now;
    checkpointed_ = true;
    counters_.last_checkpoint_unix_s = unix_now();
  } else if (kind == "eval") {
    ++counters_.evals;
    get_number(r, "loss", counters_.eval_loss);
    get_number(r, "top1", counters_.eval_top1);
  } else if (kind == "nonfinite") {
    ++counters_.nonfinite_steps;
  } else if (kind == "start") {
    get_number(r, "total_steps", step_.total_steps);
  } else if (kind == "resume") {
    get_number(r, "step", step_.step);
    double created = 0;
    if (get_number(r, "checkpoint_created_unix", created) && created > 0) counters_.last_checkpoint_unix_s = created;
  } else if (kind == "stop" || kind == "end" || kind == "oom_gave_up" || kind == "error") {
    counters_.stopping = true;
    counters_.phase = kind == "end" ? "done" : "stopping";
  }
}

void Telemetry::add(int64_t TelemetrySnapshot::*counter, int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  counters_.*counter += n;
}
void Telemetry::add_oom(int64_t n) { add(&TelemetrySnapshot::ooms, n); }
void Telemetry::add_backoff(int64_t n) { add(&TelemetrySnapshot::backoffs, n); }
void Telemetry::add_probe(int64_t n) { add(&TelemetrySnapshot::probes, n); }
void Telemetry::add_probe_failed(int64_t n) { add(&TelemetrySnapshot::probes_failed, n); }
void Telemetry::on_checkpoint() {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  ++counters_.checkpoints;
  last_checkpoint_ = heartbeat_ = now;
  checkpointed_ = true;
  counters_.last_checkpoint_unix_s = unix_now();
}
void Telemetry::on_eval(double loss, double top1) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  ++counters_.evals;
  counters_.eval_loss = loss;
  counters_.eval_top1 = top1;
  heartbeat_ = now;
}
void Telemetry::heartbeat() {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  heartbeat_ = now;
}
void Telemetry::set_phase(const std::string& phase) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  counters_.phase = phase;
  heartbeat_ = now;
}
void Telemetry::set_ready(bool ready) {
  std::lock_guard<std::mutex> lock(mu_);
  counters_.ready = ready;
}
void Telemetry::set_stopping() {
  std::lock_guard<std::mutex> lock(mu_);
  counters_.stopping = true;
  counters_.phase = "stopping";
}
void Telemetry::set_info(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(mu_);
  counters_.info[key] = value;
}
void Telemetry::set_gpu_utilization(double percent) {
  std::lock_guard<std::mutex> lock(mu_);
  counters_.gpu_utilization = percent;
}

void Telemetry::set_gpu(const GpuIdentity& gpu) {
  std::lock_guard<std::mutex> lock(mu_);
  counters_.gpu = gpu;
}

void Telemetry::request_memory_report() {
  std::lock_guard<std::mutex> lock(mu_);
  report_requested_ = true;
}
bool Telemetry::take_memory_report_request() {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  if (!report_requested_) return false;
  if (last_report_taken_ && seconds_between(*last_report_taken_, now) < report_interval_s_) return false;
  report_requested_ = false;
  last_report_taken_ = now;
  return true;
}
void Telemetry::set_memory_report_interval_s(double seconds) {
  if (!(seconds >= 0)) throw std::invalid_argument("telemetry: the memory report interval must be >= 0 seconds");
  std::lock_guard<std::mutex> lock(mu_);
  report_interval_s_ = seconds;
}
void Telemetry::set_memory_report(const std::string& json_text) {
  std::lock_guard<std::mutex> lock(mu_);
  memory_report_ = json_text;
}
std::string Telemetry::memory_report() const {
  std::lock_guard<std::mutex> lock(mu_);
  return memory_report_;
}

TelemetrySnapshot Telemetry::snapshot() const {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  TelemetrySnapshot s = counters_;
  s.step = step_;
  s.memory = memory_;
  s.uptime_s = seconds_between(created_, now);
  s.heartbeat_age_s = seconds_between(heartbeat_, now);
  s.seconds_since_checkpoint = seconds_between(checkpointed_ ? last_checkpoint_ : created_, now);
  return s;
}

double Telemetry::heartbeat_timeout_s() const {
  std::lock_guard<std::mutex> lock(mu_);
  return heartbeat_timeout_s_;
}

void Telemetry::set_heartbeat_timeout_s(double seconds) {
  if (!(seconds > 0))
    throw std::invalid_argument("telemetry: heartbeat timeout must be > 0 seconds, got " + std::to_string(seconds));
  std::lock_guard<std::mutex> lock(mu_);
  heartbeat_timeout_s_ = seconds;
}

bool Telemetry::live(std::string* why) const {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  const double age = seconds_between(heartbeat_, now);
  const bool ok = age < heartbeat_timeout_s_;
  if (why)
    *why = fmt::format("{}: last heartbeat {:.3f} s ago (threshold {} s), phase {}", ok ? "ok" : "stalled", age,
                       heartbeat_timeout_s_, counters_.phase);
  return ok;
}

bool Telemetry::ready(std::string* why) const {
  std::lock_guard<std::mutex> lock(mu_);
  const bool ok = counters_.ready && !counters_.stopping;
  if (why) {
    if (ok) *why = "ready: training, phase " + counters_.phase;
    else if (counters_.stopping) *why = "not ready: the run is stopping (phase " + counters_.phase + ")";
    else *why = "not ready: setup has not finished (phase " + counters_.phase + ")";
  }
  return ok;
}

namespace {

// The exposition in four groups; `s` is one snapshot, so every group describes the same instant.

void progress_families(std::string& o, const TelemetrySnapshot& s) {
  std::string info;
  for (const auto& [k, v] : s.info) info += (info.empty() ? "" : ",") + k + "=\"" + escape_label(v) + "\"";
  family(o, "trainer_info", "gauge", "Constant 1; the labels describe the run.", 1, info);
  family(o, "trainer_phase", "gauge", "Constant 1; the label names what the loop does now.", 1,
         "phase=\"" + escape_label(s.phase) + "\"");
  family(o, "trainer_ready", "gauge", "1 while setup has finished and the run is not stopping (as /readyz).",
         s.ready && !s.stopping ? 1 : 0);
  family(o, "trainer_step", "gauge", "Optimizer steps completed.", static_cast<double>(s.step.step));
  family(o, "trainer_total_steps", "gauge", "Optimizer steps the run will do.", static_cast<double>(s.step.total_steps));
  family(o, "trainer_epoch", "gauge", "Epochs completed (fractional).", s.step.epoch);
  family(o, "trainer_samples_seen_total", "counter", "Training samples consumed.", static_cast<double>(s.step.samples_seen));
  family(o, "trainer_samples_per_second", "gauge", "Training throughput of the last step, waiting for data included.",
         s.step.samples_per_s);
  family(o, "trainer_step_time_seconds", "gauge", "Duration of the last optimizer step (forward, backward, update).",
         s.step.step_time_s);
  family(o, "trainer_data_wait_seconds", "gauge", "Time the last step waited for its batch.", s.step.data_wait_s);
  family(o, "trainer_loss", "gauge", "Mean training loss of the last step's global batch.", s.step.loss);
  family(o, "trainer_learning_rate", "gauge", "Learning rate of the last step.", s.step.lr);
  family(o, "trainer_micro_batch", "gauge", "Samples per forward/backward pass.", static_cast<double>(s.step.micro_batch));
  family(o, "trainer_accumulation_steps", "gauge", "Micro-batches per optimizer step.",
         static_cast<double>(s.step.accum_steps));
}

void event_families(std::string& o, const TelemetrySnapshot& s) {
  family(o, "trainer_oom_total", "counter", "Step attempts that ran out of memory.", static_cast<double>(s.ooms));
  family(o, "trainer_backoff_total", "counter",
         "OOM answers: micro-batch halved or activation checkpointing turned on.", static_cast<double>(s.backoffs));
  family(o, "trainer_grow_probes_total", "counter", "Grow-back probes started (larger micro-batch or checkpointing off).",
         static_cast<double>(s.probes));
  family(o, "trainer_grow_probes_failed_total", "counter", "Grow-back probes that ran out of memory.",
         static_cast<double>(s.probes_failed));
  family(o, "trainer_memory_limit_changes_total", "counter", "Changes of the memory limit seen by the controller.",
         static_cast<double>(s.limit_changes));
  family(o, "trainer_allocation_refusals_total", "counter",
         "CPU tensor allocations refused by the capped allocator (0 on CUDA runs).",
         cpu_allocator::installed() ? static_cast<double>(cpu_allocator::refused_allocations()) : 0.0);
  family(o, "trainer_nonfinite_steps_total", "counter", "Steps skipped for a non-finite loss or gradient norm.",
         static_cast<double>(s.nonfinite_steps));
  family(o, "trainer_checkpoints_total", "counter", "Checkpoints saved by this process.", static_cast<double>(s.checkpoints));
  family(o, "trainer_evals_total", "counter", "Evaluations done by this process.", static_cast<double>(s.evals));
  if (s.evals > 0) {
    family(o, "trainer_eval_loss", "gauge", "Loss of the last evaluation.", s.eval_loss);
    family(o, "trainer_eval_top1", "gauge", "Top-1 accuracy of the last evaluation (fraction).", s.eval_top1);
  }
}

// The labels NVIDIA's DCGM exporter puts on a GPU's series, so that `on(UUID, GPU_I_ID)` joins them: the
// physical GPU's UUID, and on a MIG slice its GPU instance id (the exporter has no GPU_I_ID on a whole GPU,
// nor does this). "" when the UUID is not known.
std::string dcgm_labels(const GpuIdentity& g) {
  if (g.uuid.empty()) return "";
  std::string l = "UUID=\"" + escape_label(g.uuid) + "\"";
  if (g.gpu_instance_id >= 0) l += ",GPU_I_ID=\"" + std::to_string(g.gpu_instance_id) + "\"";
  return l;
}

void gpu_families(std::string& o, const TelemetrySnapshot& s) {
  const std::string ids = dcgm_labels(s.gpu);
  if (!ids.empty()) {
    std::string info = "device=\"" + escape_label(s.memory.device.empty() ? "unknown" : s.memory.device) + "\"," + ids;
    if (!s.gpu.mig_uuid.empty()) info += ",mig_uuid=\"" + escape_label(s.gpu.mig_uuid) + "\"";
    family(o, "trainer_gpu_info", "gauge",
           "Constant 1; the GPU (and MIG slice) the run trains on, labelled as NVIDIA's DCGM exporter labels it.", 1,
           info);
  }
  if (s.gpu_utilization >= 0)
    family(o, "trainer_gpu_utilization_percent", "gauge", "GPU busy time of the last NVML sample period.",
           s.gpu_utilization, ids);
}

// Host and container figures are files, read outside the telemetry's lock: the loop never waits for them.
void memory_families(std::string& o, const TelemetrySnapshot& s, const std::string& root) {
  CgroupMemory cg;
  try {
    cg = read_cgroup_memory(root);
  } catch (const std::exception&) {
    // A malformed cgroup file is reported by the loop's own limit handling; here it reads as "none".
  }
  const double cpu_s = process_cpu_seconds(root);
  const std::string ids = dcgm_labels(s.gpu);
  const std::string dev = "device=\"" + escape_label(s.memory.device.empty() ? "unknown" : s.memory.device) + "\"" +
                          (ids.empty() ? "" : "," + ids);
  family(o, "trainer_device_memory_allocated_bytes", "gauge", "Tensor bytes allocated on the training device.",
         static_cast<double>(s.memory.allocated), dev);
  family(o, "trainer_device_memory_reserved_bytes", "gauge",
         "Bytes the device allocator holds from the system (CUDA cache; = allocated on CPU).",
         static_cast<double>(s.memory.reserved), dev);
  family(o, "trainer_device_memory_peak_bytes", "gauge", "Peak tensor bytes of the last step.",
         static_cast<double>(s.memory.peak), dev);
  family(o, "trainer_device_memory_limit_bytes", "gauge", "The trainer's memory cap in force (0 = none).",
         static_cast<double>(s.memory.limit), dev);
  family(o, "trainer_host_rss_bytes", "gauge", "Resident set size of the trainer process.", static_cast<double>(host_rss_bytes(root)));
  family(o, "trainer_container_memory_limit_bytes", "gauge", "The cgroup's memory limit (0 = none).",
         static_cast<double>(cg.limit_bytes));
  family(o, "trainer_container_memory_usage_bytes", "gauge", "The cgroup's memory usage, page cache included.",
         static_cast<double>(cg.usage_bytes));
  family(o, "trainer_process_cpu_seconds_total", "counter", "User and system CPU time of the trainer process.",
         cpu_s < 0 ? 0.0 : cpu_s);
  gpu_families(o, s);
}

void health_families(std::string& o, const TelemetrySnapshot& s, double timeout) {
  family(o, "trainer_seconds_since_checkpoint", "gauge",
         "Seconds since the last checkpoint (since the process started before the first).", s.seconds_since_checkpoint);
  if (s.last_checkpoint_unix_s > 0)
    family(o, "trainer_last_checkpoint_timestamp_seconds", "gauge",
           "Unix time of the run's newest checkpoint: saved by this process, or the one it resumed from.",
           s.last_checkpoint_unix_s);
  family(o, "trainer_heartbeat_age_seconds", "gauge", "Seconds since the loop's last heartbeat.", s.heartbeat_age_s);
  family(o, "trainer_heartbeat_timeout_seconds", "gauge", "/healthz fails when the heartbeat is older than this.",
         timeout);
  family(o, "trainer_uptime_seconds", "gauge", "Seconds since the telemetry (the run) started.", s.uptime_s);
}

}  // namespace

std::string Telemetry::prometheus_text(const std::string& root) const {
  const TelemetrySnapshot s = snapshot();
  std::string o;
  o.reserve(6000);
  progress_families(o, s);
  event_families(o, s);
  memory_families(o, s, root);
  health_families(o, s, heartbeat_timeout_s());
  return o;
}

// ---- resources ----------------------------------------------------------------------------------------

double process_cpu_seconds(const std::string& root) {
  std::ifstream in(root + "/proc/self/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // The command name (field 2) is in parentheses and may hold spaces and parentheses: the fields after
  // it start after the last ')'. utime and stime are fields 14 and 15, i.e. the 12th and 13th after it.
  auto close = text.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream rest(text.substr(close + 1));
  std::string field;
  double utime = 0, stime = 0;
  for (int i = 1; i <= 13; ++i) {
    if (!(rest >> field)) return -1;
    if (i == 12) utime = std::atof(field.c_str());
    if (i == 13) stime = std::atof(field.c_str());
  }
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

ResourceMonitor::ResourceMonitor(int gpu_index, std::string root)
    : gpu_index_(gpu_index), gpu_(gpu_index >= 0 ? Nvml::instance().identity(gpu_index) : GpuIdentity{}),
      root_(std::move(root)), last_cpu_s_(process_cpu_seconds(root_)),
      last_wall_(std::chrono::steady_clock::now()) {}

ResourceSample ResourceMonitor::sample(const MemoryBackend* backend) {
  ResourceSample s;
  const auto now = std::chrono::steady_clock::now();
  const double cpu = process_cpu_seconds(root_);
  const double wall = std::chrono::duration<double>(now - last_wall_).count();
  if (cpu >= 0 && last_cpu_s_ >= 0 && wall > 0) s.cpu_percent = 100.0 * (cpu - last_cpu_s_) / wall;
  last_cpu_s_ = cpu;
  last_wall_ = now;
  try {
    s.usable_cpus = usable_cpus(root_);
  } catch (const std::exception&) {
    s.usable_cpus = 0;  // a malformed cgroup file: the loop's own thread handling reports it
  }
  s.rss_bytes = host_rss_bytes(root_);
  if (backend) s.device = device_memory_of(*backend);
  if (gpu_index_ < 0) {
    s.gpu_note = "cpu run";
  } else if (!Nvml::instance().available()) {
    s.gpu_note = Nvml::instance().error();
  } else {
    // NVML's index of the GPU the identity found (CUDA_VISIBLE_DEVICES=3: NVML's GPU 3), else CUDA's index.
    const int index = gpu_.nvml_index >= 0 ? gpu_.nvml_index : gpu_index_;
    s.gpu_percent = Nvml::instance().utilization(static_cast<unsigned>(index));
    if (s.gpu_percent < 0) s.gpu_note = "NVML gave no utilisation for GPU " + std::to_string(index);
  }
  return s;
}

std::string ResourceMonitor::format(const ResourceSample& s) {
  std::string line = fmt::format("resources: cpu {:.0f}% of {} CPU{} | rss {}", s.cpu_percent,
                                 s.usable_cpus > 0 ? std::to_string(s.usable_cpus) : "?",
                                 s.usable_cpus == 1 ? "" : "s", format_bytes(s.rss_bytes));
  if (!s.device.device.empty()) {
    line += fmt::format(" | {} mem {} (peak {}, reserved {}, limit {})", s.device.device, format_bytes(s.device.allocated),
                        format_bytes(s.device.peak), format_bytes(s.device.reserved),
                        s.device.limit ? format_bytes(s.device.limit) : "none");
  }
  if (s.gpu_percent >= 0) line += fmt::format(" | gpu {:.0f}%", s.gpu_percent);
  else line += " | gpu n/a (" + s.gpu_note + ")";
  return line;
}

}  // namespace trainer
