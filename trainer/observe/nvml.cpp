#include "trainer/observe/nvml.h"

#include <dlfcn.h>

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
}  // namespace

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

}  // namespace trainer
