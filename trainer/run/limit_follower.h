// The memory cap a run follows (memory.limit): resolved at setup, and again between steps when control.yaml
// names another spec or, under `auto`, when what bounds the cap moves. A part of TrainingRun (run.h) with
// its own state. What the device changes is behind one seam, chosen once at setup:
//
//   CPU   `auto`: the smaller of the container's limit and the machine's available memory, less a reserve
//         and a margin (resolve_auto_cpu_limit); followed as the container is resized, the machine's
//         memory falls or rises, and the memory that is not tensors grows.
//   CUDA  `auto`: what this process's allocator reserved plus most of the device's free memory
//         (auto_cuda_limit); followed as another job on the same GPU starts or ends (GpuMemoryFollower).
//
// A byte size or `none` is the same on both. The cap is this process's; the lowest over ranks, which the
// ladder decides against, is the run's to agree on (limits.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "trainer/config/config.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/resources.h"

namespace trainer {

class LimitFollower {
 public:
  /// The follower of `cfg.memory.limit` for a CUDA device (`cuda`) or the CPU; nothing resolved yet.
  static std::unique_ptr<LimitFollower> make(const Config& cfg, MemoryBackend& memory, bool cuda);
  virtual ~LimitFollower() = default;

  /// Resolves the spec now and installs the cap on the memory backend; the cap in bytes (0 = none).
  int64_t install();
  /// Between steps: `new_spec` (control.yaml's memory.limit, if it named one) and, under `auto`, what
  /// bounds the cap, `since_start_s` seconds into the run. Resolves and installs the cap again when
  /// something moved; the cap in force after.
  int64_t poll(const std::optional<std::string>& new_spec, double since_start_s);

  int64_t bytes() const { return bytes_; }             ///< the cap in force (0 = none)
  const std::string& spec() const { return spec_; }    ///< as configured or set through control.yaml
  /// What gave the cap: container, host (auto on the CPU), gpu (auto on CUDA), config (a size), none.
  const std::string& source() const { return source_; }
  /// The container's limit and the machine's memory when the cap was resolved under `auto` on the CPU
  /// (zeros otherwise).
  const MemoryBounds& bounds() const { return bounds_; }
  int64_t rss_at_limit() const { return rss_at_limit_; }  ///< the process's resident bytes then

 protected:
  LimitFollower(const Config& cfg, MemoryBackend& memory, bool cuda);
  /// `auto` resolved on this device: the cap; sets source_ (and bounds_ on the CPU).
  virtual int64_t resolve_auto(const AutoLimitOptions& o) = 0;
  /// After `auto` resolved to `limit` (rss_at_limit_ measured): what the device tells of it.
  virtual void resolved_auto(int64_t limit, const AutoLimitOptions& o) {}
  /// Under `auto`: whether what bounds the cap moved enough since it was resolved to resolve it again.
  virtual bool auto_moved(double since_start_s) = 0;

  /// The cap `spec_` resolves to now.
  int64_t resolve();

  const Config& cfg_;
  MemoryBackend& memory_;
  const bool cuda_;
  std::string spec_;
  int64_t bytes_ = 0;
  std::string source_ = "none";
  MemoryBounds bounds_;
  int64_t rss_at_limit_ = 0;
};

}  // namespace trainer
