// What the container gives this process: the cgroup's memory limit and CPU quota, the CPUs it may run
// on, its resident memory; the `memory.limit` setting resolved to bytes; and the operator's control file
// (`<run-dir>/control.yaml`) that changes the limit while the trainer runs.
//
// Every function that reads the system takes `root` ("/" by default): files are read under it
// (root + "/proc/self/cgroup", root + "/sys/fs/cgroup/..."), so tests build a fake tree in a temp folder.
// The trainer itself reads the cgroup files under container_root() (TRAINER_CGROUP_ROOT, for tests) and
// its own memory under the real /proc, always.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace trainer {

class MemoryBackend;

// ---- cgroups --------------------------------------------------------------------------------------

/// The memory controller of the cgroup this process is in.
struct CgroupMemory {
  int version = 0;           ///< 1 or 2; 0 when no memory controller was found (not in a cgroup).
  int64_t limit_bytes = 0;   ///< memory.max (v2) / memory.limit_in_bytes (v1); 0 = none ("max", or v1's
                             ///< huge "unlimited" value). v2 takes the smallest limit of the cgroup and
                             ///< its ancestors.
  int64_t usage_bytes = 0;   ///< memory.current (v2) / memory.usage_in_bytes (v1); includes page cache.
  std::string dir;           ///< the cgroup folder the values came from ("" if none).
};

/// The CPU controller of the cgroup this process is in.
struct CgroupCpu {
  int version = 0;    ///< 1 or 2; 0 when no CPU controller was found.
  double cpus = 0;    ///< quota / period: cpu.max "150000 100000" = 1.5; 0 = no quota ("max ...", -1).
  std::string dir;    ///< the cgroup folder the values came from ("" if none).
};

/// Reads the memory limit and usage of this process's cgroup (v1 or v2, found through
/// /proc/self/cgroup and the mounts under /sys/fs/cgroup). Returns version 0 and zeros where there is
/// none. Throws std::runtime_error naming the file when a limit file exists but cannot be parsed.
CgroupMemory read_cgroup_memory(const std::string& root = "/");

/// Reads the CPU quota of this process's cgroup: v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us.
/// v2 takes the smallest quota of the cgroup and its ancestors. Throws std::runtime_error naming the
/// file when a quota file exists but cannot be parsed.
CgroupCpu read_cgroup_cpu(const std::string& root = "/");

/// Where the trainer reads the container's cgroup files (proc/self/cgroup and sys/fs/cgroup/... under
/// it) and the machine's proc/meminfo: the environment variable TRAINER_CGROUP_ROOT if set and not empty,
/// else "/". For tests: a fake tree there stands in for a container's memory limit (and CPU quota) and for
/// the machine's available memory (a tree without proc/meminfo: unknown, no host bound). It replaces
/// nothing else: the process's resident memory is still read from the real /proc, and no memory is
/// actually limited, so a test must measure the process's RSS against the limit it wrote.
std::string container_root();

// ---- CPUs -----------------------------------------------------------------------------------------

/// CPUs this process can use: min(CPUs in its sched_getaffinity mask, ceil(cgroup quota)), at least 1.
int usable_cpus(const std::string& root = "/");

/// Whether the CPU has bfloat16 arithmetic (the avx512_bf16 or amx_bf16 flag of ROOT/proc/cpuinfo). Without
/// it LibTorch's bfloat16 matmuls are emulated, many times slower than float32's (docs/MEMORY.md).
bool cpu_has_bfloat16(const std::string& root = "/");

/// Sets LibTorch's intra-op threads to `n` (at::set_num_threads) and, if the inter-op pool has not
/// started yet, its inter-op threads too. LibTorch refuses to resize the inter-op pool once any parallel
/// work ran; that case is skipped silently (the pool keeps its size). Throws std::invalid_argument for
/// n < 1.
void apply_cpu_threads(int n);

// ---- host memory ----------------------------------------------------------------------------------

/// This process's resident set size in bytes (second field of /proc/self/statm times the page size);
/// 0 if the file cannot be read.
int64_t host_rss_bytes(const std::string& root = "/");

/// This process's peak resident set size so far in bytes (getrusage's ru_maxrss: the kernel's high-water
/// mark, not a sample).
int64_t host_rss_peak_bytes();

/// MemAvailable from /proc/meminfo in bytes (0 if it cannot be read).
int64_t host_available_bytes(const std::string& root = "/");

/// The part of this process's resident set the kernel counts in no other figure: statm's resident less
/// shared (the file-backed pages: mapped libraries, which are page cache), in bytes; 0 if unreadable.
int64_t host_anon_rss_bytes(const std::string& root = "/");

// ---- memory.limit ---------------------------------------------------------------------------------

/// What `memory.limit: auto` holds back on the CPU, and where it reads the container and the process.
/// The defaults are measured (docs/MEMORY.md "RSS against the container's limit").
struct AutoLimitOptions {
  double margin = 0.1;        ///< memory.auto_margin: the fraction held back, in [0, 1)
  int64_t reserve_bytes = 0;  ///< memory.auto_reserve: bytes held back for non-tensor memory that grows
                              ///< after the limit is resolved (oneDNN caches, threads, the loader), >= 0
  std::string system_root = "/";  ///< where the cgroup files and proc/meminfo are read (container_root()
                                  ///< in the trainer)
  std::string proc_root = "/";    ///< where proc/self/statm is read (tests only; the trainer: "/")
};

/// Every limit that binds this process on the CPU, as `memory.limit: auto` reads them.
struct MemoryBounds {
  int64_t container_bytes = 0;  ///< the cgroup's memory limit; 0 = none
  /// What the machine lets this process hold: MemAvailable plus the anonymous resident set
  /// (host_anon_rss_bytes); 0 = unknown (/proc/meminfo unreadable). The sum does not move when this
  /// process allocates or frees (MemAvailable falls by what the resident set gains), only when something
  /// else on the machine takes or gives back memory. Swap is not counted: a step whose tensors are
  /// swapped out runs orders of magnitude slower, and many hosts (Kubernetes nodes) have none.
  int64_t host_bytes = 0;
  int64_t host_held_bytes = 0;  ///< the anonymous resident set counted in host_bytes
};

/// Reads both bounds: the cgroup and proc/meminfo under `system_root`, the resident set under `proc_root`.
MemoryBounds read_memory_bounds(const std::string& system_root = "/", const std::string& proc_root = "/");

/// The CPU "auto" rule for one bound, for tests and logs: the bytes left for tensors when the bound
/// allows `bound` bytes, `other_bytes` of which the process already uses outside tensors (libraries,
/// buffers), holding back `reserve_bytes` and then the fraction `margin`:
/// floor((bound - other_bytes - reserve_bytes) * (1 - margin)), at least 1 byte. 0 when bound is 0.
int64_t auto_cpu_limit(int64_t bound, int64_t other_bytes, int64_t reserve_bytes, double margin);

/// What `memory.limit: auto` resolves to on the CPU, and which bound gave it.
struct AutoCpuLimit {
  int64_t cap = 0;              ///< bytes for tensors; 0 when neither bound is known (no cap)
  std::string source = "none";  ///< "container", "host" or "none": whose cap is the smaller
  MemoryBounds bounds;          ///< what was read
};

/// The rule over both bounds: each bound's cap by auto_cpu_limit, the smaller wins. The container counts
/// the whole resident set (`rss_bytes`, page cache included), so its memory that is not tensors is
/// rss_bytes - tensor_bytes; the machine's bound counts the anonymous part (bounds.host_held_bytes), so
/// there it is host_held_bytes - tensor_bytes, and the host's cap is (MemAvailable + tensor_bytes -
/// reserve) * (1 - margin).
AutoCpuLimit smaller_auto_cpu_limit(const MemoryBounds& bounds, int64_t rss_bytes, int64_t tensor_bytes,
                                    int64_t reserve_bytes, double margin);

/// smaller_auto_cpu_limit over the bounds read now (o.system_root, o.proc_root), this process's resident
/// set and `backend`'s live tensor bytes.
AutoCpuLimit resolve_auto_cpu_limit(const MemoryBackend& backend, const AutoLimitOptions& o);

/// The CUDA "auto" rule: what this process's caching allocator already reserved, plus (1 - margin) of
/// the device's free memory: reserved + floor(free * (1 - margin)), at least 1 byte. The margin is taken
/// from what is free, never from what the process holds: when another job starts on the same GPU and
/// takes memory, this job's cap falls to what it holds plus a share of what is left, so it keeps its
/// memory and only growing further ends in a backoff, while the newcomer starts with (1 - margin) of what
/// this one left. (A margin on free + reserved would push the first job below what it holds as soon as
/// the second took its share; each backoff of one would then let the other grow, in turn.)
int64_t auto_cuda_limit(int64_t free, int64_t reserved, double margin);

/// When `auto` on a GPU resolves its cap again between steps. It watches free + reserved device memory:
/// what the process may hold, which does not move when the process itself allocates or frees, only when
/// another process takes or gives back memory. A fall of 2% of the device's `total` (at least 64 MiB) is
/// acted on at once: the other process holds that memory now. A rise of 5% (at least 64 MiB) only once it
/// has lasted `rise_s` seconds: a neighbour whose micro-batch search or probe frees and takes back tens
/// of GB within a second would otherwise raise the cap, send this job probing a larger micro-batch, and
/// fail the probe a step later (seen on an H200 with two jobs: four failed probes in 100 steps).
class GpuMemoryFollower {
 public:
  explicit GpuMemoryFollower(double rise_s = 10.0) : rise_s_(rise_s) {}
  /// The cap was resolved when free + reserved was `avail`.
  void reset(int64_t avail);
  /// free + reserved is `is` at time `now_s` (seconds, any monotonic origin): true when the cap is to be
  /// resolved again.
  bool moved(int64_t is, int64_t total, double now_s);
  int64_t was() const { return was_; }

 private:
  double rise_s_;
  int64_t was_ = 0;
  double rise_since_s_ = -1;  // when the current rise was first seen; -1: none
};

/// Resolves a `memory.limit` spec to a cap in bytes (0 = none):
///   "none" or ""  -> 0
///   a byte size   -> that size (parse_bytes: "6GiB", "1.5GB", "123"); at least 1 byte ("0", "0.5" are invalid)
///   "auto"        -> CPU: resolve_auto_cpu_limit(backend, o).cap: the smaller of the container's and the
///                    machine's caps; 0 only where neither bound can be read;
///                    CUDA: auto_cuda_limit(free device memory, what this process's allocator reserved,
///                    margin).
/// o.margin is a fraction in [0, 1): the share of the memory held back for what the cap does not see
/// (non-tensor memory, fragmentation, other processes). Throws std::invalid_argument naming the spec for
/// an invalid spec, margin or reserve.
int64_t resolve_memory_limit(const std::string& spec, const MemoryBackend& backend, const AutoLimitOptions& o);

/// Checks a `memory.limit` spec without resolving it ("none", "", "auto" or a byte size of at least 1
/// byte). Throws std::invalid_argument naming the spec otherwise.
void validate_memory_limit_spec(const std::string& spec);

// ---- the control file -----------------------------------------------------------------------------

/// What the operator asked for in the control file. A key that is absent means "no change".
struct ControlUpdate {
  std::optional<std::string> memory_limit;  ///< a memory.limit spec: bytes, "auto" or "none"
};

/// The result of polling the control file.
struct ControlPoll {
  std::optional<ControlUpdate> update;  ///< set when the file changed and parsed
  std::string warning;                  ///< set when the file changed but is malformed; log it at warn
};

/// `<run-dir>/control.yaml`, which an operator edits while the trainer runs:
///
///     memory:
///       limit: 3GiB     # or auto, none, 3221225472
///
/// poll() re-reads the file only when its modification time or size changed since the last read, so
/// calling it every step costs one stat(). It never blocks: the file is opened non-blocking and read
/// only if it is a regular file of at most 64 KiB. A malformed file (bad YAML, not a mapping, an unknown
/// or repeated key, a bad value, not a regular file, too large) never throws: poll() returns a warning
/// that names the file and the problem, and the values from the last good read stay in current(). A
/// missing file is not an error (no update).
class ControlFile {
 public:
  explicit ControlFile(std::string path);

  /// Checks the file; see the class comment.
  ControlPoll poll();
  /// The values of the last good read (empty before one).
  const ControlUpdate& current() const { return current_; }
  /// How many times the file was actually read and parsed (not just stat'ed).
  int64_t reads() const { return reads_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  bool seen_ = false;
  int64_t mtime_ns_ = 0;
  int64_t size_ = -1;
  int64_t reads_ = 0;
  ControlUpdate current_;
};

}  // namespace trainer
