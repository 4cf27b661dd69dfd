#include "trainer/observe/nvml.h"

#include <dlfcn.h>

#include <cstdlib>
#include <sstream>

namespace trainer {

// NVML's C API, declared here so no NVIDIA header or library is needed at build time. Types as in nvml.h:
// an opaque device handle, return 0 = NVML_SUCCESS.
namespace {
struct NvmlUtilization {
  unsigned int gpu;     // percent of time a kernel ran during the sample period
  unsigned int memory;  // percent of time device memory was read or written
};
struct NvmlMemory {
  unsigned long long total, free, used;
};
using NvmlInitFn = int (*)();
using NvmlGetHandleFn = int (*)(unsigned int, void**);
using NvmlGetUtilFn = int (*)(void*, NvmlUtilization*);
using NvmlGetMemFn = int (*)(void*, NvmlMemory*);
using NvmlGetStringFn = int (*)(void*, char*, unsigned int);     // nvmlDeviceGetUUID
using NvmlByUuidFn = int (*)(const char*, void**);              // nvmlDeviceGetHandleByUUID
using NvmlGetUintFn = int (*)(void*, unsigned int*);            // GetIndex, GetGpuInstanceId, GetMaxMigDeviceCount
using NvmlMigModeFn = int (*)(void*, unsigned int*, unsigned int*);  // current, pending
using NvmlParentFn = int (*)(void*, void**);                    // nvmlDeviceGetDeviceHandleFromMigDeviceHandle
using NvmlMigByIndexFn = int (*)(void*, unsigned int, void**);  // nvmlDeviceGetMigDeviceHandleByIndex
constexpr unsigned kUuidBufferSize = 96;                        // NVML_DEVICE_UUID_V2_BUFFER_SIZE

std::string trim_entry(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\n\r");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\n\r") - b + 1);
}

std::vector<std::string> split_devices(const char* list) {
  std::vector<std::string> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(trim_entry(item));
  return out;
}

bool names_no_device(const std::string& e) {
  return e.empty() || e == "all" || e == "none" || e == "void" || e.find('/') == 0;
}

bool is_index(const std::string& s) {
  return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
}
}  // namespace

std::string visible_device_entry(int cuda_index, const char* cuda_visible, const char* nvidia_visible) {
  if (cuda_index < 0) return "";
  if (cuda_visible) {
    const auto entries = split_devices(cuda_visible);
    if (cuda_index >= static_cast<int>(entries.size())) return "";
    const std::string& e = entries[static_cast<size_t>(cuda_index)];
    return names_no_device(e) ? "" : e;
  }
  // The container runtime's list is not in CUDA's order: only a single entry is surely device 0.
  if (!nvidia_visible || cuda_index != 0) return "";
  const auto entries = split_devices(nvidia_visible);
  return entries.size() == 1 && !names_no_device(entries[0]) ? entries[0] : "";
}

Nvml& Nvml::instance() {
  static Nvml nvml;
  return nvml;
}

Nvml::Nvml() {
  lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib_) {
    error_ = "libnvidia-ml.so.1 not found (no NVIDIA driver here)";
    return;
  }
  auto init = reinterpret_cast<NvmlInitFn>(dlsym(lib_, "nvmlInit_v2"));
  get_handle_ = dlsym(lib_, "nvmlDeviceGetHandleByIndex_v2");
  get_util_ = dlsym(lib_, "nvmlDeviceGetUtilizationRates");
  get_mem_ = dlsym(lib_, "nvmlDeviceGetMemoryInfo");
  get_uuid_ = dlsym(lib_, "nvmlDeviceGetUUID");
  by_uuid_ = dlsym(lib_, "nvmlDeviceGetHandleByUUID");
  get_index_ = dlsym(lib_, "nvmlDeviceGetIndex");
  mig_mode_ = dlsym(lib_, "nvmlDeviceGetMigMode");
  mig_parent_ = dlsym(lib_, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle");
  gpu_instance_id_ = dlsym(lib_, "nvmlDeviceGetGpuInstanceId");
  max_mig_ = dlsym(lib_, "nvmlDeviceGetMaxMigDeviceCount");
  mig_by_index_ = dlsym(lib_, "nvmlDeviceGetMigDeviceHandleByIndex");
  if (!init || !get_handle_ || !get_util_) {
    error_ = "libnvidia-ml.so.1 lacks nvmlInit_v2 / nvmlDeviceGetHandleByIndex_v2 / nvmlDeviceGetUtilizationRates";
    return;
  }
  int rc = init();
  if (rc != 0) {
    error_ = "nvmlInit_v2 failed with NVML error " + std::to_string(rc);
    return;
  }
  ok_ = true;
}

double Nvml::utilization(unsigned index) const {
  if (!ok_) return -1;
  std::lock_guard<std::mutex> lock(mu_);
  void* dev = nullptr;
  if (reinterpret_cast<NvmlGetHandleFn>(get_handle_)(index, &dev) != 0) return -1;
  NvmlUtilization u{};
  if (reinterpret_cast<NvmlGetUtilFn>(get_util_)(dev, &u) != 0) return -1;
  return u.gpu;
}

int64_t Nvml::memory_used(unsigned index) const {
  if (!ok_ || !get_mem_) return -1;
  std::lock_guard<std::mutex> lock(mu_);
  void* dev = nullptr;
  if (reinterpret_cast<NvmlGetHandleFn>(get_handle_)(index, &dev) != 0) return -1;
  NvmlMemory m{};
  if (reinterpret_cast<NvmlGetMemFn>(get_mem_)(dev, &m) != 0) return -1;
  return static_cast<int64_t>(m.used);
}

// ---- identity ---------------------------------------------------------------------------------------
// The caller holds mu_ in the helpers below.

std::string Nvml::uuid_of(void* device) const {
  char buf[kUuidBufferSize] = {};
  if (!get_uuid_ || reinterpret_cast<NvmlGetStringFn>(get_uuid_)(device, buf, sizeof buf) != 0) return "";
  buf[sizeof buf - 1] = '\0';
  return buf;
}

void Nvml::identify_mig(void* mig, GpuIdentity& id) const {
  void* parent = nullptr;
  unsigned gi = 0, index = 0;
  if (mig_parent_ && reinterpret_cast<NvmlParentFn>(mig_parent_)(mig, &parent) == 0) {
    id.uuid = uuid_of(parent);
    if (get_index_ && reinterpret_cast<NvmlGetUintFn>(get_index_)(parent, &index) == 0) id.nvml_index = static_cast<int>(index);
  }
  if (gpu_instance_id_ && reinterpret_cast<NvmlGetUintFn>(gpu_instance_id_)(mig, &gi) == 0) id.gpu_instance_id = static_cast<int>(gi);
  if (id.mig_uuid.empty()) id.mig_uuid = uuid_of(mig);
  if (id.uuid.empty() || id.gpu_instance_id < 0)
    id.note = "NVML did not give the MIG slice's parent GPU or GPU instance (driver older than R470?)";
}

void Nvml::identify_gpu(void* gpu, GpuIdentity& id) const {
  id.uuid = uuid_of(gpu);
  unsigned index = 0, current = 0, pending = 0, max = 0;
  if (get_index_ && reinterpret_cast<NvmlGetUintFn>(get_index_)(gpu, &index) == 0) id.nvml_index = static_cast<int>(index);
  if (id.uuid.empty()) id.note = "NVML gave no UUID for the GPU";
  if (!mig_mode_ || reinterpret_cast<NvmlMigModeFn>(mig_mode_)(gpu, &current, &pending) != 0 || current != 1) return;
  // MIG mode: CUDA runs on a slice, not on the GPU. The slices this process can see; in a container given one
  // slice that is the one.
  std::vector<void*> slices;
  if (max_mig_ && mig_by_index_ && reinterpret_cast<NvmlGetUintFn>(max_mig_)(gpu, &max) == 0)
    for (unsigned i = 0; i < max; ++i) {
      void* mig = nullptr;
      if (reinterpret_cast<NvmlMigByIndexFn>(mig_by_index_)(gpu, i, &mig) == 0 && mig) slices.push_back(mig);
    }
  if (slices.size() == 1) {
    identify_mig(slices[0], id);
    return;
  }
  id.note = "the GPU is in MIG mode and " + std::to_string(slices.size()) +
            " MIG slices are visible: name the slice in CUDA_VISIBLE_DEVICES (MIG-...) to label its instance";
}

GpuIdentity Nvml::identity(int cuda_index) const {
  GpuIdentity id;
  const std::string entry =
      visible_device_entry(cuda_index, std::getenv("CUDA_VISIBLE_DEVICES"), std::getenv("NVIDIA_VISIBLE_DEVICES"));
  // Before R470 a MIG slice was named MIG-GPU-<parent uuid>/<gpu instance>/<compute instance>: it says it all.
  if (entry.rfind("MIG-GPU-", 0) == 0) {
    std::stringstream ss(entry.substr(4));
    std::string uuid, gi;
    if (std::getline(ss, uuid, '/') && std::getline(ss, gi, '/') && is_index(gi)) {
      id.uuid = uuid;
      id.gpu_instance_id = std::atoi(gi.c_str());
      id.mig_uuid = entry;
      return id;
    }
  }
  if (!ok_) {
    id.note = error_;
    return id;
  }
  std::lock_guard<std::mutex> lock(mu_);
  void* dev = nullptr;
  if (entry.rfind("GPU-", 0) == 0 || entry.rfind("MIG-", 0) == 0) {
    if (!by_uuid_ || reinterpret_cast<NvmlByUuidFn>(by_uuid_)(entry.c_str(), &dev) != 0 || !dev) {
      id.note = "NVML does not know the device " + entry;
      return id;
    }
    if (entry.rfind("MIG-", 0) == 0) {
      id.mig_uuid = entry;
      identify_mig(dev, id);
      return id;
    }
  } else {
    const unsigned index = static_cast<unsigned>(is_index(entry) ? std::atoi(entry.c_str()) : cuda_index);
    if (reinterpret_cast<NvmlGetHandleFn>(get_handle_)(index, &dev) != 0 || !dev) {
      id.note = "NVML has no GPU " + std::to_string(index);
      return id;
    }
  }
  identify_gpu(dev, id);
  return id;
}

}  // namespace trainer
