// The optimizer step: forward/backward over micro-batches, the update, and recovery from running out of
// memory in any part of it.
#include "trainer/step/step.h"

#include <spdlog/spdlog.h>

#include "common/clock.h"
#include "common/compat.h"
#include "trainer/mix/device_augment.h"
#include "trainer/step/events.h"

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <set>
#include <utility>

namespace trainer {

// ---- the step ----------------------------------------------------------------------------------------

namespace {

// Data parallel: the ranks must take the same rung together, and whether an attempt timed a new size can
// differ between ranks (their auto searches may have probed other sizes): no rerun of a timing there; it
// backs off as any OOM does.
CudnnPolicyOptions cudnn_options(CudnnPolicyOptions o, bool distributed) {
  if (distributed) o.retry_tuning_oom = false;
  return o;
}

// Where the step can run as a CUDA graph: a CUDA device in a build with CUDA, one process, and the update
// that reads its rate and its skip on the device (update_then_read's path).
GraphJob graph_job(const StepParts& p, const StepOptions& o) {
  GraphJob job;
#ifdef TRAINER_WITH_CUDA
  job.cuda = o.forward.device.is_cuda();
#endif
  job.single_process = p.dist == nullptr;
  job.fused_optimizer = p.optimizer && p.optimizer->skips_on_device() && o.skip_on_device;
  job.host_draws = o.mix.enabled();
  return job;
}

GraphPolicyOptions graph_options(const StepOptions& o) {
  GraphPolicyOptions g;
  g.mode = o.cuda_graph;
  g.warmup_steps = o.graph_warmup_steps;
  return g;
}

}  // namespace

Step::Step(StepParts parts, StepOptions options, MicroBatchController controller)
    : p_(std::move(parts)),
      o_(std::move(options)),
      controller_(std::move(controller)),
      cudnn_(cudnn_options(o_.cudnn, p_.dist != nullptr)),
      graph_policy_(graph_options(o_), graph_job(p_, o_)) {
  if (!p_.model || !p_.optimizer || !p_.scaler || !p_.memory || !p_.reporter)
    throw std::invalid_argument("Step: model, optimizer, scaler, memory backend and reporter are required");
  if (p_.dist && !p_.grad_sync) throw std::invalid_argument("Step: a distributed step needs its GradientSync");
  if (p_.shards && (!p_.dist || !p_.optimizer->sharded()))
    throw std::invalid_argument("Step: sharded parameters need the process group and an optimizer over the pieces");
}

torch::Tensor Step::forward_backward(const data::Batch& batch, int64_t offset, int64_t n, double normalizer,
                                     PhasePeakRecorder& phases) {
  phases.enter("forward");
  Logits out = augmented_logits(*p_.model, batch, offset, n, mix_, o_.forward, o_.loss.label_smoothing);
  // Summed, then divided by the targets of the whole step: micro-batches of any sizes add up to the
  // mean over the global batch (no "mean of means").
  torch::Tensor loss = summed_loss(out.logits, out.targets, o_.loss, out.columns) / normalizer;
  phases.enter("backward");
  p_.scaler->scale(loss).backward();
  return loss.detach();
}

torch::Tensor Step::prepare_update(PhasePeakRecorder& phases, StepResult& r) {
  phases.enter("optimizer");  // from here on: the gradient exchange, optimizer state, unscale, norm
  if (p_.grad_sync) {
    r.grad_buckets_in_backward = p_.grad_sync->sent_during_backward();
    p_.grad_sync->finish();
  }
  // Everything the update needs is allocated before the ranks agree that the step succeeded: after
  // that, nothing can run out of memory on one rank only (Optimizer::step allocates nothing then).
  p_.optimizer->allocate_state();
  if (p_.shards) p_.shards->allocate_staging();  // the all-gather's buffer
  const bool slices = p_.shards && p_.grad_sync && p_.grad_sync->scatters();
  if (slices) p_.shards->take_slice_gradients(p_.grad_sync->slices());
  // Sharded gradients: this rank holds its slices' gradients only; their squares are summed over the
  // ranks once every rank got here (agree_on_slices).
  const auto& params = slices ? p_.optimizer->updated() : p_.optimizer->params();
  std::vector<torch::Tensor> tensors;
  for (const auto& s : params) tensors.push_back(s.param);
  p_.scaler->unscale_(tensors);
  if (slices) return clip_grad_norm(params, 0.0).square();
  torch::Tensor norm = clip_grad_norm(params, o_.grad_clip);
  if (p_.shards) p_.shards->take_parameter_gradients();  // the pieces of the (clipped) all-reduced gradients
  return norm;
}

void Step::agree_on_slices(torch::Tensor& norm) {
  std::vector<double> v{norm.item<double>(), 0.0};
  if (p_.scaler->is_enabled()) v[1] = p_.scaler->found_inf_tensor().item<double>();
  const auto sum = p_.dist->all_sum(v, "the gradient norm over the ranks' slices");
  const auto total = static_cast<float>(std::sqrt(sum[0]));  // float32, as clip_grad_norm's norm
  norm.fill_(total);
  if (p_.scaler->is_enabled()) p_.scaler->found_inf_tensor().fill_(sum[1] > 0 ? 1.0 : 0.0);
  // As clip_grad_norm: multiplied by min(1, max_norm / (norm + 1e-6)), each operation in float32 as its
  // tensor ops round, on the host (nothing allocated after the agreement).
  if (o_.grad_clip > 0 && std::isfinite(total)) {
    const float coef = static_cast<float>(o_.grad_clip) / (total + static_cast<float>(1e-6));
    if (coef >= 1.0f) return;
    torch::NoGradGuard no_grad;
    for (const auto& s : p_.optimizer->updated())
      if (s.param.grad().defined()) s.param.grad().mul_(static_cast<double>(coef));
  }
}

double Step::agree_on_oom(const std::exception_ptr& oom, size_t i, size_t count, const torch::Tensor& loss_sum) {
  // Before anyone enters the next collective, every rank learns whether any rank ran out of memory in
  // micro-batch i; then all of them abandon the step together. The last one also sums the loss.
  const int64_t world = p_.dist->world_size();
  const bool last = i + 1 == count;
  std::vector<double> v(world + 1, 0.0);
  v[p_.dist->rank()] = oom ? 1.0 : 0.0;
  if (last && !oom) v[world] = loss_sum.item<double>();
  auto a = p_.dist->all_sum(v, "the out-of-memory agreement");
  if (oom) std::rethrow_exception(oom);
  for (int64_t k = 0; k < world; ++k) {
    // run()'s recovery (drop_failed_attempt) drops the gradients, as for this rank's own OOM.
    if (a[k] > 0)
      throw PeerOutOfMemory("rank " + std::to_string(k) + " ran out of memory in micro-batch " + std::to_string(i + 1) +
                            " of " + std::to_string(count));
  }
  return a[world];
}

torch::Tensor Step::pack_step_values(const torch::Tensor& loss_sum, const torch::Tensor& norm) const {
  const c10::Device dev = loss_sum.defined() ? loss_sum.device() : norm.device();
  std::vector<torch::Tensor> parts;
  if (loss_sum.defined()) parts.push_back(loss_sum);
  parts.push_back(norm);
  if (p_.scaler->is_enabled()) {
    parts.push_back(p_.scaler->found_inf_tensor());
    parts.push_back(p_.scaler->scale_tensor());
  }
  for (auto& t : parts) t = t.reshape({1}).to(dev, torch::kFloat);
  return torch::cat(parts);
}

Step::HostValues Step::unpack_step_values(const torch::Tensor& host, bool with_loss) const {
  const float* v = host.data_ptr<float>();
  HostValues h;
  size_t i = 0;
  if (with_loss) h.loss = v[i++];
  h.grad_norm = v[i++];
  if (p_.scaler->is_enabled()) {
    h.found_inf = v[i++] != 0.0f;
    h.loss_scale = v[i++];
  }
  return h;
}

Step::HostValues Step::read_step_values(const torch::Tensor& loss_sum, const torch::Tensor& norm) const {
  // One fp32 vector on the device, one copy to the host.
  return unpack_step_values(pack_step_values(loss_sum, norm).cpu(), loss_sum.defined());
}

void Step::update_then_read(const torch::Tensor& loss_sum, const torch::Tensor& norm, double lr, StepResult& r) {
  queue_update(loss_sum, norm, lr, /*read_now=*/true);
  read_queued_values(r);
}

torch::Tensor Step::queue_update(const torch::Tensor& loss_sum, const torch::Tensor& norm, std::optional<double> lr,
                                 bool read_now) {
  // Everything that allocates comes before the update, so that an OOM up to here is retried as any other
  // (nothing has changed yet), and nothing after it can fail half way.
  const torch::Tensor values = pack_step_values(loss_sum, norm);
  // The update is skipped on the device where the host's `updated` will say so: a loss or a norm that is
  // not finite, or the scaler's inf/NaN.
  torch::Tensor skip = torch::isfinite(values.narrow(0, 0, 2)).all().logical_not();
  if (p_.scaler->is_enabled()) skip = skip.logical_or(values.narrow(0, 2, 1).squeeze().ne(0));
  skip = skip.to(torch::kFloat).reshape({1});
  // The copy of the values is queued before the update: the host waits for the backward and the norm,
  // while the device runs the update and the scale's update it queued after them.
  if (read_now) readback_.start(values);
  if (lr) p_.optimizer->step_unless(*lr, skip);
  else p_.optimizer->step_unless_device(skip);
  p_.scaler->update();
  // The gradients go while the device still runs the update (the allocator reuses their blocks only for
  // work queued after it): 161 frees for ResNet-50 that the next step's start no longer waits for.
  p_.optimizer->zero_grad();
  return values;
}

void Step::while_device_runs() {
  const std::function<void()>* f = std::exchange(while_device_runs_, nullptr);
  if (f && *f) (*f)();
}

void Step::read_queued_values(StepResult& r) {
  while_device_runs();
  const HostValues host = unpack_step_values(readback_.wait(), /*with_loss=*/true);
  r.loss = host.loss;
  r.grad_norm = host.grad_norm;
  r.loss_scale = host.loss_scale;
  r.updated = std::isfinite(r.loss) && std::isfinite(r.grad_norm) && !host.found_inf;
  if (r.updated) p_.optimizer->commit_step();
}

void Step::attempt(const data::Batch& batch, int64_t step, double lr, StepResult& r) {
  // Per-phase peaks for the memory report; the last phase is recorded (as failed) also when an OOM unwinds.
  PhasePeakRecorder phases(*p_.memory, *p_.reporter, step, controller_.micro_batch());
  p_.optimizer->zero_grad();
  const auto sizes = controller_.micro_batch_sizes();
  if (o_.mix.enabled())  // from (seed, step, rank) alone: a retried step draws the same again
    mix_ = draw_mix(o_.mix, batch.size(), batch.images.size(-2), batch.images.size(-1), o_.mix_seed, step,
                    p_.dist ? p_.dist->rank() : 0);
  apply_step_cudnn(sizes, step, r);
  Passes passes = run_micro_batches(batch, sizes, phases, r);
  if (p_.shards && p_.grad_sync->scatters()) agree_on_slices(passes.norm);
  // The one host sync per step: the metrics line wants the loss, the norm and the loss scale, and the
  // step is skipped on non-finite values. With the fused kernels (one process) the skip is decided on
  // the device and the values are read while the update runs; otherwise they are read first, in one
  // copy (PyTorch's GradScaler reads found_inf on its own, and the loss after it: two syncs).
  if (!p_.dist && o_.skip_on_device && p_.optimizer->skips_on_device())
    return update_then_read(passes.loss_sum, passes.norm, lr, r);
  while_device_runs();  // the device still runs the backward's tail and the norm
  const HostValues host = read_step_values(p_.dist ? torch::Tensor() : passes.loss_sum, passes.norm);
  r.loss = p_.dist ? passes.global_loss : host.loss;  // data parallel: summed over the ranks by agree_on_oom
  r.grad_norm = host.grad_norm;
  r.loss_scale = host.loss_scale;
  r.updated = std::isfinite(r.loss) && std::isfinite(r.grad_norm) && !host.found_inf;
  if (r.updated) p_.optimizer->step(lr);
  if (r.updated && p_.shards) p_.shards->gather();  // every rank's updated pieces into every rank's weights
  p_.scaler->update();
}

Step::Passes Step::run_micro_batches(const data::Batch& batch, const std::vector<int64_t>& sizes,
                                     PhasePeakRecorder& phases, StepResult& r) {
  // The targets of the whole optimizer step over all ranks (every rank holds an equal slice).
  const double normalizer = static_cast<double>(batch.labels.numel() * (p_.dist ? p_.dist->world_size() : 1));
  Passes out;
  torch::Tensor& loss_sum = out.loss_sum;
  loss_sum = torch::zeros({}, torch::dtype(torch::kFloat).device(o_.forward.device));
  int64_t offset = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const bool last = i + 1 == sizes.size();
    std::exception_ptr oom;  // this rank's out-of-memory error in this micro-batch (data parallel)
    try {
      // Gradients cross ranks once per step: the last backward sends them, bucket by bucket, as it goes.
      // Sharded gradients cross after every backward, into this rank's slices (the whole gradient is
      // never held: GradientSync's scatter mode), each micro-batch's added to the ones before.
      const bool scatter = p_.grad_sync && p_.grad_sync->scatters();
      if (p_.grad_sync && (last || scatter)) p_.grad_sync->arm(/*accumulate=*/i > 0);
      loss_sum += forward_backward(batch, offset, sizes[i], normalizer, phases);
      if (scatter && !last) p_.grad_sync->finish();
      if (last) out.norm = prepare_update(phases, r);
    } catch (const std::exception& e) {
      if (!is_oom_error(e)) throw;
      if (p_.grad_sync) p_.grad_sync->abandon();  // the same collectives as the ranks that did not fail
      if (!p_.dist) throw;
      oom = std::current_exception();
    }
    if (p_.dist) out.global_loss = agree_on_oom(oom, i, sizes.size(), loss_sum);
    offset += sizes[i];
  }
  return out;
}

void Step::drop_failed_attempt() {
  // Everything the failed attempt held: its graph and activations died with attempt()'s locals; the
  // partial gradients go now; what a failed backward left queued in the autograd engine; cached
  // autocast casts and the allocator's cached blocks after them.
  p_.optimizer->zero_grad();
  p_.scaler->abandon_step();
  release_autograd_leftovers();
  at::autocast::clear_cache();
  p_.memory->empty_cache();
}

void Step::release_autograd_leftovers() {
  // A backward that throws (out of memory in one branch of a ResNet block) leaves its graph's other
  // ready tasks in the autograd engine's ready queue of the thread that ran it: the caller's thread for a
  // graph on the CPU. Each task holds its node, and through the node's edges every node before it with
  // its saved activations, until the next backward on that thread pops them (a task whose graph is gone
  // goes first and is dropped). Until then the retry's forward ran beside the failed attempt's
  // activations and ran out of memory again (ResNet-50 on the CPU: 1.2 GiB still held after a failed
  // probe). The backward of one element on the device pops them now; the cap is lifted for its few
  // bytes, since what is still held may be over it.
  const int64_t cap = p_.memory->limit();
  p_.memory->set_limit(0);
  try {
    torch::Tensor one = torch::zeros({1}, torch::dtype(torch::kFloat).device(o_.forward.device).requires_grad(true));
    one.sum().backward();
  } catch (...) {
    p_.memory->set_limit(cap);
    throw;
  }
  p_.memory->set_limit(cap);
}

void Step::on_oom(const std::exception& e, bool peer, int64_t step, int64_t limit, StepResult& r) {
  ++r.oom_retries;
  const int64_t peak = p_.memory->peak_bytes();
  OomAction action = controller_.on_oom(limit);
  const int64_t cap = p_.memory->limit();
  spdlog::warn("{} in step {} (limit {}, peak {}): {}", peer ? error_message(e) : "out of memory", step,
               cap ? format_bytes(cap) : "none", format_bytes(peak), action.event.reason);
  if (p_.metrics) {
    nlohmann::json j = action.event.to_json();
    j["event"] = "oom";
    j["step"] = step;
    j["mem_peak_bytes"] = peak;
    j["current_bytes"] = p_.memory->current_bytes();
    j["error"] = error_message(e).substr(0, 300);
    if (p_.dist) j["rank"] = p_.dist->rank();
    if (peer) j["peer"] = true;
    p_.metrics->write(j);
  }
  controller_.take_events();  // the OOM event was just written with more detail
  if (action.kind == OomAction::Kind::kGiveUp) throw OomGaveUp(action.event.reason);
  apply_activation_checkpointing();
}

void Step::apply_step_cudnn(const std::vector<int64_t>& sizes, int64_t step, StepResult& r) {
  // Before anything runs at these sizes: whether cuDNN times the algorithms of a size it meets first.
  const CudnnDecision cudnn = apply_cudnn(CudnnAttempt::kStep, sizes, step);
  r.cudnn_benchmark = cudnn.benchmark;
  r.new_sizes.insert(r.new_sizes.end(), cudnn.new_sizes.begin(), cudnn.new_sizes.end());
  for (int64_t t : cudnn.tuned_sizes()) r.tuned_sizes.push_back(t);
  r.micro_batch = controller_.micro_batch();
  r.accum_steps = static_cast<int64_t>(sizes.size());
}

// ---- the step as a CUDA graph ------------------------------------------------------------------------

GraphKey Step::graph_key(const data::Batch& batch, int64_t limit) const {
  GraphKey k;
  k.sizes = controller_.micro_batch_sizes();
  k.checkpointing = controller_.checkpointing() || o_.activation_checkpointing == Checkpointing::kEveryK;
  k.input_shape = batch.images.sizes().vec();
  k.limit = limit;
  return k;
}

GraphAction Step::decide_graph(const GraphKey& key, int64_t step) {
  const GraphAction a = graph_policy_.decide(key);
  if (graph_.held() && !graph_policy_.holds_graph()) release_graph();
  write_graph_events(graph_policy_, p_.metrics, *p_.memory, step);
  return a;
}

bool Step::capture_step(const data::Batch& batch, int64_t step, double lr, StepResult& r) {
  RECORD_USER_SCOPE("trainer.graph_capture");
  const auto t = std::chrono::steady_clock::now();
  const auto sizes = controller_.micro_batch_sizes();
  apply_step_cudnn(sizes, step, r);
  // The graph's pool reserves memory of its own: what the eager steps left cached goes back first, so that
  // the capture meets the cap as the eager step did.
  p_.memory->empty_cache();
  p_.optimizer->set_device_scalars(lr);  // allocated outside the graph's pool; refreshed before each replay
  PhasePeakRecorder phases(*p_.memory, *p_.reporter, step, controller_.micro_batch());
  try {
    graph_.capture(batch, o_.forward.device, [&](const data::Batch& b) {
      p_.optimizer->zero_grad();
      const Passes passes = run_micro_batches(b, sizes, phases, r);
      return queue_update(passes.loss_sum, passes.norm, std::nullopt, /*read_now=*/false);
    });
  } catch (const std::exception& e) {
    if (is_oom_error(e)) throw;  // run()'s recovery releases what is left and takes the ladder's rung
    spdlog::warn("CUDA graph: capturing micro-batch {} failed, and the run goes on eagerly: {}",
                 controller_.micro_batch(), error_message(e));
    graph_policy_.on_capture_failed(error_message(e).substr(0, 300));
    write_graph_events(graph_policy_, p_.metrics, *p_.memory, step);
    drop_failed_attempt();
    snapshot_->restore();
    return false;
  }
  // Nothing ran during the capture, but every tensor it allocated stays in the pool: the allocator's peak
  // over the capture is the memory every replay of it uses.
  graph_policy_.on_captured(p_.memory->peak_bytes(), seconds_since(t));
  write_graph_events(graph_policy_, p_.metrics, *p_.memory, step);
  replay_step(batch, step, lr, r);
  r.graph = "capture";
  return true;
}

void Step::replay_step(const data::Batch& batch, int64_t step, double lr, StepResult& r) {
  RECORD_USER_SCOPE("trainer.graph_replay");
  apply_step_cudnn(controller_.micro_batch_sizes(), step, r);
  p_.optimizer->set_device_scalars(lr);
  readback_.start(graph_.replay(batch));
  read_queued_values(r);
  r.graph = "replay";
}

void Step::release_graph() {
  if (!graph_.held()) return;
  graph_.release();
  p_.memory->empty_cache();  // the pool's blocks back to the device
}

StepResult Step::run(const data::Batch& batch, int64_t step, double lr, int64_t limit,
                     const std::function<void()>& while_device_runs) {
  RECORD_USER_SCOPE("trainer.step");
  // Called at most once, in the attempt that completes or one that fails after its values were read (the
  // batch it fetched is the next step's whatever this one's retries do).
  while_device_runs_ = &while_device_runs;
  struct Forget {
    const std::function<void()>*& f;
    ~Forget() { f = nullptr; }
  } forget{while_device_runs_};
  // Samples that could not be decoded are in the batch as zero images with an ignored label (the dataset
  // logged each one); each is also a metrics event, once per step whatever the retries.
  for (const auto& f : batch.failures) {
    ++bad_samples_;
    if (p_.metrics)
      p_.metrics->event("bad_sample", {{"step", step}, {"index", f.index}, {"message", f.what}, {"total", bad_samples_}});
  }
  StepResult r;
  r.lr = lr;
  if (controller_.probe() == ProbeKind::kGrow) r.probe = "grow";
  if (controller_.probe() == ProbeKind::kCheckpointingOff) r.probe = "checkpointing_off";
  p_.memory->reset_peak();
  r.mem_start_bytes = p_.memory->current_bytes();
  // The snapshot allocates too (buffer copies, generator states): taking it is part of the attempt, so
  // a cap below the live bytes ends in the ladder's answer, not in an error outside it. It is kept from
  // step to step (train.snapshot: batched copies into the copies it holds). A replayed graph allocates
  // nothing and cannot run out of memory: it needs none.
  bool taken = false;
  std::optional<std::chrono::steady_clock::time_point> first_oom;  // the recovery runs from here
  while (true) {
    const GraphKey key = graph_key(batch, limit);
    const GraphAction action = decide_graph(key, step);
    try {
      if (action == GraphAction::kReplay) {
        replay_step(batch, step, lr, r);
        break;
      }
      if (!taken) {
        RECORD_USER_SCOPE("trainer.snapshot");
        if (snapshot_) snapshot_->retake(*p_.model);
        else snapshot_.emplace(*p_.model, o_.forward.device, o_.batched_snapshot);
        taken = true;
      }
      if (action == GraphAction::kCapture && capture_step(batch, step, lr, r)) break;
      attempt(batch, step, lr, r);
      graph_policy_.on_clean_step(key);
      break;
    } catch (const std::exception& e) {
      const bool peer = dynamic_cast<const PeerOutOfMemory*>(&e) != nullptr;
      if (!peer && !is_oom_error(e)) throw;
      if (!first_oom) first_oom = std::chrono::steady_clock::now();
      recover(e, peer, step, limit, taken, r);
    }
  }
  if (first_oom) r.recovery_s = seconds_since(*first_oom);
  cudnn_.on_clean_step(controller_.micro_batch_sizes());
  // A replay allocates nothing: its peak is the capture's, which its pool holds.
  r.mem_peak_bytes = p_.memory->peak_bytes();
  if (r.graph == "replay") r.mem_peak_bytes = std::max(r.mem_peak_bytes, graph_policy_.held_peak_bytes());
  // Grow back: after enough clean steps with headroom, or when the limit rose, the controller tries a
  // larger micro-batch (or checkpointing off) on the next step. A failed probe costs one retried step.
  // Every rank's controller decides alike from the same inputs: the highest peak of all ranks against
  // the lowest limit, so a probe starts, succeeds or fails on all ranks together.
  int64_t peak = r.mem_peak_bytes;
  if (p_.dist) peak = static_cast<int64_t>(p_.dist->all_max({static_cast<double>(peak)}, "the peak memory agreement")[0]);
  controller_.maybe_grow(limit, peak);
  write_ladder_events(controller_, p_.metrics, *p_.memory, step - 1);  // as of the steps completed before this one, like the run's own events
  apply_activation_checkpointing();
  return r;
}

void Step::recover(const std::exception& e, bool peer, int64_t step, int64_t limit, bool taken, StepResult& r) {
  if (!peer) {
    // The report shows the memory as the failed attempt left it, before anything is dropped.
    MemoryReport rep = p_.reporter->write(step, *p_.memory, "oom", error_message(e));
    spdlog::warn("{}\n{}", rep.path.empty() ? rep.write_error : "memory report: " + rep.path, rep.text);
  }
  // A graph (captured, or half captured when the capture ran out of memory) goes with its pool: the next
  // capture happens at the rung the ladder takes, under the cap as it is now.
  graph_policy_.on_oom();
  write_graph_events(graph_policy_, p_.metrics, *p_.memory, step);
  release_graph();
  drop_failed_attempt();
  if (taken) snapshot_->restore();  // without one, nothing has run yet
  else snapshot_.reset();             // a take that ran out of memory: taken anew next time
  // An attempt that timed a new size may have run out of memory in the timing's own workspaces: the
  // same sizes once more with the heuristics before the ladder moves (never in data parallel).
  if (cudnn_.on_oom()) {
    ++r.oom_retries;
    spdlog::warn("out of memory in step {} while cuDNN timed micro-batch {}: again at the same size with its "
                 "heuristics", step, controller_.micro_batch());
    if (p_.metrics)  // an OOM all the same (the telemetry counts it), answered without the ladder
      p_.metrics->write({{"event", "oom"}, {"kind", "timing_rerun"}, {"step", step},
                         {"old_micro_batch", controller_.micro_batch()}, {"new_micro_batch", controller_.micro_batch()},
                         {"mem_peak_bytes", p_.memory->peak_bytes()}, {"current_bytes", p_.memory->current_bytes()},
                         {"error", error_message(e).substr(0, 300)}});
  } else {
    on_oom(e, peer, step, limit, r);
  }
  p_.memory->reset_peak();
}

void Step::on_limit_changed(int64_t limit, int64_t step) {
  controller_.on_limit_changed(limit);
  write_ladder_events(controller_, p_.metrics, *p_.memory, step);
}

CudnnDecision Step::apply_cudnn(CudnnAttempt attempt, const std::vector<int64_t>& sizes, int64_t step) {
  CudnnDecision d = cudnn_.decide(attempt, sizes);
  set_cudnn_benchmark(d.benchmark);
  write_cudnn_decisions(cudnn_, p_.metrics, o_.forward.device.is_cuda(), step);
  return d;
}

void Step::apply_activation_checkpointing() {
  const int64_t n = p_.model->num_blocks();
  std::vector<bool> mask(n, false);
  for (int64_t i = 0; i < n; ++i) {
    if (controller_.checkpointing()) mask[i] = true;
    else if (o_.activation_checkpointing == Checkpointing::kEveryK) mask[i] = i % o_.checkpoint_every_k == 0;
  }
  p_.model->set_checkpointed_blocks(mask);
}

}  // namespace trainer
