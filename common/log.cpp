#include "common/log.h"

#include <c10/util/Exception.h>
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace trainer {

void setup_logging(const std::string& run_dir, const std::string& level) {
  std::vector<spdlog::sink_ptr> sinks;
  sinks.push_back(std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  if (!run_dir.empty())
    sinks.push_back(std::make_shared<spdlog::sinks::basic_file_sink_mt>(run_dir + "/train.log", /*truncate=*/false));
  auto logger = std::make_shared<spdlog::logger>("trainer", sinks.begin(), sinks.end());
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] %v");
  logger->set_level(spdlog::level::from_str(level));
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
}

MetricsLog::~MetricsLog() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsLog::open(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ >= 0) ::close(fd_);
  fd_ = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw std::runtime_error(path + ": cannot open the metrics file for writing (" + std::strerror(errno) + ")");
  path_ = path;
}

void MetricsLog::append(const std::string& line) {
  struct stat st {};
  const off_t start = ::fstat(fd_, &st) == 0 ? st.st_size : -1;
  size_t done = 0;
  int err = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = n < 0 ? errno : EIO;
      break;
    }
    done += static_cast<size_t>(n);
  }
  if (err == 0) {
    if (!failure_.empty())
      spdlog::warn("metrics: writing {} resumed; {} lines were lost while it failed ({})", path_, lost_, failure_);
    failure_.clear();
    lost_ = 0;
    return;
  }
  // Take back a cut line: the next line must not be glued to half of this one.
  if (done > 0 && start >= 0 && ::ftruncate(fd_, start) != 0) err = errno;
  ++lost_;
  if (failure_.empty()) {
    failure_ = std::strerror(err);
    spdlog::error("metrics: cannot write {} ({}); metrics lines are dropped until it can be written again, "
                  "training goes on", path_, failure_);
  }
}

void MetricsLog::write(const nlohmann::json& record) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (fd_ < 0) return;
    append(json_text(record) + '\n');  // invalid UTF-8 becomes U+FFFD, never an exception
  }
  if (observer_) observer_(record);
}

void MetricsLog::event(const std::string& kind, nlohmann::json fields) {
  fields["event"] = kind;
  write(fields);
}

std::string error_message(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::string msg = c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
  // A c10::Error's what() wrapped into another exception's message still carries its backtrace.
  msg = msg.substr(0, msg.find("\nException raised from"));
  std::string out;
  bool line_start = false;  // skip the indentation of a continuation line
  for (char c : msg) {
    if (c == '\r') continue;
    if (c == '\n') {
      while (!out.empty() && out.back() == ' ') out.pop_back();
      out += "; ";
      line_start = true;
    } else if (!(line_start && (c == ' ' || c == '\t'))) {
      out += c;
      line_start = false;
    }
  }
  while (!out.empty() && (out.back() == ' ' || out.back() == ';')) out.pop_back();
  return out;
}

std::string json_text(const nlohmann::json& j, int indent) {
  return j.dump(indent, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
}

std::string format_duration(double s) {
  char buf[32];
  if (!std::isfinite(s) || s < 0) return "?";
  if (s < 60) std::snprintf(buf, sizeof buf, "%.1fs", s);
  else if (s < 3600) std::snprintf(buf, sizeof buf, "%dm%02ds", int(s) / 60, int(s) % 60);
  else std::snprintf(buf, sizeof buf, "%dh%02dm%02ds", int(s) / 3600, int(s) % 3600 / 60, int(s) % 60);
  return buf;
}

}  // namespace trainer
