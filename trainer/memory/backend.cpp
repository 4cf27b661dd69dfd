#include "trainer/memory/backend.h"

#include "common/compat.h"
#include "trainer/memory/resources.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#ifdef TRAINER_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <malloc.h>
#include <mutex>
#include <new>
#include <stdexcept>
#include <unistd.h>

namespace trainer {

// ---- byte sizes -----------------------------------------------------------------------------------

int64_t parse_bytes(const std::string& text) {
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument("parse_bytes: '" + text + "' is not a byte size (" + why +
                                "); write e.g. 6GiB, 300MiB, 512KiB, 1.5GB or 123");
  };
  size_t i = 0;
  const size_t n = text.size();
  while (i < n && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  const size_t num_begin = i;
  bool seen_digit = false, seen_dot = false;
  while (i < n && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) {
    if (text[i] == '.') {
      if (seen_dot) fail("two decimal points");
      seen_dot = true;
    } else {
      seen_digit = true;
    }
    ++i;
  }
  if (!seen_digit) fail(num_begin < n && text[num_begin] == '-' ? "negative" : "no number");
  // strtod on the digits only: no sign, no exponent, no hex can sneak in.
  const double value = std::strtod(text.substr(num_begin, i - num_begin).c_str(), nullptr);
  while (i < n && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  std::string unit;
  while (i < n && !std::isspace(static_cast<unsigned char>(text[i]))) {
    unit += static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
    ++i;
  }
  while (i < n && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  if (i != n) fail("text after the unit");

  double scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  else if (unit == "k" || unit == "kib") scale = 1024.0;
  else if (unit == "m" || unit == "mib") scale = 1024.0 * 1024;
  else if (unit == "g" || unit == "gib") scale = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tib") scale = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "kb") scale = 1e3;
  else if (unit == "mb") scale = 1e6;
  else if (unit == "gb") scale = 1e9;
  else if (unit == "tb") scale = 1e12;
  else fail("unknown unit '" + unit + "'");

  const double bytes = std::floor(value * scale);
  // 2^63 is exactly representable; anything at or above it does not fit in int64_t.
  if (!(bytes < 9223372036854775808.0)) fail("too large");
  return static_cast<int64_t>(bytes);
}

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  const double a = std::fabs(static_cast<double>(bytes));
  if (a < 1024) return std::to_string(bytes) + " B";
  double v = a / 1024;
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%s%.2f %s", bytes < 0 ? "-" : "", v, units[u]);
  return buf;
}

// ---- the capped CPU allocator ---------------------------------------------------------------------

namespace {

// Every block starts with a header that holds its size, so the deleter (a plain function pointer that
// only receives the data pointer) can uncount it. 64 bytes keep the data 64-byte aligned, which is what
// LibTorch's own allocator guarantees and what vectorized kernels expect.
constexpr size_t kAlignment = 64;
constexpr size_t kHeader = 64;
constexpr uint64_t kMagic = 0x7472616e63617021ULL;  // marks our blocks, checked in the deleter

struct Header {
  uint64_t magic;
  uint64_t size;
};
static_assert(sizeof(Header) <= kHeader, "header must fit before the data");

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_cap{0};
std::atomic<int64_t> g_refused{0};
std::atomic<bool> g_installed{false};

void raise_peak(int64_t live) {
  int64_t p = g_peak.load(std::memory_order_relaxed);
  while (live > p && !g_peak.compare_exchange_weak(p, live, std::memory_order_relaxed)) {
  }
}

void capped_delete(void* data) {
  if (data == nullptr) return;
  auto* base = static_cast<char*>(data) - kHeader;
  auto* h = reinterpret_cast<Header*>(base);
  if (h->magic != kMagic) {
    // Allocator::raw_deallocate frees through whatever allocator is installed *now*, so a block that
    // oneDNN raw_allocate'd from LibTorch's default allocator before install() can arrive here. It was
    // never counted: hand it back to its own deleter. (Reading the 64 bytes before it is safe: the
    // default allocator's blocks are 64-byte aligned heap or mmap blocks with their own header there.)
    c10::GetDefaultCPUAllocator()->raw_deleter()(data);
    return;
  }
  g_live.fetch_sub(static_cast<int64_t>(h->size), std::memory_order_relaxed);
  h->magic = 0;
  std::free(base);
}

class CappedCpuAllocator final : public compat::AllocatorBase {
 public:
  c10::DataPtr allocate_bytes(size_t n) const override {
    // oneDNN's raw_allocate asserts data == context, so the DataPtr is {data, data}: the size lives in
    // the header, not in a context object (a context object aborts the process in oneDNN's convolution).
    if (n == 0) return {nullptr, nullptr, &capped_delete, c10::Device(c10::kCPU)};
    const auto want = static_cast<int64_t>(n);
    // Reserve the bytes before allocating so that concurrent allocations cannot jointly overshoot.
    int64_t live = g_live.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t cap = g_cap.load(std::memory_order_relaxed);
      if (cap > 0 && live + want > cap) {
        g_refused.fetch_add(1, std::memory_order_relaxed);
        TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU out of memory (trainer memory cap): tried to allocate ",
                         format_bytes(want), " (", want, " bytes) with ", format_bytes(live), " (", live,
                         " bytes) live under a cap of ", format_bytes(cap), " (", cap,
                         " bytes); lower the micro-batch or raise memory.limit");
      }
      if (g_live.compare_exchange_weak(live, live + want, std::memory_order_relaxed)) break;
    }
    raise_peak(live + want);
    void* base = nullptr;
    if (n > std::numeric_limits<size_t>::max() - kHeader || posix_memalign(&base, kAlignment, kHeader + n) != 0 ||
        base == nullptr) {
      g_live.fetch_sub(want, std::memory_order_relaxed);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU out of memory (system): malloc of ", format_bytes(want),
                       " (", want, " bytes) failed with ", format_bytes(live), " live");
    }
    auto* h = static_cast<Header*>(base);
    h->magic = kMagic;
    h->size = n;
    void* data = static_cast<char*>(base) + kHeader;
    return {data, data, &capped_delete, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &capped_delete; }
};

// Never destroyed: LibTorch keeps the pointer, and tensors freed (or allocated) during static destruction
// must still find a live allocator.
CappedCpuAllocator* g_allocator = nullptr;
std::mutex g_install_mutex;

}  // namespace

namespace cpu_allocator {

void install() {
  std::lock_guard<std::mutex> lock(g_install_mutex);
  if (g_installed.load()) return;
  if (g_allocator == nullptr) g_allocator = new CappedCpuAllocator();
  // The highest priority: a later registration with a lower one (e.g. a static initializer in a
  // library loaded afterwards) cannot silently take the CPU allocator back.
  c10::SetCPUAllocator(g_allocator, /*priority=*/std::numeric_limits<uint8_t>::max());
  if (c10::GetCPUAllocator() != g_allocator)
    throw std::runtime_error(
        "memory: could not install the capped CPU allocator: another allocator holds the highest "
        "priority; memory.limit cannot be enforced on CPU");
  // Keep freed memory in the process. A training step frees and re-allocates the same activation and
  // gradient blocks every step; by default glibc unmaps freed blocks above its (dynamic) mmap threshold
  // and trims free memory at the top of its heaps, so the next step faults the same pages in again,
  // zero-filled by the kernel: 17k page faults (~70 MB) and ~5% of a ResNet-18 CPU step here
  // (docs/BENCHMARKS.md). Serving blocks up to 32 MiB from the heaps (the largest threshold glibc
  // accepts on 64-bit; this also stops its dynamic adjustment) and never trimming on free keeps those
  // pages mapped, as a caching allocator would. The cap is unaffected (it counts live tensor bytes); the
  // process's RSS stays at its high-water mark, and CpuMemoryBackend::empty_cache() (the OOM path) gives
  // the free memory back with malloc_trim. Blocks above 32 MiB are still mapped and unmapped each time.
  // mallopt returns 0 when it refuses a value: then glibc's defaults stay, which is slower, not wrong.
  mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024);
  mallopt(M_TRIM_THRESHOLD, -1);  // -1: never trim on free (mallopt(3))
  g_installed.store(true);
}

bool installed() { return g_installed.load(); }
int64_t live_bytes() { return g_live.load(std::memory_order_relaxed); }
int64_t peak_bytes() { return g_peak.load(std::memory_order_relaxed); }
void reset_peak() { g_peak.store(g_live.load(std::memory_order_relaxed), std::memory_order_relaxed); }
void set_cap(int64_t bytes) {
  if (bytes < 0)
    throw std::invalid_argument("memory: cap must be >= 0 bytes (0 = none), got " + std::to_string(bytes));
  g_cap.store(bytes, std::memory_order_relaxed);
}
int64_t cap() { return g_cap.load(std::memory_order_relaxed); }
int64_t refused_allocations() { return g_refused.load(std::memory_order_relaxed); }

}  // namespace cpu_allocator

ScopedCpuCap::ScopedCpuCap(int64_t bytes) {
  cpu_allocator::install();
  previous_ = cpu_allocator::cap();
  cpu_allocator::set_cap(bytes);
}

ScopedCpuCap::~ScopedCpuCap() { cpu_allocator::set_cap(previous_); }

// ---- backends -------------------------------------------------------------------------------------

std::string MemoryBackend::report() const {
  const int64_t lim = limit();
  return name() + ": current " + format_bytes(current_bytes()) + ", peak " + format_bytes(peak_bytes()) +
         ", reserved " + format_bytes(reserved_bytes()) + ", limit " +
         (lim > 0 ? format_bytes(lim) : std::string("none")) + ", total " + format_bytes(total_bytes());
}

CpuMemoryBackend::CpuMemoryBackend() { cpu_allocator::install(); }
int64_t CpuMemoryBackend::current_bytes() const { return cpu_allocator::live_bytes(); }
int64_t CpuMemoryBackend::peak_bytes() const { return cpu_allocator::peak_bytes(); }
int64_t CpuMemoryBackend::reserved_bytes() const { return cpu_allocator::live_bytes(); }
void CpuMemoryBackend::reset_peak() { cpu_allocator::reset_peak(); }
void CpuMemoryBackend::set_limit(int64_t bytes) { cpu_allocator::set_cap(bytes); }
int64_t CpuMemoryBackend::limit() const { return cpu_allocator::cap(); }
int64_t CpuMemoryBackend::total_bytes() const {
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGE_SIZE));
}
int64_t CpuMemoryBackend::free_bytes() const { return host_available_bytes(); }
// install() told glibc to keep freed memory; after an OOM the free heap memory goes back to the kernel
// (the heap tops and, since glibc 2.8, whole free pages inside every arena), so the machine sees it.
void CpuMemoryBackend::empty_cache() { malloc_trim(0); }

bool cache_over_limit(int64_t reserved, int64_t limit) { return limit > 0 && reserved > limit; }

#ifdef TRAINER_WITH_CUDA
namespace cca = c10::cuda::CUDACachingAllocator;

// DeviceStats' StatArrays are indexed by StatType; AGGREGATE (all pools) is index 0 in every release,
// and indexing by number avoids the namespace StatType moved to in 2.x.
constexpr size_t kAggregate = 0;

CudaMemoryBackend::CudaMemoryBackend(c10::DeviceIndex index) : index_(index) {
  TORCH_CHECK(index >= 0 && index < c10::cuda::device_count(), "memory: no CUDA device ", int(index),
              " (this host has ", int(c10::cuda::device_count()), ")");
  // LibTorch 2.x starts CUDA (context, caching allocator) lazily, at the first CUDA tensor; until then
  // setMemoryFraction and getDeviceStats throw "Invalid device argument ... did you call init?". The
  // backend is created before the model, so it starts CUDA itself, the way every CUDA tensor factory
  // does: an empty tensor on the device (no bytes are allocated).
  (void)at::empty({0}, at::TensorOptions().device(c10::kCUDA, index));
}
std::string CudaMemoryBackend::name() const { return "cuda:" + std::to_string(int(index_)); }
int64_t CudaMemoryBackend::current_bytes() const {
  return cca::getDeviceStats(index_).allocated_bytes[kAggregate].current;
}
int64_t CudaMemoryBackend::peak_bytes() const {
  return cca::getDeviceStats(index_).allocated_bytes[kAggregate].peak;
}
int64_t CudaMemoryBackend::reserved_bytes() const {
  return cca::getDeviceStats(index_).reserved_bytes[kAggregate].current;
}
void CudaMemoryBackend::reset_peak() { cca::resetPeakStats(index_); }
void CudaMemoryBackend::set_limit(int64_t bytes) {
  if (bytes < 0)
    throw std::invalid_argument("memory: limit must be >= 0 bytes (0 = none), got " + std::to_string(bytes));
  const int64_t total = total_bytes();
  // The caching allocator caps what it reserves at fraction * total; its OOM then names the fraction.
  const double fraction = bytes == 0 ? 1.0 : std::min(1.0, static_cast<double>(bytes) / total);
  cca::setMemoryFraction(fraction, index_);
  limit_ = bytes;
  // Between steps the cached segments are free blocks: giving them back makes the next step reserve
  // again, under the new fraction.
  if (cache_over_limit(reserved_bytes(), bytes)) empty_cache();
}
void CudaMemoryBackend::empty_cache() { cca::emptyCache(); }
int64_t CudaMemoryBackend::total_bytes() const {
  return static_cast<int64_t>(at::cuda::getDeviceProperties(index_)->totalGlobalMem);
}
int64_t CudaMemoryBackend::free_bytes() const {
  c10::cuda::CUDAGuard guard(index_);
  size_t free = 0, total = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return static_cast<int64_t>(free);
}
#endif

DeviceMemory device_memory_of(const MemoryBackend& backend) {
  DeviceMemory m;
  m.device = backend.name();
  m.allocated = backend.current_bytes();
  m.reserved = backend.reserved_bytes();
  m.peak = backend.peak_bytes();
  m.limit = backend.limit();
  return m;
}

std::unique_ptr<MemoryBackend> make_memory_backend(c10::Device device) {
  if (device.is_cpu()) return std::make_unique<CpuMemoryBackend>();
  if (device.is_cuda()) {
#ifdef TRAINER_WITH_CUDA
    return std::make_unique<CudaMemoryBackend>(device.has_index() ? device.index() : c10::DeviceIndex(0));
#else
    throw std::runtime_error("memory: device " + device.str() +
                             " requested, but this build of the trainer has no CUDA; build against a CUDA "
                             "LibTorch or use device: cpu");
#endif
  }
  throw std::invalid_argument("memory: no memory backend for device " + device.str() + " (cpu and cuda only)");
}

// ---- classifying failures -------------------------------------------------------------------------

bool is_oom_error(const std::exception& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return true;
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) return true;
  // Older builds and the CUDA libraries report allocation failures as text in a plain error. For a
  // c10::Error the backtrace is left out: its frame names could contain anything.
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  const std::string msg = c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
  std::string lower(msg.size(), ' ');
  std::transform(msg.begin(), msg.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (const char* marker : {"out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed",
                             "cudaerrormemoryallocation"})
    if (lower.find(marker) != std::string::npos) return true;
  return false;
}

}  // namespace trainer
