#include "trainer/step/graph_policy.h"

#include <stdexcept>

#include "trainer/memory/backend.h"

namespace trainer {

const char* to_string(GraphAction action) {
  switch (action) {
    case GraphAction::kEager: return "eager";
    case GraphAction::kCapture: return "capture";
    case GraphAction::kReplay: return "replay";
  }
  return "?";
}

std::string graph_ineligible_reason(const GraphJob& job) {
  if (!job.cuda) return "the step does not run on a CUDA device";
  if (!job.single_process) return "data parallel runs its gradient exchange eagerly";
  if (!job.fused_optimizer)
    return "only the fused optimizer (optim.implementation: fused or auto) reads its learning rate and its skip "
           "from the device";
  if (job.host_draws) return "Mixup and CutMix draw each step's mixing on the host (train.mixup_alpha, train.cutmix_alpha)";
  return "";
}

nlohmann::json GraphEvent::to_json() const {
  return {{"event", "cuda_graph"}, {"kind", kind}, {"reason", reason}, {"sizes", sizes}};
}

namespace {

// The step's layout: what the graph's kernels and addresses depend on (the limit is not part of it).
bool same_layout(const GraphKey& a, const GraphKey& b) {
  return a.sizes == b.sizes && a.checkpointing == b.checkpointing && a.input_shape == b.input_shape;
}

std::string sizes_text(const std::vector<int64_t>& sizes) {
  std::string s;
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? "+" : "") + std::to_string(sizes[i]);
  return s;
}

std::string limit_text(int64_t limit) { return limit > 0 ? format_bytes(limit) : std::string("none"); }

}  // namespace

GraphPolicy::GraphPolicy(GraphPolicyOptions options, const GraphJob& job) : o_(options) {
  if (o_.warmup_steps < 1) throw std::invalid_argument("GraphPolicy: warmup_steps must be at least 1");
  const std::string why = graph_ineligible_reason(job);
  if (o_.mode == Switch::kOn && !why.empty())
    throw std::invalid_argument("train.cuda_graph: on, but " + why + " (auto runs eagerly there)");
  enabled_ = o_.mode != Switch::kOff && why.empty();
  disabled_reason_ = o_.mode == Switch::kOff ? "train.cuda_graph is off" : why;
}

std::string GraphPolicy::stale_reason(const GraphKey& key) const {
  const GraphKey& h = held_key_;
  if (key.sizes != h.sizes) return "the micro-batches changed from " + sizes_text(h.sizes) + " to " + sizes_text(key.sizes);
  if (key.checkpointing != h.checkpointing) return "activation checkpointing turned on";
  if (key.input_shape != h.input_shape) return "the batch's shape changed";
  if (key.limit > 0 && (h.limit == 0 || key.limit < h.limit))
    return "the limit fell from " + limit_text(h.limit) + " to " + limit_text(key.limit) +
           " (a replay allocates nothing, so the new cap binds only on a new capture)";
  return "";
}

GraphAction GraphPolicy::decide(const GraphKey& key) {
  if (!enabled_) return GraphAction::kEager;
  if (held_) {
    const std::string why = stale_reason(key);
    if (why.empty()) {
      held_key_.limit = key.limit;  // a raised limit: the graph still fits, and a later cut is judged from here
      return GraphAction::kReplay;
    }
    release(why);
  }
  if (key.checkpointing) return GraphAction::kEager;
  if (warming_ && same_layout(key, warm_key_) && clean_ >= o_.warmup_steps) {
    held_key_ = key;  // the key the capture is for; held once on_captured() says it worked
    return GraphAction::kCapture;
  }
  return GraphAction::kEager;
}

void GraphPolicy::on_captured(int64_t peak_bytes, double seconds) {
  held_ = true;
  held_peak_ = peak_bytes;
  ++captures_;
  capture_s_ += seconds;
  events_.push_back({"capture",
                     "micro-batches " + sizes_text(held_key_.sizes) + " captured in " +
                         std::to_string(static_cast<int64_t>(seconds * 1000)) + " ms after " +
                         std::to_string(clean_) + " eager steps; peak " + format_bytes(peak_bytes) + ", limit " +
                         limit_text(held_key_.limit),
                     held_key_.sizes});
  warming_ = false;
  clean_ = 0;
}

void GraphPolicy::on_clean_step(const GraphKey& key) {
  if (!enabled_ || held_ || key.checkpointing) return;
  // A cut limit restarts the count as a new layout does: the eager steps must have run under the cap the
  // capture will meet.
  if (!warming_ || !same_layout(key, warm_key_) || key.limit < warm_key_.limit ||
      (key.limit > 0 && warm_key_.limit == 0)) {
    warming_ = true;
    warm_key_ = key;
    clean_ = 0;
  }
  warm_key_.limit = key.limit;
  ++clean_;
}

void GraphPolicy::on_oom() {
  if (held_) release("out of memory");
  warming_ = false;
  clean_ = 0;
}

void GraphPolicy::on_capture_failed(const std::string& why) {
  held_ = false;
  warming_ = false;
  clean_ = 0;
  enabled_ = false;
  disabled_reason_ = "a capture failed: " + why;
  events_.push_back({"disabled", disabled_reason_ + "; the rest of the run is eager", held_key_.sizes});
}

void GraphPolicy::release(const std::string& reason) {
  events_.push_back({"release", "released the graph of micro-batches " + sizes_text(held_key_.sizes) + ": " + reason,
                     held_key_.sizes});
  held_ = false;
  held_peak_ = 0;
  warming_ = false;
  clean_ = 0;
}

std::vector<GraphEvent> GraphPolicy::take_events() {
  std::vector<GraphEvent> out;
  out.swap(events_);
  return out;
}

}  // namespace trainer
