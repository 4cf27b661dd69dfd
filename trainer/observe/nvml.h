// NVIDIA's management library (NVML), loaded with dlopen("libnvidia-ml.so.1") at run time: never a
// link-time dependency, so the trainer builds and runs where no NVIDIA driver is installed.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace trainer {

/// Which GPU (and which MIG slice of it) the run's CUDA device is, in the terms NVIDIA's DCGM exporter
/// labels its series with, so that Prometheus can join the trainer's series with the card's own
/// (docs/OPERATIONS.md, "Beside NVIDIA's DCGM exporter").
struct GpuIdentity {
  std::string uuid;          ///< the physical GPU's UUID ("GPU-5fa8..."), the exporter's `UUID`; on a MIG slice
                             ///< the parent GPU's. "" = not known (no NVML, or NVML could not say)
  int gpu_instance_id = -1;  ///< on a MIG slice: NVML's GPU instance id, the exporter's `GPU_I_ID`; -1 = a whole GPU
                             ///< or not known
  std::string mig_uuid;      ///< on a MIG slice: its own UUID ("MIG-..."), as CUDA_VISIBLE_DEVICES names it
  int nvml_index = -1;       ///< the physical GPU's NVML index (for utilisation); -1 = not known
  std::string note;          ///< why something is not known; "" when everything is
};

/// The entry of the visible-devices list that names CUDA device `cuda_index`: the `cuda_index`-th entry of
/// CUDA_VISIBLE_DEVICES (`cuda_visible`, nullptr = unset), in CUDA's order; where that is unset, the one
/// entry of NVIDIA_VISIBLE_DEVICES (`nvidia_visible`: set by the NVIDIA container runtime and Kubernetes'
/// device plugin to the one GPU or MIG slice a container gets) for device 0. "" where neither says (then
/// CUDA's index is NVML's). Entries are trimmed; "all", "none", "void" and paths say nothing.
std::string visible_device_entry(int cuda_index, const char* cuda_visible, const char* nvidia_visible);

/// GPU utilisation and identity through NVML, loaded with dlopen("libnvidia-ml.so.1") on first use: never a
/// link-time dependency. Every function beyond nvmlInit_v2, nvmlDeviceGetHandleByIndex_v2 and
/// nvmlDeviceGetUtilizationRates is optional: one the library lacks (an old driver) leaves what it answers
/// unknown. Thread-safe.
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
  /// The identity of CUDA device `cuda_index` (>= 0), read from the environment's visible-devices lists
  /// (visible_device_entry) and NVML: a "GPU-..." entry is looked up by UUID, a "MIG-..." one as a MIG
  /// device (its parent's UUID and its GPU instance id), the older "MIG-GPU-<uuid>/<gi>/<ci>" form is
  /// read as it is written, a number or nothing as NVML's index. A whole GPU in MIG mode stands for the
  /// MIG slice this process can see when it sees exactly one (a container given one slice). Never throws;
  /// what is not known is empty / -1 with a `note`.
  GpuIdentity identity(int cuda_index) const;

 private:
  Nvml();
  bool ok_ = false;
  std::string error_;
  void* lib_ = nullptr;
  void* get_handle_ = nullptr;
  void* get_util_ = nullptr;
  void* get_mem_ = nullptr;
  // Optional (identity): nullptr where the library lacks them.
  void* get_uuid_ = nullptr;
  void* by_uuid_ = nullptr;
  void* get_index_ = nullptr;
  void* mig_mode_ = nullptr;
  void* mig_parent_ = nullptr;
  void* gpu_instance_id_ = nullptr;
  void* max_mig_ = nullptr;
  void* mig_by_index_ = nullptr;
  std::string uuid_of(void* device) const;
  void identify_mig(void* mig, GpuIdentity& id) const;
  void identify_gpu(void* gpu, GpuIdentity& id) const;
  mutable std::mutex mu_;
};

}  // namespace trainer
