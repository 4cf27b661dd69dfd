#include "common/run_lock.h"

#include "common/clock.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

namespace fs = std::filesystem;

namespace trainer {
namespace {

// The folders this process holds, by identity (device, inode), so that a path spelled another way
// (relative, through a link) finds the same lock. Entries whose lock was released expire.
std::mutex table_mu;
std::map<std::pair<uint64_t, uint64_t>, std::weak_ptr<RunFolderLock>>& table() {
  static std::map<std::pair<uint64_t, uint64_t>, std::weak_ptr<RunFolderLock>> t;
  return t;
}

std::string lock_path(const std::string& dir) { return (fs::path(dir) / kRunLockFile).string(); }

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

struct flock whole_file(short type) {
  struct flock fl {};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = 0;
  fl.l_len = 0;  // to the end of the file, however long
  fl.l_pid = 0;  // required by the OFD commands
  return fl;
}

// A file system that answers lock requests with these does not support locks (some FUSE mounts, old
// NFS servers without lockd).
bool no_lock_support(int err) { return err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS || err == EINVAL; }

void write_holder(int fd, const RunLockOptions& opts) {
  const nlohmann::json j = {{"host", host_name()},         {"pid", static_cast<int64_t>(getpid())},
                            {"started", utc_now_iso()},        {"config", opts.config},
                            {"command", opts.command}};
  const std::string text = j.dump() + "\n";
  // Best effort: the lock is what excludes; the text only names the holder to the next process.
  if (::ftruncate(fd, 0) == 0 && ::pwrite(fd, text.data(), text.size(), 0) == static_cast<ssize_t>(text.size()))
    ::fsync(fd);
}

}  // namespace

std::string RunFolderHolder::describe() const {
  if (pid == 0 && host.empty()) return "another process (it has not written its name yet)";
  std::string s = "pid " + std::to_string(pid) + " on host " + host;
  if (!started.empty()) s += " since " + started;
  std::string what = command;
  if (!config.empty()) what += (what.empty() ? "" : ", ") + std::string("config ") + config;
  if (!what.empty()) s += " (" + what + ")";
  return s;
}

std::optional<RunFolderHolder> RunFolderLock::read_holder(const std::string& dir) {
  const int fd = ::open(lock_path(dir).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return std::nullopt;
  char buf[4096];
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  ::close(fd);
  RunFolderHolder h;
  if (n <= 0) return h;  // taken, but not written yet
  const auto j = nlohmann::json::parse(std::string(buf, static_cast<size_t>(n)), nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return h;
  auto str = [&](const char* k) { return j.contains(k) && j[k].is_string() ? j[k].get<std::string>() : std::string(); };
  h.host = str("host");
  h.started = str("started");
  h.config = str("config");
  h.command = str("command");
  if (j.contains("pid") && j["pid"].is_number_integer()) h.pid = j["pid"].get<int64_t>();
  return h;
}

std::string RunFolderLock::busy_message(const std::string& dir, const RunFolderHolder& holder, double waited_s) {
  std::string s = dir + ": the run folder is in use by " + holder.describe() + "; ";
  if (waited_s > 0)
    return s + "still held after waiting " + std::to_string(static_cast<int64_t>(std::lround(waited_s))) +
           " s (raise --wait-for-run-dir, or use another --run-dir)";
  return s + "one run folder takes one trainer: wait for it with --wait-for-run-dir SECONDS, or use another --run-dir";
}

std::optional<RunFolderHolder> RunFolderLock::held_by_other(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return std::nullopt;
  {
    std::lock_guard<std::mutex> g(table_mu);
    auto it = table().find({st.st_dev, st.st_ino});
    if (it != table().end() && !it->second.expired()) return std::nullopt;
  }
  // F_OFD_GETLK asks without taking anything, so a read-only folder (or file) can be asked too.
  const int fd = ::open(lock_path(dir).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return std::nullopt;  // no lock file: no trainer ever held it
  struct flock fl = whole_file(F_WRLCK);
  const int rc = ::fcntl(fd, F_OFD_GETLK, &fl);
  ::close(fd);
  if (rc != 0 || fl.l_type == F_UNLCK) return std::nullopt;
  return read_holder(dir).value_or(RunFolderHolder{});
}

std::shared_ptr<RunFolderLock> RunFolderLock::try_acquire(const std::string& dir, const RunLockOptions& opts,
                                                          RunFolderHolder* holder) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw std::runtime_error(dir + ": cannot create the run folder (" + ec.message() + ")");
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0)
    throw std::runtime_error(dir + ": cannot read the run folder (" + std::strerror(errno) + ")");
  if (!S_ISDIR(st.st_mode)) throw std::runtime_error(dir + ": the run folder is not a folder");
  const std::pair<uint64_t, uint64_t> key{st.st_dev, st.st_ino};

  std::lock_guard<std::mutex> g(table_mu);
  if (auto it = table().find(key); it != table().end())
    if (auto held = it->second.lock()) return held;  // this process holds it already (a bench and its job)

  // O_NOFOLLOW: a link planted as the lock file is refused, not followed to whatever it names.
  const std::string path = lock_path(dir);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0)
    throw std::runtime_error(path + ": cannot open the run folder's lock file (" + std::strerror(errno) + ")");
  struct flock fl = whole_file(F_WRLCK);
  if (::fcntl(fd, F_OFD_SETLK, &fl) != 0) {
    const int err = errno;
    if (err == EAGAIN || err == EACCES) {
      ::close(fd);
      if (holder) *holder = read_holder(dir).value_or(RunFolderHolder{});
      return nullptr;
    }
    if (!no_lock_support(err)) {
      ::close(fd);
      throw std::runtime_error(path + ": cannot lock the run folder (" + std::strerror(err) + ")");
    }
    spdlog::warn("{}: the file system does not support locks ({}); a second trainer on this folder would not be "
                 "stopped", path, std::strerror(err));
    ::close(fd);
    auto unlocked = std::shared_ptr<RunFolderLock>(new RunFolderLock(dir, -1, key.first, key.second));
    table()[key] = unlocked;
    return unlocked;
  }
  write_holder(fd, opts);
  auto lock = std::shared_ptr<RunFolderLock>(new RunFolderLock(dir, fd, key.first, key.second));
  table()[key] = lock;
  return lock;
}

std::shared_ptr<RunFolderLock> RunFolderLock::acquire(const std::string& dir, const RunLockOptions& opts) {
  RunFolderHolder holder;
  if (auto lock = try_acquire(dir, opts, &holder)) return lock;
  if (opts.wait_s <= 0) throw RunFolderBusy(busy_message(dir, holder, 0));
  const auto t0 = std::chrono::steady_clock::now();
  auto waited = [&] { return seconds_since(t0); };
  double next_report = 0;
  for (;;) {
    const double w = waited();
    if (w >= next_report) {
      if (opts.on_wait) opts.on_wait(holder, w);
      else
        spdlog::info("{}: waiting for {} to let go of the run folder ({:.0f} s of {:.0f} s)", dir, holder.describe(), w,
                     opts.wait_s);
      next_report = w + opts.report_every_s;
    }
    if (w >= opts.wait_s) throw RunFolderBusy(busy_message(dir, holder, w));
    std::this_thread::sleep_for(std::chrono::duration<double>(std::min(opts.poll_every_s, opts.wait_s - w)));
    if (auto lock = try_acquire(dir, opts, &holder)) {
      spdlog::info("{}: the run folder is free after {:.1f} s", dir, waited());
      return lock;
    }
  }
}

RunFolderLock::~RunFolderLock() {
  std::lock_guard<std::mutex> g(table_mu);
  auto it = table().find({dev_, ino_});
  if (it != table().end() && it->second.expired()) table().erase(it);
  if (fd_ >= 0) ::close(fd_);  // the kernel releases the lock with the last descriptor of its open file
}

}  // namespace trainer
