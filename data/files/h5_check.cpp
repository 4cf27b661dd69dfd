// The readers (and through them torch) first: c10/util/variant.h calls an unqualified data(), which
// does not compile once namespace data is declared.
#include "data/files/image_h5.h"
#include "data/files/packed_images.h"
#include "data/files/token_h5.h"

#include "data/files/h5_check.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <map>
#include <mutex>
#include <new>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <vector>

extern char** environ;

namespace data {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<bool> g_serves_check{false};

// The child's lines on its stderr (a pipe to the parent) start with this tag; any other line there is
// someone else's, e.g. glibc's "double free or corruption (out)" before it aborts.
constexpr const char* kTag = "h5check: ";
constexpr int kExitRefused = 2;
constexpr int kExitOutOfMemory = 3;
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr size_t kMaxOutput = 64 << 10;  // the tail of the child's stderr that is kept
constexpr double kStartS = 60;           // the child's own start, before it reads anything

// ---- the child ------------------------------------------------------------------------------------

void say(const std::string& line) {
  const std::string s = kTag + line + "\n";
  if (write(STDERR_FILENO, s.data(), s.size()) < 0) return;  // nobody to tell
}

uint64_t address_space_now() {
  std::ifstream f("/proc/self/statm");
  uint64_t pages = 0;
  f >> pages;
  return pages * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

// Lets this process map at most `extra` bytes more than it has mapped now, so that a length read from a
// corrupt file that asks for gigabytes or terabytes fails at once instead of filling the machine. Only
// the soft limit moves (the data phase raises it again); a lower hard limit of the user's is kept.
void limit_address_space(uint64_t extra) {
  rlimit r{};
  if (getrlimit(RLIMIT_AS, &r) != 0) return;
  rlim_t want = static_cast<rlim_t>(address_space_now() + extra);
  if (r.rlim_max != RLIM_INFINITY) want = std::min(want, r.rlim_max);
  r.rlim_cur = want;
  setrlimit(RLIMIT_AS, &r);
}

// What the parent's reader does: open and check (metadata, extents, storage sizes, labels), then the
// first and last samples; with in_memory, the whole dataset as well.
void check_images(const std::string& path, bool in_memory, uint64_t file_bytes) {
  say("phase metadata");
  limit_address_space(kGiB + 8 * file_bytes);  // labels become int64: 8 bytes per stored byte at most
  uint64_t data_bytes = 0;
  {
    ImageH5Dataset ds(path, /*in_memory=*/false);
    if (ds.size() > 0) {
      const std::vector<int64_t> ends = {0, ds.size() - 1};
      std::vector<uint8_t> images(2 * static_cast<size_t>(ds.sample_bytes()));
      std::vector<int64_t> labels(2);
      ds.read(ends, images.data(), labels.data());
    }
    data_bytes = static_cast<uint64_t>(ds.size()) * static_cast<uint64_t>(ds.sample_bytes());
  }
  if (!in_memory) return;
  say("phase data");
  limit_address_space(kGiB + data_bytes);  // the reader checked that the file stores them
  ImageH5Dataset all(path, /*in_memory=*/true);
}

// A packed JPEG file: the reader's open-time checks (offsets, labels, sizes, the stored size of /bytes),
// then the first and last images' bytes as stored (decoding is the training step's, per sample); with
// in_memory the whole /bytes as well.
void check_packed(const std::string& path, bool in_memory, uint64_t file_bytes) {
  say("phase metadata");
  limit_address_space(kGiB + 8 * file_bytes);  // offsets, labels and sizes as int64: at most 8 per stored byte
  {
    PackedImageDataset ds(path, ImageTransform{}, /*in_memory=*/false);
    if (ds.size() > 0) {
      ds.encoded(0);
      ds.encoded(ds.size() - 1);
    }
  }
  if (!in_memory) return;
  say("phase data");
  limit_address_space(kGiB + 2 * file_bytes);
  PackedImageDataset all(path, ImageTransform{}, /*in_memory=*/true);
}

void check_tokens(const std::string& path, bool in_memory, uint64_t file_bytes) {
  say("phase metadata");
  limit_address_space(kGiB + file_bytes);
  int64_t n = 0;
  {
    TokenDataset ds(path, /*in_memory=*/false);
    n = ds.size();
    int64_t ends[2];
    if (n > 0) {
      ds.read(0, 1, ends);
      ds.read(n - 1, 1, ends + 1);
    }
  }
  if (!in_memory) return;
  say("phase data");
  limit_address_space(kGiB + 4 * static_cast<uint64_t>(n));  // uint16 or int32 tokens
  TokenDataset all(path, /*in_memory=*/true);
}

// The child's whole life: argv = exe, kH5CheckCommand, images|packed|tokens, memory|file, parent pid, path.
int run_child(int argc, char** argv) {
  if (argc != 6) {
    say("refused usage: trainer " + std::string(kH5CheckCommand) + " images|packed|tokens memory|file PARENT_PID PATH");
    return kExitRefused;
  }
  const std::string kind = argv[2], mode = argv[3], path = argv[5];
  if ((kind != "images" && kind != "packed" && kind != "tokens") || (mode != "memory" && mode != "file")) {
    say("refused " + std::string(kH5CheckCommand) + ": unknown kind '" + kind + "' or mode '" + mode + "'");
    return kExitRefused;
  }
  // Dies with the parent (a parent killed by SIGKILL cannot kill us); the check covers a parent that
  // died before this line.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (std::to_string(getppid()) != argv[4]) return kExitRefused;
  struct stat st{};
  const uint64_t bytes = ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
  try {
    if (kind == "tokens") check_tokens(path, mode == "memory", bytes);
    else if (kind == "packed") check_packed(path, mode == "memory", bytes);
    else check_images(path, mode == "memory", bytes);
  } catch (const std::bad_alloc&) {
    say("out of memory");
    return kExitOutOfMemory;
  } catch (const std::exception& e) {
    say(std::string("refused ") + e.what());
    return kExitRefused;
  }
  say("ok");
  return 0;
}

// ---- the parent -----------------------------------------------------------------------------------

// What the child said: the last phase it entered, its refusal, whether it finished, and the last line
// that was not its own.
struct Report {
  std::string phase = "start", refusal, other;
  bool ok = false;
};

Report parse_report(const std::string& output) {
  Report r;
  std::istringstream in(output);
  const size_t tag = std::strlen(kTag);
  for (std::string line; std::getline(in, line);) {
    if (line.compare(0, tag, kTag) != 0) {
      if (!line.empty()) r.other = line;
      continue;
    }
    line.erase(0, tag);
    if (line.rfind("phase ", 0) == 0) r.phase = line.substr(6);
    else if (line.rfind("refused ", 0) == 0) r.refusal = line.substr(8);
    else if (line == "ok") r.ok = true;
  }
  return r;
}

// This environment, with the child kept off GPUs and to one thread in the math libraries (it needs
// neither), and glibc's fatal messages sent to stderr (the pipe) instead of the terminal.
std::vector<std::string> child_environment() {
  static const char* const kSet[] = {"CUDA_VISIBLE_DEVICES=", "OMP_NUM_THREADS=1", "OPENBLAS_NUM_THREADS=1",
                                     "MKL_NUM_THREADS=1", "LIBC_FATAL_STDERR_=1"};
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string var = *e;
    const auto same_name = [&](const char* s) { return var.rfind(std::string(s, std::strchr(s, '=') + 1), 0) == 0; };
    if (std::none_of(std::begin(kSet), std::end(kSet), same_name)) env.push_back(var);
  }
  env.insert(env.end(), std::begin(kSet), std::end(kSet));
  return env;
}

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> p;
  for (auto& s : strings) p.push_back(s.data());
  p.push_back(nullptr);
  return p;
}

// Starts /proc/self/exe with `args` (argv[1..]), stdin and stdout on /dev/null and stderr on `err_fd`,
// every signal at its default and unblocked. posix_spawn, not fork(): this process has threads.
pid_t spawn_self(std::vector<std::string> args, int err_fd) {
  args.insert(args.begin(), "trainer");
  std::vector<std::string> env = child_environment();
  auto argv = pointers(args), envp = pointers(env);
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&files, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_adddup2(&files, err_fd, STDERR_FILENO);
#if defined(__GLIBC__) && __GLIBC_PREREQ(2, 34)
  posix_spawn_file_actions_addclosefrom_np(&files, STDERR_FILENO + 1);  // no other descriptor of ours
#endif
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &files, &attr, argv.data(), envp.data());
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&files);
  if (rc != 0) throw std::runtime_error(std::string("cannot start the process that checks the file: ") + std::strerror(rc));
  return pid;
}

// How the child ended: its wait status, whether it was killed for time, and the tail of its stderr.
struct Ended {
  int status = 0;
  bool timed_out = false;
  std::string output;
};

// Owns a running child: kills and reaps it unless it was reaped, so no exception leaves one behind.
struct ChildGuard {
  pid_t pid;
  ~ChildGuard() {
    if (pid <= 0) return;
    kill(pid, SIGKILL);
    while (waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
};

// Reads the child's stderr until it closes, then reaps the child. Kills it `limit` after it said it began
// reading (its first "phase" line), or at `start_deadline` if it never got that far: the process's own
// start (LibTorch's static setup) is no part of reading the file, and takes seconds on a loaded machine.
Ended wait_child(ChildGuard& child, int fd, Clock::time_point start_deadline, Clock::duration limit) {
  Ended e;
  bool open = true, reading = false;
  Clock::time_point deadline = start_deadline;
  char buf[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      kill(child.pid, SIGKILL);
      while (waitpid(child.pid, &e.status, 0) < 0 && errno == EINTR) {
      }
      child.pid = -1;
      e.timed_out = true;
      return e;
    }
    if (open) {
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(std::min<int64_t>(left, INT_MAX))) <= 0) continue;  // time, or EINTR
      const ssize_t n = read(fd, buf, sizeof buf);
      if (n > 0) e.output.append(buf, static_cast<size_t>(n));
      else if (n == 0 || errno != EINTR) open = false;  // the child closed its end: it is exiting
      if (!reading && e.output.find(std::string(kTag) + "phase ") != std::string::npos) {
        reading = true;
        deadline = Clock::now() + limit;
      }
      if (e.output.size() > kMaxOutput) e.output.erase(0, e.output.size() - kMaxOutput);
      continue;
    }
    const pid_t w = waitpid(child.pid, &e.status, WNOHANG);
    if (w == child.pid) {
      child.pid = -1;
      return e;
    }
    if (w < 0 && errno != EINTR) throw std::runtime_error(std::string("waitpid: ") + std::strerror(errno));
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev != nullptr ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

std::string seconds_str(double s) {
  std::ostringstream o;
  o << std::setprecision(3) << s;  // "3", not "3.00026" (the per-GiB allowance of a small file)
  return o.str();
}

// The one line for a child that did not read the file cleanly.
std::string describe(const Ended& e, const Report& r, const std::string& path, double limit_s,
                     const std::string& hint) {
  const std::string doing = r.phase == "data"       ? "reading the data of " + path
                            : r.phase == "metadata" ? "reading the metadata of " + path
                                                    : "starting the check of " + path;
  if (e.timed_out && r.phase == "start") {
    return "the process that checks " + path + " did not start within " + seconds_str(kStartS) +
           " s and was killed: the machine is very slow";
  }
  if (e.timed_out) {
    return "libhdf5 did not finish " + doing + " within " + seconds_str(limit_s) +
           " s and was killed: the file is corrupt (its metadata loops), or the disk or the machine is very slow" +
           hint;
  }
  if (WIFSIGNALED(e.status)) {
    const int sig = WTERMSIG(e.status);
    const std::string name = signal_name(sig);
    if (sig == SIGKILL) return "the check of " + path + " was killed (SIGKILL) while " + doing + ": out of memory?";
    if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) return "the check of " + path + " was interrupted (" + name + ")";
    const std::string detail = sig == SIGABRT && !r.other.empty() ? name + ": " + r.other : name;
    return "libhdf5 crashed (" + detail + ") " + doing + ": the file is corrupt";
  }
  const int code = WIFEXITED(e.status) ? WEXITSTATUS(e.status) : -1;
  if (code == kExitRefused && !r.refusal.empty()) return r.refusal;  // the reader's own line
  if (code == kExitOutOfMemory) {
    return "libhdf5 ran out of memory " + doing + " (the check allows 1 GiB more than the file's data): " +
           "the file is corrupt (a length in it asks for more than the file holds)";
  }
  return "the check of " + path + " failed (exit " + std::to_string(code) + ")" + (r.other.empty() ? "" : ": " + r.other);
}

// Files that passed, by (path, size, modification time, kind): true if the check read all data.
std::mutex g_passed_mutex;
std::map<std::tuple<std::string, int64_t, int64_t, int>, bool> g_passed;

}  // namespace

H5CheckResult check_h5_file(const std::string& path, const H5CheckOptions& options) {
  if (!g_serves_check.load()) return {};
  struct stat st{};
  const bool exists = ::stat(path.c_str(), &st) == 0;
  // A FIFO, a socket, a device or a folder: the reader refuses it at once, naming what it is (a child would
  // wait on a FIFO until its timeout).
  if (exists && !S_ISREG(st.st_mode)) return {};
  const int64_t bytes = exists ? static_cast<int64_t>(st.st_size) : 0;
  const auto key = std::make_tuple(path, bytes, exists ? static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec : 0,
                                   static_cast<int>(options.kind));
  {
    std::lock_guard<std::mutex> lock(g_passed_mutex);
    auto it = g_passed.find(key);
    if (it != g_passed.end() && (it->second || !options.in_memory)) return {};
  }
  const double limit_s = options.timeout_s + kH5CheckSecondsPerGiB * static_cast<double>(bytes) / kGiB;
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
  const auto t0 = Clock::now();
  Ended ended;
  try {
    const char* kind = options.kind == H5FileKind::tokens          ? "tokens"
                       : options.kind == H5FileKind::packed_images ? "packed"
                                                                   : "images";
    ChildGuard child{spawn_self({kH5CheckCommand, kind,
                                 options.in_memory ? "memory" : "file", std::to_string(getpid()), path},
                                fds[1])};
    close(fds[1]);
    fds[1] = -1;
    auto seconds = [](double s) { return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s)); };
    ended = wait_child(child, fds[0], t0 + seconds(kStartS), seconds(limit_s));
  } catch (...) {
    if (fds[1] >= 0) close(fds[1]);
    close(fds[0]);
    throw;
  }
  close(fds[0]);
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const Report report = parse_report(ended.output);
  if (ended.timed_out || !WIFEXITED(ended.status) || WEXITSTATUS(ended.status) != 0 || !report.ok)
    throw std::runtime_error(describe(ended, report, path, limit_s, options.timeout_hint));
  std::lock_guard<std::mutex> lock(g_passed_mutex);
  g_passed[key] = g_passed[key] || options.in_memory;
  return {true, seconds};
}

std::optional<int> serve_h5_check(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], kH5CheckCommand) == 0) return run_child(argc, argv);
  // A SIGCHLD ignored by whoever started us survives exec, and then no child's exit status can be read.
  struct sigaction sa{};
  if (sigaction(SIGCHLD, nullptr, &sa) == 0 && sa.sa_handler == SIG_IGN) signal(SIGCHLD, SIG_DFL);
  g_serves_check = true;
  return std::nullopt;
}

}  // namespace data
