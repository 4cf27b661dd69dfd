#include "tools/metrics_watch.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/inotify.h>
#include <unistd.h>

#include "common/clock.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace trainer::bench {

MetricsWatcher::MetricsWatcher(const fs::path& dir, const std::string& name, LineCallback on_line)
    : path_((dir / name).string()), t0_(Clock::now()), on_line_(std::move(on_line)) {
  fd_ = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  if (fd_ >= 0 && inotify_add_watch(fd_, dir.c_str(), IN_MODIFY | IN_CREATE) < 0) {
    close(fd_);
    fd_ = -1;
  }
  thread_ = std::thread([this] { loop(); });
}

MetricsWatcher::~MetricsWatcher() {
  stop();
  if (fd_ >= 0) close(fd_);
  if (file_ >= 0) close(file_);
}

void MetricsWatcher::stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

std::string MetricsWatcher::source() const {
  return fd_ >= 0 ? "metrics lines (inotify)" : "metrics lines (polling)";
}

void MetricsWatcher::loop() {
  while (!stop_) {
    if (fd_ >= 0) {
      pollfd p{fd_, POLLIN, 0};
      ::poll(&p, 1, 20);  // the timeout only bounds how long stop() waits
      char buf[4096];
      while (::read(fd_, buf, sizeof buf) > 0) {
      }
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    drain(std::chrono::duration<double>(Clock::now() - t0_).count());
  }
  drain(std::chrono::duration<double>(Clock::now() - t0_).count());
}

void MetricsWatcher::drain(double elapsed_s) {
  if (file_ < 0) file_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (file_ < 0) return;
  char buf[65536];
  ssize_t n;
  while ((n = ::read(file_, buf, sizeof buf)) > 0) pending_.append(buf, static_cast<size_t>(n));
  size_t start = 0, end;
  while ((end = pending_.find('\n', start)) != std::string::npos) {
    const auto j = json::parse(pending_.begin() + start, pending_.begin() + end, nullptr, /*allow_exceptions=*/false);
    start = end + 1;
    if (j.is_object()) on_line_(j, unix_now(), elapsed_s);
  }
  pending_.erase(0, start);
}

}  // namespace trainer::bench
