#include "tools/bench/host_info.h"

#include <spdlog/spdlog.h>

#include <torch/torch.h>

#ifdef TRAINER_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "common/clock.h"
#include "common/compat.h"
#include "common/versions.h"
#include "tools/bench/bench.h"
#include "trainer/memory/resources.h"

using nlohmann::json;

namespace trainer {
namespace bench {

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

// LibTorch's Linear layers call libblas.so.3's sgemm, which Debian's update-alternatives points at
// netlib's reference BLAS or at OpenBLAS: a 10-100x difference.
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

int64_t minor_page_faults() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_minflt);
}

double process_cpu_seconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

namespace {

struct CudaInfo {
  std::string cuda, cudnn, device_name, driver;  // "" where unknown (always without CUDA)
};

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

CudaInfo cuda_info(const std::string& device) {
  CudaInfo info;
#ifdef TRAINER_WITH_CUDA
  try {
    info.cuda = cuda_runtime_version();
    info.cudnn = cudnn_version();
    torch::Device d(device);
    if (d.is_cuda()) {
      info.device_name = at::cuda::getDeviceProperties(d.has_index() ? d.index() : 0)->name;
      info.driver = first_line_of("nvidia-smi --query-gpu=driver_version --format=csv,noheader");
    }
  } catch (const std::exception& e) {
    spdlog::warn("bench: could not read the CUDA versions or device name: {}", e.what());
  }
#endif
  return info;
}

}  // namespace
}  // namespace bench

json bench_environment(const std::string& device) {
  json j;
  j["date"] = utc_now_iso();
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  j["host"] = {{"hostname", host},
               {"cpu_model", bench::cpu_model()},
               {"nproc", static_cast<int64_t>(sysconf(_SC_NPROCESSORS_ONLN))},
               {"usable_cpus", usable_cpus()},
               {"load_avg", bench::load_avg()}};
  const bench::CudaInfo cuda = bench::cuda_info(device);
  j["versions"] = {{"trainer", TRAINER_VERSION}, {"torch", compat::torch_version()}, {"cuda", cuda.cuda},
                   {"cudnn", cuda.cudnn}, {"blas", bench::loaded_blas()}};
  j["device"] = device;
  j["device_name"] = cuda.device_name;
  if (!cuda.driver.empty()) j["driver"] = cuda.driver;
  return j;
}

}  // namespace trainer
