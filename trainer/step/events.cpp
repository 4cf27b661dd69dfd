// The step's policies' events, logged and written to the metrics log (events.h).
#include "trainer/step/events.h"

#include <spdlog/spdlog.h>

namespace trainer {

void write_ladder_events(MicroBatchController& controller, MetricsLog* metrics, const MemoryBackend& memory,
                         int64_t step) {
  for (const auto& e : controller.take_events()) {
    spdlog::info("memory: {}", e.reason);
    if (!metrics) continue;
    nlohmann::json j = e.to_json();
    j["event"] = to_string(e.kind);
    j["step"] = step;
    j["current_bytes"] = memory.current_bytes();
    metrics->write(j);
  }
}

void write_graph_events(GraphPolicy& policy, MetricsLog* metrics, const MemoryBackend& memory, int64_t step) {
  for (const auto& e : policy.take_events()) {
    if (e.kind == "disabled") spdlog::warn("CUDA graph: {}", e.reason);
    else spdlog::info("CUDA graph: {}", e.reason);
    if (!metrics) continue;
    nlohmann::json j = e.to_json();
    j["step"] = step;
    j["current_bytes"] = memory.current_bytes();
    metrics->write(j);
  }
}

void write_cudnn_decisions(CudnnPolicy& policy, MetricsLog* metrics, bool cuda, int64_t step) {
  for (const auto& d : policy.take_decisions()) {
    if (cuda && (d.retry || d.benchmark)) spdlog::info("cuDNN: {}", d.reason);
    else spdlog::debug("cuDNN: {}", d.reason);
    if (!metrics) continue;
    nlohmann::json j = d.to_json();
    j["step"] = step;
    metrics->write(j);
  }
}

}  // namespace trainer
