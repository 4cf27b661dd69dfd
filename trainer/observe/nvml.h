// NVIDIA's management library (NVML), loaded with dlopen("libnvidia-ml.so.1") at run time: never a
// link-time dependency, so the trainer builds and runs where no NVIDIA driver is installed.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

namespace trainer {

/// GPU utilisation through NVML, loaded with dlopen("libnvidia-ml.so.1") on first use: never a link-time
/// dependency. Thread-safe.
class Nvml {
 public:
  /// The process-wide instance (NVML is initialized once, never shut down before exit).
  static Nvml& instance();
  /// True if the library loaded and nvmlInit succeeded.
  bool available() const { return ok_; }
  /// Why it is not available ("libnvidia-ml.so.1 not found", ...); "" if it is.
  const std::string& error() const { return error_; }
  /// Percent of the last sample period the GPU `index` (NVML's numbering) was busy; -1 if unknown.
  double utilization(unsigned index) const;
  /// Bytes of device memory in use on GPU `index` (all processes); -1 if unknown.
  int64_t memory_used(unsigned index) const;

 private:
  Nvml();
  bool ok_ = false;
  std::string error_;
  void* lib_ = nullptr;
  void* get_handle_ = nullptr;
  void* get_util_ = nullptr;
  void* get_mem_ = nullptr;
  mutable std::mutex mu_;
};

}  // namespace trainer
