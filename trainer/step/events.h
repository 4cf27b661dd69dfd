// What the step's policies decided, told once each: a log line, and an event in the run's metrics log
// (metrics.jsonl) when there is one. The policies (the OOM ladder's controller, the CUDA graph policy,
// the cuDNN policy) are pure and only queue their events; the step drains them here after each decision.
#pragma once

#include <cstdint>

#include "common/log.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/oom.h"
#include "trainer/step/cudnn_policy.h"
#include "trainer/step/graph_policy.h"

namespace trainer {

/// The ladder's events (backoffs, probes, limit changes) as of `step`, with the memory held now.
void write_ladder_events(MicroBatchController& controller, MetricsLog* metrics, const MemoryBackend& memory,
                         int64_t step);

/// The CUDA graph policy's events (captures, releases, a disabled graph) as of `step`.
void write_graph_events(GraphPolicy& policy, MetricsLog* metrics, const MemoryBackend& memory, int64_t step);

/// The cuDNN policy's decisions as of `step`. Off a CUDA device (`cuda` false) nothing reads cuDNN's flag:
/// the decisions are still recorded in the metrics log, but their lines are debug, since a line saying
/// "timing it" would tell a CPU user of a wait that does not happen.
void write_cudnn_decisions(CudnnPolicy& policy, MetricsLog* metrics, bool cuda, int64_t step);

}  // namespace trainer
