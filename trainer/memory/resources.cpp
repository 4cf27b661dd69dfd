#include "trainer/memory/resources.h"

#include "trainer/memory/backend.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <yaml-cpp/yaml.h>

#include <fcntl.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace trainer {

namespace fs = std::filesystem;

namespace {

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::optional<std::string> read_text(const fs::path& p) {
  std::ifstream f(p);
  if (!f) return std::nullopt;
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

int64_t parse_int(const std::string& text, const fs::path& file) {
  const std::string t = trim(text);
  try {
    size_t used = 0;
    const long long v = std::stoll(t, &used);
    if (used == t.size()) return v;
  } catch (const std::exception&) {
  }
  throw std::runtime_error("resources: cannot parse '" + t + "' in " + file.string() +
                           " as an integer; is the cgroup file system mounted normally?");
}

// Where this process's cgroup for `controller` lives: the version and the folder (the cgroup itself and,
// up to the mount point, its ancestors).
struct CgroupLocation {
  int version = 0;
  fs::path mount;  // the controller's mount point (v2: the unified hierarchy)
  fs::path dir;    // this process's cgroup folder under the mount
};

CgroupLocation locate_cgroup(const std::string& root, const std::string& controller) {
  CgroupLocation loc;
  const auto text = read_text(fs::path(root) / "proc/self/cgroup");
  if (!text) return loc;
  const fs::path base = fs::path(root) / "sys/fs/cgroup";
  std::string v1_path, v2_path;
  bool have_v2 = false;
  std::istringstream lines(*text);
  std::string line;
  while (std::getline(lines, line)) {
    // "hierarchy-id:controller-list:path"; the path may itself contain ':'.
    const auto c1 = line.find(':');
    const auto c2 = c1 == std::string::npos ? std::string::npos : line.find(':', c1 + 1);
    if (c2 == std::string::npos) continue;
    const std::string id = line.substr(0, c1), controllers = line.substr(c1 + 1, c2 - c1 - 1);
    const std::string path = line.substr(c2 + 1);
    if (id == "0" && controllers.empty()) {
      have_v2 = true;
      v2_path = path;
      continue;
    }
    for (const auto& c : split(controllers, ','))
      if (c == controller) v1_path = path;
  }
  // A v1 line for the controller wins: on hybrid hosts the controller is bound to v1 and the unified
  // hierarchy has no limit files for it.
  if (!v1_path.empty()) {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(base, ec)) {
      const auto names = split(entry.path().filename().string(), ',');
      if (std::find(names.begin(), names.end(), controller) != names.end() && entry.is_directory(ec)) {
        loc.version = 1;
        loc.mount = entry.path();
        break;
      }
    }
    if (loc.version == 0) return loc;
    fs::path rel = fs::path(v1_path).relative_path();
    // Without a cgroup namespace the path names the host's hierarchy, while the container sees its own
    // cgroup at the mount point: fall back to the mount point.
    loc.dir = fs::is_directory(loc.mount / rel, ec) ? loc.mount / rel : loc.mount;
    return loc;
  }
  if (have_v2) {
    std::error_code ec;
    if (!fs::exists(base / "cgroup.controllers", ec)) return loc;
    loc.version = 2;
    loc.mount = base;
    fs::path rel = fs::path(v2_path).relative_path();
    loc.dir = fs::is_directory(base / rel, ec) ? base / rel : base;
  }
  return loc;
}

// The cgroup folder and its ancestors up to the mount point, innermost first: a parent's limit binds
// its children, so the effective limit is the smallest one on this path.
std::vector<fs::path> dir_and_ancestors(const CgroupLocation& loc) {
  std::vector<fs::path> out;
  fs::path d = loc.dir;
  const fs::path mount = loc.mount.lexically_normal();
  for (;;) {
    out.push_back(d);
    if (d.lexically_normal() == mount || !d.has_parent_path() || d.parent_path() == d) break;
    d = d.parent_path();
  }
  return out;
}

// v1 reports "no limit" as the page counter's maximum rounded to pages (0x7FFFFFFFFFFFF000 on 4 KiB
// pages); anything at or above 2^62 bytes is treated as that.
constexpr int64_t kV1Unlimited = int64_t(1) << 62;

}  // namespace

// ---- cgroups --------------------------------------------------------------------------------------

CgroupMemory read_cgroup_memory(const std::string& root) {
  CgroupMemory out;
  const auto loc = locate_cgroup(root, "memory");
  if (loc.version == 0) return out;
  out.version = loc.version;
  out.dir = loc.dir.string();
  const char* limit_file = loc.version == 2 ? "memory.max" : "memory.limit_in_bytes";
  const char* usage_file = loc.version == 2 ? "memory.current" : "memory.usage_in_bytes";
  for (const auto& d : dir_and_ancestors(loc)) {
    const auto text = read_text(d / limit_file);
    if (!text) continue;
    const std::string t = trim(*text);
    if (t == "max") continue;
    const int64_t v = parse_int(t, d / limit_file);
    if (loc.version == 1 && v >= kV1Unlimited) continue;
    if (v > 0 && (out.limit_bytes == 0 || v < out.limit_bytes)) out.limit_bytes = v;
  }
  if (const auto text = read_text(loc.dir / usage_file)) out.usage_bytes = parse_int(*text, loc.dir / usage_file);
  return out;
}

CgroupCpu read_cgroup_cpu(const std::string& root) {
  CgroupCpu out;
  const auto loc = locate_cgroup(root, "cpu");
  if (loc.version == 0) return out;
  out.version = loc.version;
  out.dir = loc.dir.string();
  for (const auto& d : dir_and_ancestors(loc)) {
    double cpus = 0;
    if (loc.version == 2) {
      const auto text = read_text(d / "cpu.max");
      if (!text) continue;
      std::istringstream in(*text);
      std::string quota, period;
      in >> quota >> period;
      if (quota == "max") continue;
      const int64_t q = parse_int(quota, d / "cpu.max");
      const int64_t p = period.empty() ? 100000 : parse_int(period, d / "cpu.max");
      if (q <= 0 || p <= 0) continue;
      cpus = static_cast<double>(q) / static_cast<double>(p);
    } else {
      const auto qt = read_text(d / "cpu.cfs_quota_us");
      const auto pt = read_text(d / "cpu.cfs_period_us");
      if (!qt || !pt) continue;
      const int64_t q = parse_int(*qt, d / "cpu.cfs_quota_us");
      const int64_t p = parse_int(*pt, d / "cpu.cfs_period_us");
      if (q <= 0 || p <= 0) continue;  // -1 = no quota
      cpus = static_cast<double>(q) / static_cast<double>(p);
    }
    if (out.cpus == 0 || cpus < out.cpus) out.cpus = cpus;
  }
  return out;
}

std::string container_root() {
  const char* v = std::getenv("TRAINER_CGROUP_ROOT");
  return v != nullptr && *v != '\0' ? v : "/";
}

// ---- CPUs -----------------------------------------------------------------------------------------

int usable_cpus(const std::string& root) {
  int n = 0;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) n = CPU_COUNT(&set);
  if (n <= 0) n = static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  const double quota = read_cgroup_cpu(root).cpus;
  // A fractional quota (1.5 CPUs) still lets two threads make progress, so round up.
  if (quota > 0) n = std::min(n, static_cast<int>(std::ceil(quota - 1e-9)));
  return std::max(1, n);
}

bool cpu_has_bfloat16(const std::string& root) {
  std::ifstream f(root + "/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("flags", 0) == 0)
      return line.find(" avx512_bf16") != std::string::npos || line.find(" amx_bf16") != std::string::npos;
  return false;
}

void apply_cpu_threads(int n) {
  if (n < 1) throw std::invalid_argument("resources: CPU threads must be >= 1, got " + std::to_string(n));
  at::set_num_threads(n);
  // LibTorch throws once the inter-op pool has run anything (or was sized before); the pool then keeps
  // its size, which only matters for inter-op parallelism the trainer does not use.
  try {
    at::set_num_interop_threads(n);
  } catch (const c10::Error&) {
  }
}

// ---- host memory ----------------------------------------------------------------------------------

namespace {

// /proc/self/statm in one pread() on a descriptor kept open: every step's metrics line reads it, and
// opening it through a stream took 0.1 ms, which a GPU spends idle between two steps. Opened again in a
// forked child, whose "self" the old descriptor does not name.
std::optional<std::string> read_own_statm() {
  static std::mutex mu;
  static int fd = -1;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (fd < 0 || owner != ::getpid()) {
    if (fd >= 0) ::close(fd);
    fd = ::open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
    owner = ::getpid();
    if (fd < 0) return std::nullopt;
  }
  char buf[256];
  const ssize_t n = ::pread(fd, buf, sizeof(buf), 0);
  if (n <= 0) return std::nullopt;
  return std::string(buf, static_cast<size_t>(n));
}

}  // namespace

int64_t host_rss_bytes(const std::string& root) {
  const auto text = root == "/" ? read_own_statm() : read_text(fs::path(root) / "proc/self/statm");
  if (!text) return 0;
  // "size resident shared ...", in pages
  char* end = nullptr;
  std::strtoll(text->c_str(), &end, 10);
  if (end == text->c_str()) return 0;
  const char* resident = end;
  const int64_t pages = std::strtoll(resident, &end, 10);
  if (end == resident) return 0;
  return pages * static_cast<int64_t>(sysconf(_SC_PAGE_SIZE));
}

int64_t host_rss_peak_bytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;  // Linux reports kilobytes
}

int64_t host_available_bytes(const std::string& root) {
  const auto text = read_text(fs::path(root) / "proc/meminfo");
  if (!text) return 0;
  std::istringstream lines(*text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream in(line.substr(13));
    int64_t kib = 0;
    in >> kib;
    return kib * 1024;
  }
  return 0;
}

int64_t host_anon_rss_bytes(const std::string& root) {
  const auto text = read_text(fs::path(root) / "proc/self/statm");
  if (!text) return 0;
  std::istringstream in(*text);
  int64_t size_pages = 0, resident_pages = 0, shared_pages = 0;
  if (!(in >> size_pages >> resident_pages >> shared_pages)) return 0;
  return std::max<int64_t>(0, resident_pages - shared_pages) * static_cast<int64_t>(sysconf(_SC_PAGE_SIZE));
}

MemoryBounds read_memory_bounds(const std::string& system_root, const std::string& proc_root) {
  MemoryBounds b;
  b.container_bytes = read_cgroup_memory(system_root).limit_bytes;
  const int64_t available = host_available_bytes(system_root);
  if (available > 0) {
    b.host_held_bytes = host_anon_rss_bytes(proc_root);
    b.host_bytes = available + b.host_held_bytes;
  }
  return b;
}

// ---- memory.limit ---------------------------------------------------------------------------------

int64_t auto_cpu_limit(int64_t bound, int64_t other_bytes, int64_t reserve_bytes, double margin) {
  if (!(margin >= 0 && margin < 1))
    throw std::invalid_argument("memory: margin must be a fraction in [0, 1), got " + std::to_string(margin));
  if (reserve_bytes < 0)
    throw std::invalid_argument("memory: the reserve must be >= 0 bytes, got " + std::to_string(reserve_bytes));
  if (bound <= 0) return 0;
  const double left =
      static_cast<double>(bound - std::max<int64_t>(0, other_bytes) - reserve_bytes) * (1 - margin);
  // At least one byte: 0 would mean "no cap", the opposite of a container that is already full.
  return std::max<int64_t>(1, static_cast<int64_t>(std::floor(left)));
}

AutoCpuLimit smaller_auto_cpu_limit(const MemoryBounds& bounds, int64_t rss_bytes, int64_t tensor_bytes,
                                    int64_t reserve_bytes, double margin) {
  // Both count the whole process; the cap counts tensors only. What the process holds outside tensors now
  // (libraries, buffers) is taken off each bound first, then the reserve for what it will hold later
  // (oneDNN's caches and the threads appear with the first steps), then the margin.
  AutoCpuLimit out;
  out.bounds = bounds;
  if (bounds.container_bytes > 0) {
    out.cap = auto_cpu_limit(bounds.container_bytes, rss_bytes - tensor_bytes, reserve_bytes, margin);
    out.source = "container";
  }
  if (bounds.host_bytes > 0) {
    const int64_t cap = auto_cpu_limit(bounds.host_bytes, bounds.host_held_bytes - tensor_bytes, reserve_bytes, margin);
    if (out.cap == 0 || cap < out.cap) {
      out.cap = cap;
      out.source = "host";
    }
  }
  return out;
}

AutoCpuLimit resolve_auto_cpu_limit(const MemoryBackend& backend, const AutoLimitOptions& o) {
  if (!(o.margin >= 0 && o.margin < 1))
    throw std::invalid_argument("memory.limit auto: margin must be a fraction in [0, 1), got " + std::to_string(o.margin));
  return smaller_auto_cpu_limit(read_memory_bounds(o.system_root, o.proc_root), host_rss_bytes(o.proc_root),
                                backend.current_bytes(), o.reserve_bytes, o.margin);
}

void validate_memory_limit_spec(const std::string& spec) {
  const std::string s = lower(trim(spec));
  if (s.empty() || s == "none" || s == "auto") return;
  int64_t bytes = 0;
  try {
    bytes = parse_bytes(s);
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument("memory.limit: '" + spec +
                                "' is not a limit; write a byte size (6GiB, 300MiB, 1.5GB, 123), auto or none");
  }
  // A cap of 0 bytes would mean "no cap": "0" or "0.5" must not lift the limit by accident.
  if (bytes < 1)
    throw std::invalid_argument("memory.limit: '" + spec + "' is not a positive byte size (it rounds to " +
                                std::to_string(bytes) + " bytes); write e.g. 300MiB, or none for no limit");
}

int64_t auto_cuda_limit(int64_t free, int64_t reserved, double margin) {
  return std::max<int64_t>(1, reserved + static_cast<int64_t>(std::floor(static_cast<double>(free) * (1 - margin))));
}

void GpuMemoryFollower::reset(int64_t avail) {
  was_ = avail;
  rise_since_s_ = -1;
}

bool GpuMemoryFollower::moved(int64_t is, int64_t total, double now_s) {
  constexpr int64_t kMinMove = int64_t{64} << 20;
  if (is < was_ - std::max(kMinMove, total / 50)) return true;
  if (is <= was_ + std::max(kMinMove, total / 20)) {
    rise_since_s_ = -1;
    return false;
  }
  if (rise_since_s_ < 0) rise_since_s_ = now_s;
  return now_s - rise_since_s_ >= rise_s_;
}

int64_t resolve_memory_limit(const std::string& spec, const MemoryBackend& backend, const AutoLimitOptions& o) {
  if (!(o.margin >= 0 && o.margin < 1))
    throw std::invalid_argument("memory.limit '" + spec + "': margin must be a fraction in [0, 1), got " +
                                std::to_string(o.margin));
  validate_memory_limit_spec(spec);
  const std::string s = lower(trim(spec));
  if (s.empty() || s == "none") return 0;
  if (s != "auto") return parse_bytes(s);
  // Free device memory does not count what this process's caching allocator already holds.
  if (backend.device().is_cuda())
    return auto_cuda_limit(backend.free_bytes(), backend.reserved_bytes(), o.margin);
  return resolve_auto_cpu_limit(backend, o).cap;
}

// ---- the control file -----------------------------------------------------------------------------

ControlFile::ControlFile(std::string path) : path_(std::move(path)) {}

namespace {

// The control file's text, read without ever blocking the loop: opened non-blocking (a FIFO in its
// place would otherwise wait for a writer), a regular file only, 64 KiB at most. Sets `why` instead.
std::optional<std::string> read_control_text(const std::string& path, std::string& why) {
  constexpr int64_t kMaxBytes = 64 * 1024;
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    why = std::string("cannot open it (") + std::strerror(errno) + ")";
    return std::nullopt;
  }
  struct stat st {};
  std::string text;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    why = "not a regular file (a FIFO, socket or device); write a YAML file";
  } else if (st.st_size > kMaxBytes) {
    why = "larger than 64 KiB (" + std::to_string(st.st_size) + " bytes); it holds one key";
  } else {
    char buf[8192];
    ssize_t n;
    while ((n = ::read(fd, buf, sizeof buf)) > 0 && static_cast<int64_t>(text.size()) <= kMaxBytes)
      text.append(buf, static_cast<size_t>(n));
    if (n < 0) why = std::string("cannot read it (") + std::strerror(errno) + ")";
  }
  ::close(fd);
  if (!why.empty()) return std::nullopt;
  return text;
}

}  // namespace

ControlPoll ControlFile::poll() {
  ControlPoll out;
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0) return out;  // absent: nothing asked
  const int64_t mtime = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  const int64_t size = static_cast<int64_t>(st.st_size);
  if (seen_ && mtime == mtime_ns_ && size == size_) return out;
  seen_ = true;
  mtime_ns_ = mtime;
  size_ = size;
  ++reads_;

  // The file uses the config's own key names (memory: {limit: 200MiB}), so an operator writes what they
  // would have written in the config.
  const std::string keep = " ignored; keeping memory.limit=" + current_.memory_limit.value_or("(unset)");
  const std::string form = "expected 'memory: {limit: 3GiB}' (a byte size, auto or none);";
  ControlUpdate update;
  std::string why;
  const auto text = read_control_text(path_, why);
  if (!text) {
    out.warning = "control file " + path_ + ": " + why + ";" + keep;
    return out;
  }
  try {
    const YAML::Node doc = YAML::Load(*text);
    if (!doc.IsNull() && !doc.IsMap()) {
      out.warning = "control file " + path_ + ": " + form + keep;
      return out;
    }
    for (const auto& kv : doc) {
      const std::string key = kv.first.as<std::string>();
      if (key != "memory" || !kv.second.IsMap()) {
        out.warning = "control file " + path_ + ": unknown key '" + key + "'; " + form + keep;
        return out;
      }
      for (const auto& inner : kv.second) {
        const std::string k = inner.first.as<std::string>();
        if (k != "limit") {
          out.warning = "control file " + path_ + ": unknown key 'memory." + k + "'; " + form + keep;
          return out;
        }
        if (update.memory_limit) {
          out.warning = "control file " + path_ + ": memory.limit appears twice; keep one;" + keep;
          return out;
        }
        if (!inner.second.IsScalar()) {
          out.warning = "control file " + path_ + ": memory.limit must be a scalar; " + form + keep;
          return out;
        }
        const std::string value = inner.second.as<std::string>();
        validate_memory_limit_spec(value);
        update.memory_limit = value;
      }
    }
  } catch (const std::exception& e) {  // YAML::Exception or a bad memory.limit
    std::string what = e.what();
    out.warning = "control file " + path_ + ": " + what + ";" + keep;
    return out;
  }
  // Keys left out of the file keep their value: the file says what to change, not the whole state.
  if (update.memory_limit) current_.memory_limit = update.memory_limit;
  out.update = update;
  return out;
}

}  // namespace trainer
