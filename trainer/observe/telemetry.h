// Live state of a training run for operators: a thread-safe snapshot of its gauges and counters that the
// loop writes after each step and the HTTP endpoint (trainer/http.h) reads, rendered in the Prometheus
// text format; the liveness and readiness rules behind /healthz and /readyz; and the periodic resource
// line (process CPU, RSS, device memory, GPU utilisation through NVML where the driver has it: nvml.h).
//
// The loop never waits on a reader: every write takes one mutex for the time of a few assignments
// (no I/O, no allocation beyond a string copy), and readers copy the snapshot out before formatting.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "trainer/memory/report.h"
#include "trainer/observe/nvml.h"

namespace trainer {

class MemoryBackend;

/// What the loop reports after each optimizer step (the fields of a metrics.jsonl step line).
struct StepTelemetry {
  int64_t step = 0;          ///< optimizer steps completed
  int64_t total_steps = 0;   ///< steps the run will do (0 = unknown)
  double epoch = 0;          ///< fractional epochs completed
  int64_t samples_seen = 0;  ///< training samples consumed since the start of the run
  double loss = 0;           ///< mean loss of the step's global batch
  double lr = 0;             ///< learning rate used by the step
  double samples_per_s = 0;  ///< global batch / (step time + data wait)
  double step_time_s = 0;    ///< forward + backward + update, seconds
  double data_wait_s = 0;    ///< time the step waited for its batch, seconds
  int64_t micro_batch = 0;   ///< samples per forward/backward
  int64_t accum_steps = 0;   ///< micro-batches per optimizer step
};

/// Device memory as the loop's MemoryBackend reports it (trainer/memory/backend.h: device_memory_of).
using DeviceMemoryTelemetry = DeviceMemory;

/// A copy of everything Telemetry holds, with the ages computed at the time of the copy.
struct TelemetrySnapshot {
  StepTelemetry step;
  DeviceMemoryTelemetry memory;
  int64_t ooms = 0;            ///< step attempts that ran out of memory
  int64_t backoffs = 0;        ///< OOM answers: micro-batch halved or checkpointing turned on
  int64_t probes = 0;          ///< grow-back probes started
  int64_t probes_failed = 0;   ///< grow-back probes that ran out of memory
  int64_t limit_changes = 0;   ///< memory limit changes seen by the controller
  int64_t checkpoints = 0;     ///< checkpoints saved
  int64_t evals = 0;           ///< evaluations done
  int64_t nonfinite_steps = 0; ///< steps skipped for a non-finite loss or gradient
  double eval_loss = 0, eval_top1 = 0;  ///< last evaluation (valid when evals > 0)
  bool ready = false;          ///< setup done (set_ready(true)) ...
  bool stopping = false;       ///< ... and not stopping
  std::string phase;           ///< "setup", "train", "eval", "checkpoint", "stopping", "done"
  std::map<std::string, std::string> info;  ///< labels of trainer_info (device, model, version, ...)
  double uptime_s = 0;                   ///< since the Telemetry was created
  double heartbeat_age_s = 0;            ///< since the last heartbeat (each step, long phases)
  double seconds_since_checkpoint = 0;   ///< since the last checkpoint, or since creation before the first
  /// Unix time (seconds) of the run's newest checkpoint: the last one this process saved, or, before
  /// that, the one it resumed from (its manifest's created_unix); 0 = the run has none yet. Unlike
  /// seconds_since_checkpoint it survives a restart, so a job that keeps restarting before its next
  /// checkpoint shows its true age.
  double last_checkpoint_unix_s = 0;
  double gpu_utilization = -1;           ///< percent, from the resource monitor; -1 = not known
  GpuIdentity gpu;                       ///< the CUDA device's GPU and MIG slice; empty uuid = not known
};

/// The run's live state. Thread-safe: the loop writes, the HTTP threads read.
class Telemetry : public MemoryReportSink {
 public:
  using Clock = std::chrono::steady_clock;

  /// `heartbeat_timeout_s` > 0: /healthz fails once the last heartbeat is older than this. Throws
  /// std::invalid_argument otherwise.
  explicit Telemetry(double heartbeat_timeout_s = 300.0);

  // ---- writes (the loop) -------------------------------------------------------------------------
  /// A completed optimizer step; also a heartbeat and phase "train".
  void on_step(const StepTelemetry& s);
  /// Device memory after a step.
  void set_memory(const DeviceMemoryTelemetry& m);
  /// Steps the run will do (a resumed run writes no "start" event that observe() could read it from).
  void set_total_steps(int64_t total_steps);
  /// Feeds one metrics.jsonl record: a step line ({"step", "loss", ...} without "event") updates the step
  /// gauges (and mem_peak_bytes / mem_limit_bytes); an event updates the counters: "oom" (+ its "kind":
  /// backoff / checkpointing_on count as a backoff, probe_failed as a failed probe), "probe", "backoff",
  /// "checkpointing_on", "probe_failed", "limit_changed", "checkpoint", "eval" (loss, top1), "nonfinite",
  /// "resume" (step; checkpoint_created_unix, the resumed checkpoint's time), "stop" (stopping). Anything
  /// else is ignored. A heartbeat in every case. Never throws on a record with missing or mistyped
  /// fields (they are skipped).
  void observe(const nlohmann::json& record);
  void add_oom(int64_t n = 1);
  void add_backoff(int64_t n = 1);
  void add_probe(int64_t n = 1);
  void add_probe_failed(int64_t n = 1);
  /// A checkpoint was saved now (also sets last_checkpoint_unix_s to the wall-clock time).
  void on_checkpoint();
  /// An evaluation finished (top1 is a fraction in [0, 1]).
  void on_eval(double loss, double top1);
  /// The loop is alive. Call after each step and inside long phases (each evaluation batch).
  void heartbeat();
  /// What the loop does now ("setup", "train", "eval", "checkpoint", ...); also a heartbeat.
  void set_phase(const std::string& phase);
  /// true once setup finished and the loop is about to train.
  void set_ready(bool ready);
  /// The run is stopping (signal, end of training): /readyz fails from now on.
  void set_stopping();
  /// A constant label of trainer_info (e.g. "device" = "cuda:0", "model" = "resnet50").
  void set_info(const std::string& key, const std::string& value);
  /// GPU utilisation in percent (-1 = not known), from ResourceMonitor.
  void set_gpu_utilization(double percent);
  /// The GPU the run trains on (ResourceMonitor::gpu()). With a UUID, the device memory and utilisation
  /// series carry the labels `UUID` (and `GPU_I_ID` on a MIG slice) of NVIDIA's DCGM exporter, and
  /// trainer_gpu_info describes the device.
  void set_gpu(const GpuIdentity& gpu);

  // ---- memory report requests (GET /memory) -------------------------------------------------------
  /// Asks the loop for a memory report (the HTTP thread calls this). Requests coalesce: however many
  /// arrive, at most one is pending.
  void request_memory_report();
  /// True if a report is pending and the last one was taken at least memory_report_interval_s ago
  /// (the loop polls it after each step, with SIGUSR2's flag); the request is then taken. A request
  /// inside the interval stays pending until it ends, so a flood of GET /memory costs the loop one
  /// report per interval, never one per step.
  bool take_memory_report_request();
  /// The least time between two reports asked through request_memory_report() (>= 0; 10 s by default).
  void set_memory_report_interval_s(double seconds);
  /// The latest report (JSON text) the loop wrote, for GET /memory; "" before the first.
  void set_memory_report(const std::string& json_text) override;
  std::string memory_report() const;

  // ---- reads (any thread) -------------------------------------------------------------------------
  TelemetrySnapshot snapshot() const;
  double heartbeat_timeout_s() const;
  void set_heartbeat_timeout_s(double seconds);
  /// Liveness: the last heartbeat is younger than the timeout. `why` (optional) gets a one-line reason.
  bool live(std::string* why = nullptr) const;
  /// Readiness: set_ready(true) was called and set_stopping() was not.
  bool ready(std::string* why = nullptr) const;

  /// The Prometheus text exposition (format 0.0.4) of the snapshot plus what is read at scrape time:
  /// host RSS, the cgroup's memory limit and usage, process CPU seconds, the CPU allocator's refusals
  /// (files under `root`, as trainer/resources.h). Every metric has HELP and TYPE lines and a finite
  /// value; names start with trainer_ (docs/OPERATIONS.md lists them).
  std::string prometheus_text(const std::string& root = "/") const;

 private:
  mutable std::mutex mu_;
  double heartbeat_timeout_s_;
  Clock::time_point created_, heartbeat_, last_checkpoint_;
  bool checkpointed_ = false;
  StepTelemetry step_;
  DeviceMemoryTelemetry memory_;
  void add(int64_t TelemetrySnapshot::*counter, int64_t n);

  TelemetrySnapshot counters_;  // counters and flags; ages and step/memory filled in by snapshot()
  bool report_requested_ = false;
  double report_interval_s_ = 10.0;
  std::optional<Clock::time_point> last_report_taken_;
  std::string memory_report_;
};

// ---- the resource line ----------------------------------------------------------------------------

/// This process's CPU time (user + system) in seconds, from /proc/self/stat under `root`; -1 if unreadable.
double process_cpu_seconds(const std::string& root = "/");

/// One sample of the resource line.
struct ResourceSample {
  double cpu_percent = 0;      ///< process CPU time / wall time since the previous sample, in percent of one CPU
  int usable_cpus = 1;         ///< CPUs this process may use (affinity, cgroup quota); 0 = unreadable
  int64_t rss_bytes = 0;       ///< resident set size
  DeviceMemoryTelemetry device;  ///< empty device name when no backend was given
  double gpu_percent = -1;     ///< NVML utilisation; -1 = n/a
  std::string gpu_note;        ///< why n/a ("no NVML: ...", "cpu run")
};

/// Produces the resource line every N steps: "resources: cpu 187% of 2 CPUs | rss 1.20 GiB | cpu mem
/// 300.00 MiB (peak 1.10 GiB, limit 2.00 GiB) | gpu n/a (cpu run)".
class ResourceMonitor {
 public:
  /// `gpu_index` >= 0: the CUDA device index of the run's GPU, whose identity is asked of NVML once here
  /// (Nvml::identity: the visible-devices lists map it to NVML's GPU); -1: no GPU. `root` as
  /// trainer/resources.h.
  explicit ResourceMonitor(int gpu_index = -1, std::string root = "/");
  /// The GPU's identity (empty for a CPU run or without NVML; its `note` says why).
  const GpuIdentity& gpu() const { return gpu_; }
  /// CPU use since the previous sample (or construction), RSS now, device memory of `backend` (may be
  /// null), GPU utilisation.
  ResourceSample sample(const MemoryBackend* backend = nullptr);
  /// The sample as one log line (see the class comment).
  static std::string format(const ResourceSample& s);

 private:
  int gpu_index_;
  GpuIdentity gpu_;
  std::string root_;
  double last_cpu_s_;
  std::chrono::steady_clock::time_point last_wall_;
};

}  // namespace trainer
