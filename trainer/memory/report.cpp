#include "trainer/memory/report.h"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <type_traits>

#include "common/clock.h"
#include "common/log.h"
#include "trainer/memory/backend.h"

#ifdef TRAINER_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace fs = std::filesystem;

namespace trainer {
namespace {

#ifdef TRAINER_WITH_CUDA
namespace cca = c10::cuda::CUDACachingAllocator;

// snapshot() returns the segment list itself in 1.13 and a SnapshotInfo holding it as `.segments` in
// 2.x. Telling them apart by type, not by version number, keeps this out of compat.h's version checks.
template <typename T, typename = void>
struct HasSegments : std::false_type {};
template <typename T>
struct HasSegments<T, std::void_t<decltype(std::declval<const T&>().segments)>> : std::true_type {};

template <typename Snapshot>
const auto& segments_of(const Snapshot& s) {
  if constexpr (HasSegments<Snapshot>::value) return s.segments;
  else return s;
}

void fill_cuda_stats(MemoryStats& m, c10::DeviceIndex index) {
  // StatArrays are indexed by StatType; AGGREGATE (all pools) is index 0 in every release (as memory.cpp).
  constexpr size_t kAggregate = 0;
  const auto stats = cca::getDeviceStats(index);
  m.active = stats.active_bytes[kAggregate].current;
  m.allocator_ooms = stats.num_ooms;
  m.alloc_retries = stats.num_alloc_retries;
  const auto snap = cca::snapshot();
  int64_t largest = 0, segments = 0;
  for (const auto& seg : segments_of(snap)) {
    if (seg.device != index) continue;
    ++segments;
    for (const auto& b : seg.blocks)
      if (!b.allocated && !b.active) largest = std::max<int64_t>(largest, b.size);
  }
  m.largest_free_block = largest;
  m.segments = segments;
  m.note = "largest free block: inside the caching allocator's reserved segments; a larger tensor needs new "
           "memory from the driver (free_bytes)";
}
#endif

// c10::Error's what() carries a C++ backtrace after the message; the report keeps the message.
std::string without_backtrace(const std::string& error) {
  const auto cut = error.find("\nException raised from");
  return cut == std::string::npos ? error : error.substr(0, cut);
}

nlohmann::json bytes_or_null(int64_t v) { return v < 0 ? nlohmann::json(nullptr) : nlohmann::json(v); }

std::string show_bytes(const nlohmann::json& v) {
  if (!v.is_number()) return "n/a";
  return fmt::format("{} ({} B)", format_bytes(v.get<int64_t>()), v.get<int64_t>());
}

std::string show_count(const nlohmann::json& v) { return v.is_number() ? std::to_string(v.get<int64_t>()) : "n/a"; }

}  // namespace

MemoryStats collect_memory_stats(const MemoryBackend& backend) {
  MemoryStats m;
  static_cast<DeviceMemory&>(m) = device_memory_of(backend);
  m.active = m.allocated;
  m.total = backend.total_bytes();
  m.free = backend.free_bytes();
  m.fragmentation = std::max<int64_t>(0, m.reserved - m.allocated);
  const c10::Device d = backend.device();
  if (d.is_cpu()) {
    m.allocation_refusals = cpu_allocator::installed() ? cpu_allocator::refused_allocations() : 0;
    m.note = "cpu: fragmentation and largest free block are not applicable: the capped CPU allocator caches "
             "nothing (every free returns memory to malloc), so reserved = allocated";
  }
#ifdef TRAINER_WITH_CUDA
  if (d.is_cuda()) fill_cuda_stats(m, d.index());
#endif
  return m;
}

MemoryReporter::MemoryReporter(std::string run_dir, MemoryReportSink* sink, int keep_steps)
    : run_dir_(std::move(run_dir)), sink_(sink), keep_steps_(static_cast<size_t>(keep_steps)) {
  if (keep_steps < 1)
    throw std::invalid_argument("memory report: keep_steps must be >= 1, got " + std::to_string(keep_steps));
}

void MemoryReporter::add_attempt(int64_t step, int64_t micro_batch) {
  Attempt a;
  a.step = step;
  a.micro_batch = micro_batch;
  attempts_.push_back(a);
  // Keep the attempts of the last keep_steps_ steps (a step with OOM retries has several).
  size_t steps = 0;
  for (size_t i = 0; i < attempts_.size(); ++i)
    if (i == 0 || attempts_[i].step != attempts_[i - 1].step) ++steps;
  while (steps > keep_steps_) {
    const int64_t oldest = attempts_.front().step;
    while (!attempts_.empty() && attempts_.front().step == oldest) attempts_.pop_front();
    --steps;
  }
}

void MemoryReporter::begin_attempt(int64_t step, int64_t micro_batch) {
  std::lock_guard<std::mutex> lock(mu_);
  add_attempt(step, micro_batch);
}

void MemoryReporter::record_phase_peak(int64_t step, const std::string& phase, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (attempts_.empty() || attempts_.back().step != step) add_attempt(step, 0);
  auto& slot = attempts_.back().peaks[phase];
  slot = std::max(slot, bytes);
}

void MemoryReporter::mark_failed(const std::string& phase) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!attempts_.empty()) attempts_.back().failed_in = phase;
}

void MemoryReporter::count_oom() {
  std::lock_guard<std::mutex> lock(mu_);
  ++ooms_;
}

int64_t MemoryReporter::ooms() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ooms_;
}

nlohmann::json MemoryReporter::build(int64_t step, const MemoryBackend& backend, const std::string& reason,
                                     const std::string& error) const {
  const MemoryStats m = collect_memory_stats(backend);
  nlohmann::json j;
  j["step"] = step;
  j["reason"] = reason;
  j["time"] = utc_now_iso();
  j["time_unix_s"] = unix_now();
  j["device"] = m.device;
  j["allocated_bytes"] = m.allocated;
  j["reserved_bytes"] = m.reserved;
  j["active_bytes"] = m.active;
  j["peak_bytes"] = m.peak;
  j["limit_bytes"] = m.limit;
  j["total_bytes"] = m.total;
  j["free_bytes"] = m.free;
  j["fragmentation_bytes"] = m.fragmentation;
  j["largest_free_block_bytes"] = bytes_or_null(m.largest_free_block);
  j["segments"] = bytes_or_null(m.segments);
  j["allocator_ooms"] = bytes_or_null(m.allocator_ooms);
  j["alloc_retries"] = bytes_or_null(m.alloc_retries);
  j["allocation_refusals"] = bytes_or_null(m.allocation_refusals);
  j["note"] = m.note;
  nlohmann::json peaks = nlohmann::json::array();
  {
    std::lock_guard<std::mutex> lock(mu_);
    j["ooms"] = ooms_;
    for (const auto& a : attempts_) {
      nlohmann::json p = {{"step", a.step}};
      if (a.micro_batch > 0) p["micro_batch"] = a.micro_batch;
      for (const auto& [name, bytes] : a.peaks) p[name] = bytes;
      if (!a.failed_in.empty()) p["failed_in"] = a.failed_in;
      peaks.push_back(p);
    }
  }
  j["phase_peaks"] = peaks;
  j["error"] = without_backtrace(error);
  return j;
}

MemoryReport MemoryReporter::write(int64_t step, const MemoryBackend& backend, const std::string& reason,
                                   const std::string& error) {
  if (reason == "oom") count_oom();
  MemoryReport r;
  r.json = build(step, backend, reason, error);
  r.text = format(r.json);
  fs::path path = fs::path(run_dir_) / fmt::format("memory_report_{}.json", step);
  for (int n = 2; fs::exists(path); ++n) path = fs::path(run_dir_) / fmt::format("memory_report_{}_{}.json", step, n);
  if (sink_) sink_->set_memory_report(json_text(r.json, 2));
  // A reader (a person, a log shipper) never sees half a file: write aside, then rename over.
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << json_text(r.json, 2) << "\n";
    if (!out.flush()) {
      r.write_error = "memory report: cannot write " + tmp.string() + " (disk full or run folder not writable)";
      return r;
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    r.write_error = "memory report: cannot rename " + tmp.string() + " to " + path.string() + ": " + ec.message();
    fs::remove(tmp, ec);
    return r;
  }
  r.path = path.string();
  return r;
}

std::string MemoryReporter::format(const nlohmann::json& j) {
  const std::string rule(72, '=');
  std::string o;
  o += rule + "\n";
  o += fmt::format("memory report: step {}, {} on {} at {}\n", j.value("step", int64_t{0}), j.value("reason", std::string()),
                   j.value("device", std::string()), j.value("time", std::string()));
  o += std::string(72, '-') + "\n";
  auto line = [&](const char* name, const std::string& value) { o += fmt::format("  {:<28}{}\n", name, value); };
  line("allocated", show_bytes(j["allocated_bytes"]));
  line("reserved", show_bytes(j["reserved_bytes"]));
  line("active", show_bytes(j["active_bytes"]));
  line("peak (this step)", show_bytes(j["peak_bytes"]));
  const auto& limit = j["limit_bytes"];
  line("limit", limit.is_number() && limit.get<int64_t>() == 0 ? "none" : show_bytes(limit));
  line("total", show_bytes(j["total_bytes"]));
  line("free (system)", show_bytes(j["free_bytes"]));
  line("fragmentation", j["largest_free_block_bytes"].is_null() ? "n/a" : show_bytes(j["fragmentation_bytes"]));
  line("largest free block", show_bytes(j["largest_free_block_bytes"]));
  line("segments", show_count(j["segments"]));
  line("OOMs (this run)", show_count(j["ooms"]));
  line("allocator OOMs", show_count(j["allocator_ooms"]));
  line("alloc retries", show_count(j["alloc_retries"]));
  line("allocation refusals", show_count(j["allocation_refusals"]));
  if (!j.value("note", std::string()).empty()) o += "  note: " + j["note"].get<std::string>() + "\n";
  const auto& peaks = j["phase_peaks"];
  if (peaks.is_array() && !peaks.empty()) {
    // One column per phase seen, in a stable order: the usual three first, then any others.
    std::vector<std::string> cols = {"forward", "backward", "optimizer"};
    for (const auto& p : peaks)
      for (const auto& [k, v] : p.items())
        if (k != "step" && k != "micro_batch" && k != "failed_in" &&
            std::find(cols.begin(), cols.end(), k) == cols.end())
          cols.push_back(k);
    o += "  phase peaks (recent steps):\n";
    o += fmt::format("    {:>8}  {:>11}", "step", "micro-batch");
    for (const auto& c : cols) o += fmt::format("  {:>14}", c);
    o += "\n";
    for (const auto& p : peaks) {
      o += fmt::format("    {:>8}  {:>11}", p.value("step", int64_t{0}),
                       p.contains("micro_batch") ? std::to_string(p["micro_batch"].get<int64_t>()) : "-");
      for (const auto& c : cols) o += fmt::format("  {:>14}", p.contains(c) ? format_bytes(p[c].get<int64_t>()) : "-");
      if (p.contains("failed_in")) o += "  failed in " + p["failed_in"].get<std::string>();
      o += "\n";
    }
  } else {
    o += "  phase peaks: none recorded (the loop did not report per-phase peaks)\n";
  }
  if (!j.value("error", std::string()).empty()) o += "  error: " + j["error"].get<std::string>() + "\n";
  o += rule;
  return o;
}

// ---- per-phase peaks -----------------------------------------------------------------------------------

PhasePeakBackend::PhasePeakBackend(std::unique_ptr<MemoryBackend> inner) : inner_(std::move(inner)) {
  if (!inner_) throw std::invalid_argument("PhasePeakBackend: no backend to wrap");
  carried_ = inner_->peak_bytes();
}

void PhasePeakBackend::start_phase() {
  carried_ = std::max(carried_.load(), inner_->peak_bytes());
  inner_->reset_peak();
}

int64_t PhasePeakBackend::peak_bytes() const { return std::max(carried_.load(), inner_->peak_bytes()); }

void PhasePeakBackend::reset_peak() {
  inner_->reset_peak();
  carried_ = 0;
}

PhasePeakRecorder::PhasePeakRecorder(MemoryBackend& backend, MemoryReporter& reporter, int64_t step,
                                     int64_t micro_batch)
    : backend_(dynamic_cast<PhasePeakBackend*>(&backend)),
      reporter_(reporter),
      step_(step),
      uncaught_(std::uncaught_exceptions()) {
  if (backend_) reporter_.begin_attempt(step_, micro_batch);
}

PhasePeakRecorder::~PhasePeakRecorder() {
  // A destructor that throws while an OOM unwinds would terminate the process; the peaks are not worth it.
  try {
    const std::string phase = phase_;
    end_phase();
    // Destroyed by an exception unwinding the attempt: the phase in progress is where it failed.
    if (backend_ && !phase.empty() && std::uncaught_exceptions() > uncaught_) reporter_.mark_failed(phase);
  } catch (...) {
  }
}

void PhasePeakRecorder::enter(const std::string& phase) {
  end_phase();
  if (!backend_) return;
  backend_->start_phase();
  phase_ = phase;
}

void PhasePeakRecorder::end_phase() {
  if (!backend_ || phase_.empty()) return;
  reporter_.record_phase_peak(step_, phase_, backend_->phase_peak_bytes());
  phase_.clear();
}

}  // namespace trainer
