// When the training step runs as a CUDA graph (train.cuda_graph), as pure logic: before each step, whether
// it runs eagerly, is captured, or replays the graph already captured; what makes a captured graph stale;
// and what an out-of-memory error or a failed capture does. Nothing here touches tensors or the device:
// the step (trainer/step/step.cpp, trainer/step/step_graph.h) carries out each decision, writes the events
// to metrics.jsonl (event "cuda_graph"), and the rules are tested without a GPU. docs/MEMORY.md "The step
// as a CUDA graph".
//
// A graph is one micro-batch layout frozen: its kernels, their launch arguments and the addresses of every
// tensor they touch, in a memory pool of its own. So a graph serves exactly the step it was captured from:
//   - the same micro-batch sizes (the ladder's backoff or grow-back changes them);
//   - no activation checkpointing: the recomputation saves and restores the random generators on the host
//     in backward, which a capture cannot record (the step runs eagerly while any block recomputes);
//   - the same input shapes (a short last batch of an epoch runs eagerly);
//   - a limit no lower than at capture. A graph allocates nothing when it replays, so a cut cap would
//     never bind: the cut releases the graph and its pool, and the next capture happens under the new
//     cap, where an OOM reaches the ladder as in an eager step. A raised limit keeps the graph (it still
//     fits); grow-back then changes the micro-batch, which captures anew.
// A new layout runs `warmup_steps` clean eager steps before its capture: the first uses of a size choose
// cuDNN's and cuBLAS's algorithms and allocate their workspaces, which a capture must find done.
//
// An OOM in a captured step can only happen during the capture (a replay allocates nothing): the graph is
// released with its pool and the ladder takes its next rung as for any OOM. Any other failure of a capture
// is one warning, and the rest of the run is eager.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/config/config.h"

namespace trainer {

/// What the job is, for whether graphs can run at all (GraphPolicy::eligible).
struct GraphJob {
  bool cuda = false;          ///< the step runs on a CUDA device, in a build with CUDA
  bool single_process = true; ///< not data parallel (the gradient exchange runs eagerly)
  bool fused_optimizer = true;///< optim.implementation resolved to fused: the only update that reads its
                              ///< learning rate and its skip from the device
  bool host_draws = false;    ///< Mixup/CutMix: each step's lambdas and boxes are drawn on the host
};

/// Why `job` cannot run its step as a graph ("" when it can): the first of no CUDA device, data parallel,
/// an optimizer that is not fused, Mixup or CutMix.
std::string graph_ineligible_reason(const GraphJob& job);

/// What a graph is captured for: it replays only for a step with the same key.
struct GraphKey {
  std::vector<int64_t> sizes;  ///< the step's micro-batch sizes, in order
  bool checkpointing = false;  ///< any block recomputes its activations
  std::vector<int64_t> input_shape;  ///< the batch's input tensor's shape
  int64_t limit = 0;           ///< the memory cap the step runs under (0 = none)

  bool operator==(const GraphKey& o) const {
    return sizes == o.sizes && checkpointing == o.checkpointing && input_shape == o.input_shape && limit == o.limit;
  }
  bool operator!=(const GraphKey& o) const { return !(*this == o); }
};

enum class GraphAction {
  kEager,    ///< run the step eagerly
  kCapture,  ///< capture the step at this key, then replay it for this step
  kReplay,   ///< replay the graph held
};

/// "eager", "capture", "replay".
const char* to_string(GraphAction action);

/// A decision or a change worth a record: a capture, a release, the switch to eager for the run.
struct GraphEvent {
  std::string kind;    ///< "capture", "release", "disabled"
  std::string reason;  ///< one sentence
  std::vector<int64_t> sizes;  ///< the key's micro-batch sizes (capture, release)
  /// {"event": "cuda_graph", "kind", "reason", "sizes"}.
  nlohmann::json to_json() const;
};

struct GraphPolicyOptions {
  Switch mode = Switch::kAuto;  ///< train.cuda_graph
  int64_t warmup_steps = 2;  ///< clean eager steps at a new key before its capture (>= 1)
};

class GraphPolicy {
 public:
  /// `job`: where the step runs. std::invalid_argument when mode is kOn and the job is not eligible
  /// (the message names train.cuda_graph and the reason), or warmup_steps < 1.
  GraphPolicy(GraphPolicyOptions options, const GraphJob& job);

  /// Whether graphs are used at all in this run (mode and job; false after a failed capture).
  bool enabled() const { return enabled_; }
  /// Why they are not ("" while enabled): train.cuda_graph off, the job's reason, or the failed capture.
  const std::string& disabled_reason() const { return disabled_reason_; }

  /// Before a step at `key`: what it does. Releases a held graph the key no longer matches (an event says
  /// why); the caller then drops the graph it holds (holds_graph() turns false).
  GraphAction decide(const GraphKey& key);

  /// The capture that decide() asked for succeeded: the graph for that key is held. `peak_bytes`: the
  /// tensor memory the capture allocated at its peak, which every replay uses (reported as the step's peak).
  void on_captured(int64_t peak_bytes, double seconds);
  /// An eager step at `key` completed without running out of memory (counts towards the warmup).
  void on_clean_step(const GraphKey& key);
  /// The step ran out of memory (during a capture, or eagerly): any graph is released and the warmup starts
  /// again at whatever key the ladder moves to.
  void on_oom();
  /// A capture failed for another reason (`why`): graphs are off for the rest of the run; one event.
  void on_capture_failed(const std::string& why);

  bool holds_graph() const { return held_; }
  const GraphKey& held_key() const { return held_key_; }
  /// The capture's peak (on_captured), while a graph is held.
  int64_t held_peak_bytes() const { return held_peak_; }
  /// Captures so far, and the seconds they took.
  int64_t captures() const { return captures_; }
  double capture_seconds() const { return capture_s_; }

  /// The events since the last call, oldest first.
  std::vector<GraphEvent> take_events();

 private:
  void release(const std::string& reason);
  /// Why a held graph of `held_key_` cannot serve `key` ("" when it can).
  std::string stale_reason(const GraphKey& key) const;

  GraphPolicyOptions o_;
  bool enabled_ = false;
  std::string disabled_reason_;
  bool held_ = false;
  GraphKey held_key_;
  int64_t held_peak_ = 0;
  bool warming_ = false;  ///< clean_ counts steps at warm_key_
  GraphKey warm_key_;
  int64_t clean_ = 0;
  int64_t captures_ = 0;
  double capture_s_ = 0;
  std::vector<GraphEvent> events_;
};

}  // namespace trainer
