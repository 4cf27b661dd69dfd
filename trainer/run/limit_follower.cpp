// The memory cap a run follows, and its CPU and CUDA ways of following `auto` (limit_follower.h).
#include "trainer/run/limit_follower.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "trainer/memory/heap.h"
#include "trainer/run/from_config.h"

namespace trainer {

LimitFollower::LimitFollower(const Config& cfg, MemoryBackend& memory, bool cuda)
    : cfg_(cfg), memory_(memory), cuda_(cuda), spec_(cfg.memory.limit) {}

int64_t LimitFollower::install() {
  bytes_ = resolve();
  memory_.set_limit(bytes_);
  return bytes_;
}

int64_t LimitFollower::resolve() {
  const AutoLimitOptions o = auto_limit_options(cfg_, cuda_);
  bounds_ = MemoryBounds{};
  int64_t limit = 0;
  if (spec_ == "auto") {
    limit = resolve_auto(o);
  } else {
    limit = resolve_memory_limit(spec_, memory_, o);
    source_ = limit == 0 ? "none" : "config";
  }
  rss_at_limit_ = host_rss_bytes();
  if (spec_ == "auto") resolved_auto(limit, o);
  return limit;
}

int64_t LimitFollower::poll(const std::optional<std::string>& new_spec, double since_start_s) {
  bool changed = false;
  if (new_spec && *new_spec != spec_) {
    spdlog::info("control.yaml: memory.limit {} -> {}", spec_, *new_spec);
    spec_ = *new_spec;
    changed = true;
  }
  if (spec_ == "auto" && auto_moved(since_start_s)) changed = true;
  if (!changed) return bytes_;
  const int64_t limit = resolve();
  if (limit != bytes_) {
    spdlog::info("memory: limit {} -> {} ({})", bytes_ ? format_bytes(bytes_) : "none",
                 limit ? format_bytes(limit) : "none", spec_);
    bytes_ = limit;
    memory_.set_limit(limit);
  }
  return bytes_;
}

namespace {

// The CPU: the container's limit and the machine's memory, read again between steps. A `docker update
// --memory` or a Kubernetes in-place resize reaches the trainer this way, and so does another process on
// the machine that grows (the cap falls before the kernel's OOM killer acts) or ends (the cap rises and the
// micro-batch can grow back). A fall of 2% of the bound is acted on, a rise only past 5%, so that a
// neighbour's small swings do not move the cap every step. The cap is also resolved again when the memory
// that is not tensors has grown by more than 2% of the bound since it was set: the first steps page in
// libraries and caches (35 MB of ResNet-20's first steps with the 2.11 wheel), which the margin alone need
// not cover.
class CpuLimitFollower : public LimitFollower {
 public:
  CpuLimitFollower(const Config& cfg, MemoryBackend& memory) : LimitFollower(cfg, memory, /*cuda=*/false) {}

 protected:
  int64_t resolve_auto(const AutoLimitOptions& o) override {
    // What is not tensors, measured as auto_moved measures it: before the heap is trimmed.
    nontensor_at_limit_ = host_rss_bytes() - memory_.current_bytes();
    // The container and the machine count the heap's kept pages; a cap on live tensors alone does not
    // bound them.
    return_freed_memory();
    const AutoCpuLimit a = resolve_auto_cpu_limit(memory_, o);
    bounds_ = a.bounds;
    source_ = a.source;
    return a.cap;
  }

  void resolved_auto(int64_t limit, const AutoLimitOptions& o) override {
    if (limit > 0)
      spdlog::info("memory.limit auto: container limit {}, machine {} (available + held), the {} binds; resident {} "
                   "({} in tensors), reserve {}, margin {:.0f}% -> tensor cap {}",
                   bounds_.container_bytes ? format_bytes(bounds_.container_bytes) : "none",
                   bounds_.host_bytes ? format_bytes(bounds_.host_bytes) : "unknown", source_,
                   format_bytes(rss_at_limit_), format_bytes(memory_.current_bytes()), format_bytes(o.reserve_bytes),
                   100 * o.margin, format_bytes(limit));
    else
      spdlog::warn("memory.limit auto: no container limit, and /proc/meminfo unreadable: nothing caps this run");
  }

  bool auto_moved(double) override {
    const MemoryBounds now = read_memory_bounds(container_root());
    const int64_t was = bounds_.host_bytes, is = now.host_bytes;  // 0: /proc/meminfo unreadable, no news
    if (now.container_bytes != bounds_.container_bytes) return true;
    if (was > 0 && is > 0 && is < was - std::max<int64_t>(4 << 20, was / 50)) {
      spdlog::info("memory.limit auto: the machine's memory for this process fell from {} to {}; resolving the cap "
                   "again", format_bytes(was), format_bytes(is));
      return true;
    }
    if (was > 0 && source_ == "host" && is > was + std::max<int64_t>(4 << 20, was / 20)) {
      spdlog::info("memory.limit auto: the machine's memory for this process rose from {} to {}; resolving the cap "
                   "again", format_bytes(was), format_bytes(is));
      return true;
    }
    if (bytes_ <= 0) return false;
    const int64_t bound = source_ == "container" ? bounds_.container_bytes : bounds_.host_bytes;
    const int64_t nontensor = host_rss_bytes() - memory_.current_bytes();
    if (nontensor - nontensor_at_limit_ <= std::max<int64_t>(4 << 20, bound / 50)) return false;
    spdlog::info("memory.limit auto: memory that is not tensors grew from {} to {} since the cap was set; "
                 "resolving it again", format_bytes(nontensor_at_limit_), format_bytes(nontensor));
    return true;
  }

 private:
  int64_t nontensor_at_limit_ = 0;  // RSS less live tensor bytes when the cap was resolved (bytes)
};

// A GPU: the device's memory, read again between steps. Another job that starts on the same GPU lowers the
// cap (a cap below what this job holds empties its cache, and the next step backs off if it needs more),
// one that ends raises it once the rise has lasted (the micro-batch can grow back).
class CudaLimitFollower : public LimitFollower {
 public:
  CudaLimitFollower(const Config& cfg, MemoryBackend& memory) : LimitFollower(cfg, memory, /*cuda=*/true) {}

 protected:
  int64_t resolve_auto(const AutoLimitOptions& o) override {
    const int64_t limit = resolve_memory_limit("auto", memory_, o);
    source_ = limit == 0 ? "none" : "gpu";
    if (limit != 0) follower_.reset(memory_.free_bytes() + memory_.reserved_bytes());
    return limit;
  }

  bool auto_moved(double since_start_s) override {
    const int64_t was = follower_.was(), is = memory_.free_bytes() + memory_.reserved_bytes();
    if (!follower_.moved(is, memory_.total_bytes(), since_start_s)) return false;
    spdlog::info("memory.limit auto: the GPU memory this process may hold (free + its own) {} from {} to {}; "
                 "resolving the cap again", is < was ? "fell" : "rose", format_bytes(was), format_bytes(is));
    return true;
  }

 private:
  GpuMemoryFollower follower_;  // free + reserved device memory when the cap was resolved, and its rises
};

}  // namespace

std::unique_ptr<LimitFollower> LimitFollower::make(const Config& cfg, MemoryBackend& memory, bool cuda) {
  if (cuda) return std::make_unique<CudaLimitFollower>(cfg, memory);
  return std::make_unique<CpuLimitFollower>(cfg, memory);
}

}  // namespace trainer
