// Memory accounting and caps under the OOM handling: byte sizes as text, a capped CPU allocator, one
// MemoryBackend seam for CPU and CUDA (the loop never branches on the device), and the test that tells
// an out-of-memory error from any other failure.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <string>

namespace trainer {

// ---- byte sizes -----------------------------------------------------------------------------------

/// Parses a byte size: a non-negative number (decimals allowed) with an optional unit, case-insensitive,
/// spaces allowed between number and unit. Binary units KiB, MiB, GiB, TiB (powers of 1024), decimal
/// units KB, MB, GB, TB (powers of 1000), B or nothing for bytes; "K", "M", "G", "T" mean the binary
/// units. The result is rounded down to whole bytes: "1.5GB" = 1500000000, "512KiB" = 524288.
/// Throws std::invalid_argument naming the text on anything else (empty, negative, unknown unit, overflow).
int64_t parse_bytes(const std::string& text);

/// Formats a byte count with a binary unit and two decimals ("1.50 GiB", "300.00 MiB", "12 B").
/// Negative counts keep their sign.
std::string format_bytes(int64_t bytes);

// ---- the capped CPU allocator ---------------------------------------------------------------------
//
// A process-wide replacement for LibTorch's CPU allocator (c10::SetCPUAllocator at the highest priority).
// Every CPU tensor storage created after install() comes from it: it counts the live bytes (the sizes
// requested, not the 64-byte header it adds) and their peak, and when an allocation would take the live
// bytes past the cap it throws c10::OutOfMemoryError instead of allocating. Storage created before
// install() is freed by LibTorch's own deleter and never enters the count. Thread-safe (atomics):
// LibTorch allocates from its intra-op and autograd threads.
//
// What it does not see: memory that is not a tensor storage (oneDNN scratch buffers and caches, the
// libraries, std::vectors, the data loader's own buffers). A cap is therefore a cap on tensor memory;
// resolve_memory_limit("auto") leaves room for the rest.

namespace cpu_allocator {

/// Installs the capped allocator for every CPU tensor created afterwards. Idempotent; the allocator
/// lives for the whole process. Throws std::runtime_error if another allocator with a higher priority
/// is already installed.
void install();
/// True once install() has run.
bool installed();
/// Bytes of tensor storage currently allocated through the capped allocator.
int64_t live_bytes();
/// Highest live_bytes() since install() or the last reset_peak().
int64_t peak_bytes();
/// Sets the peak to the current live bytes.
void reset_peak();
/// Sets the cap in bytes (0 = none). Takes effect for the next allocation; live memory above a newly
/// lowered cap stays allocated, later allocations fail until enough is freed. Throws
/// std::invalid_argument for a negative cap.
void set_cap(int64_t bytes);
/// The cap in bytes (0 = none).
int64_t cap();
/// Number of allocations refused because of the cap since install().
int64_t refused_allocations();

}  // namespace cpu_allocator

/// Sets the CPU allocator's cap for the lifetime of the object and restores the previous cap on
/// destruction (also while an exception unwinds). Installs the allocator if needed.
class ScopedCpuCap {
 public:
  explicit ScopedCpuCap(int64_t bytes);
  ~ScopedCpuCap();
  ScopedCpuCap(const ScopedCpuCap&) = delete;
  ScopedCpuCap& operator=(const ScopedCpuCap&) = delete;

 private:
  int64_t previous_;
};

// ---- the backend seam -----------------------------------------------------------------------------

/// Memory statistics and caps for the device the model trains on. All sizes are bytes.
/// "current" and "peak" count tensor memory handed out to LibTorch (CPU: live storage of the capped
/// allocator; CUDA: the caching allocator's allocated bytes, not its reserved segments).
class MemoryBackend {
 public:
  virtual ~MemoryBackend() = default;

  /// "cpu" or "cuda:N".
  virtual std::string name() const = 0;
  /// The device whose memory this backend describes.
  virtual c10::Device device() const = 0;
  /// Tensor bytes allocated now.
  virtual int64_t current_bytes() const = 0;
  /// Highest current_bytes() since creation or the last reset_peak().
  virtual int64_t peak_bytes() const = 0;
  /// Bytes held from the system (CUDA: the caching allocator's reserved segments; CPU: = current).
  virtual int64_t reserved_bytes() const = 0;
  /// Starts a new peak from the current value.
  virtual void reset_peak() = 0;
  /// Caps tensor memory at `bytes` (0 = none). Allocations past the cap throw c10::OutOfMemoryError.
  /// CUDA caps the caching allocator's reserved memory at the fraction bytes / total_bytes(), and a cap
  /// lowered below what the allocator holds empties its cache (cache_over_limit): the cap then binds at
  /// the next step, and the memory goes back to the device for other processes.
  virtual void set_limit(int64_t bytes) = 0;
  /// The cap set last (0 = none).
  virtual int64_t limit() const = 0;
  /// Returns cached, unused blocks to the system (CUDA: the caching allocator's; CPU: the free heap
  /// memory malloc keeps, see CpuMemoryBackend).
  virtual void empty_cache() = 0;
  /// Size of the device's memory (CUDA) or of the host's physical memory (CPU).
  virtual int64_t total_bytes() const = 0;
  /// Memory free for new allocations now: cudaMemGetInfo's free bytes (CUDA) or MemAvailable (CPU).
  virtual int64_t free_bytes() const = 0;

  /// One line for logs: "cpu: current 1.20 GiB, peak 2.00 GiB, reserved ..., limit 3.00 GiB, total ...".
  std::string report() const;
};

/// The numbers of a backend that are cheap to read every step (atomics on CPU, the caching allocator's
/// counters on CUDA): what the telemetry shows and what a memory report starts from. Bytes.
struct DeviceMemory {
  std::string device;      ///< "cpu", "cuda:0"
  int64_t allocated = 0;   ///< tensor bytes allocated now
  int64_t reserved = 0;    ///< bytes held from the system (CUDA cache; = allocated on CPU)
  int64_t peak = 0;        ///< peak allocated bytes since the backend's last reset_peak()
  int64_t limit = 0;       ///< the cap in force (0 = none)
};
DeviceMemory device_memory_of(const MemoryBackend& backend);

/// The capped-allocator backend (installs the allocator on construction).
class CpuMemoryBackend : public MemoryBackend {
 public:
  CpuMemoryBackend();
  std::string name() const override { return "cpu"; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  int64_t current_bytes() const override;
  int64_t peak_bytes() const override;
  int64_t reserved_bytes() const override;
  void reset_peak() override;
  void set_limit(int64_t bytes) override;
  int64_t limit() const override;
  /// Hands the free memory glibc's malloc keeps (install() turns off its trimming) back to the kernel:
  /// malloc_trim(0).
  void empty_cache() override;
  int64_t total_bytes() const override;
  int64_t free_bytes() const override;
};

#ifdef TRAINER_WITH_CUDA
/// The CUDA caching allocator's statistics and memory fraction for one device.
class CudaMemoryBackend : public MemoryBackend {
 public:
  explicit CudaMemoryBackend(c10::DeviceIndex index);
  std::string name() const override;
  c10::Device device() const override { return c10::Device(c10::kCUDA, index_); }
  int64_t current_bytes() const override;
  int64_t peak_bytes() const override;
  int64_t reserved_bytes() const override;
  void reset_peak() override;
  void set_limit(int64_t bytes) override;
  int64_t limit() const override { return limit_; }
  void empty_cache() override;
  int64_t total_bytes() const override;
  int64_t free_bytes() const override;

 private:
  c10::DeviceIndex index_;
  int64_t limit_ = 0;
};
#endif

/// Whether setting the cap `limit` (0 = none) must empty the caching allocator's cache, which holds
/// `reserved` bytes. CUDA's allocator checks its cap (a memory fraction) only when it reserves a new
/// segment: a steady step reuses the segments it holds, so a cap lowered below them would cause no OOM,
/// no backoff, and give no memory back to the device. True when a cap is set and `reserved` exceeds it.
bool cache_over_limit(int64_t reserved, int64_t limit);

/// The backend for `device`: CpuMemoryBackend for CPU, CudaMemoryBackend for CUDA (std::runtime_error
/// if this build has no CUDA), std::invalid_argument for other device types.
std::unique_ptr<MemoryBackend> make_memory_backend(c10::Device device);

/// Lifts the memory cap while it lives. Saving and resuming allocate (copies of the state to serialize,
/// the tensors read back), and so does storing the optimizer's state in fewer bytes: under a cap at or
/// below the live bytes, the one that made the run give up for example, they would fail and lose the
/// progress the cap did not. This memory is temporary and small next to a step's activations.
class LiftedCap {
 public:
  explicit LiftedCap(MemoryBackend& memory) : memory_(memory), limit_(memory.limit()) {
    if (limit_ > 0) memory_.set_limit(0);
  }
  ~LiftedCap() {
    if (limit_ > 0) memory_.set_limit(limit_);
  }
  LiftedCap(const LiftedCap&) = delete;
  LiftedCap& operator=(const LiftedCap&) = delete;

 private:
  MemoryBackend& memory_;
  int64_t limit_;
};

// ---- classifying failures -------------------------------------------------------------------------

/// True if `e` means "out of memory" and a smaller micro-batch may succeed: c10::OutOfMemoryError (the
/// capped CPU allocator and the CUDA caching allocator throw it), std::bad_alloc, and the text that older
/// builds and CUDA libraries put into a plain c10::Error or std::runtime_error: "CUDA out of memory",
/// "out of memory" (cudaMalloc's cudaErrorMemoryAllocation), "CUBLAS_STATUS_ALLOC_FAILED",
/// "CUDNN_STATUS_ALLOC_FAILED". Anything else (including cuDNN's CUDNN_STATUS_NOT_SUPPORTED for
/// non-contiguous inputs) is false: those failures would not go away with a smaller batch.
bool is_oom_error(const std::exception& e);

}  // namespace trainer
