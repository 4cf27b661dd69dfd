#include "common/log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>

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

std::string one_line(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::string msg = c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
  while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.pop_back();
  std::string out;
  for (char c : msg) {
    if (c == '\n') out += "; ";
    else out += c;
  }
  return out;
}

void MetricsLog::open(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  out_.open(path, std::ios::app);
  if (!out_) throw std::runtime_error(path + ": cannot open the metrics file for writing");
}

void MetricsLog::write(const nlohmann::json& record) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!out_.is_open()) return;
    out_ << json_text(record) << '\n';
    out_.flush();
  }
  if (observer_) observer_(record);
}

void MetricsLog::event(const std::string& kind, nlohmann::json fields) {
  fields["event"] = kind;
  write(fields);
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
