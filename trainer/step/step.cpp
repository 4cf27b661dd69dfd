// The optimizer step: forward/backward over micro-batches, the update, and recovery from running out of
// memory in any part of it.
#include "trainer/step/step.h"

#include <spdlog/spdlog.h>

#include "common/clock.h"
#include "common/compat.h"
#include "trainer/memory/auto_search.h"

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <set>
#include <utility>

namespace trainer {

torch::Tensor erase_boxes(torch::Tensor x, const torch::Tensor& boxes) {
  const int64_t H = x.size(2), W = x.size(3);
  const auto opts = torch::TensorOptions().dtype(torch::kInt64).device(x.device());
  const auto ys = torch::arange(H, opts).view({1, H, 1}), xs = torch::arange(W, opts).view({1, 1, W});
  auto col = [&](int64_t k) { return boxes.select(1, k).view({-1, 1, 1}); };  // (B, 1, 1)
  const auto inside = (ys >= col(0)) & (ys < col(0) + col(2)) & (xs >= col(1)) & (xs < col(1) + col(3));  // (B, H, W)
  return x.masked_fill_(inside.unsqueeze(1), 0.0);
}

// ---- the snapshot ------------------------------------------------------------------------------------

StepSnapshot::StepSnapshot(torch::nn::Module& model, const c10::Device& device, bool batched)
    : device_(device), batched_(batched), generators_(GeneratorStates::capture(device)) {
  take(model);
}

void StepSnapshot::take(torch::nn::Module& model) {
  torch::NoGradGuard ng;
  groups_.clear();
  order_.clear();
  if (!batched_) {
    for (auto& b : model.buffers()) groups_.push_back({{b}, {b.clone()}});
    return;
  }
  // Per (device, dtype) (the multi-tensor copy takes one of each): the buffers and their copies.
  std::vector<std::pair<c10::Device, at::ScalarType>> keys;
  for (auto& b : model.buffers()) {
    const std::pair<c10::Device, at::ScalarType> key{b.device(), b.scalar_type()};
    const auto it = std::find(keys.begin(), keys.end(), key);
    const size_t g = static_cast<size_t>(it - keys.begin());
    if (it == keys.end()) {
      keys.push_back(key);
      groups_.emplace_back();
    }
    groups_[g].live.push_back(b);
    groups_[g].saved.push_back(torch::empty_like(b, at::MemoryFormat::Preserve));
    order_.push_back(b.unsafeGetTensorImpl());
  }
  for (auto& group : groups_) compat::foreach_copy_(group.saved, group.live);
}

void StepSnapshot::retake(torch::nn::Module& model) {
  generators_ = GeneratorStates::capture(device_);
  if (!batched_) return take(model);
  // The same buffers as at the last take (the same tensors in the same order, each of the shape, type and
  // device of its copy): one copy per group into the copies already held. Anything else: taken anew.
  const auto buffers = model.buffers();
  bool same = buffers.size() == order_.size();
  for (size_t i = 0; same && i < buffers.size(); ++i) same = buffers[i].unsafeGetTensorImpl() == order_[i];
  for (const auto& group : groups_)
    for (size_t k = 0; same && k < group.live.size(); ++k)
      same = group.saved[k].sizes() == group.live[k].sizes() && group.saved[k].dtype() == group.live[k].dtype() &&
             group.saved[k].device() == group.live[k].device();
  if (!same) return take(model);
  torch::NoGradGuard ng;
  for (auto& group : groups_) compat::foreach_copy_(group.saved, group.live);
}

void StepSnapshot::restore() const {
  {
    torch::NoGradGuard ng;
    for (const auto& group : groups_) compat::foreach_copy_(group.live, group.saved);
  }
  generators_.restore();
}

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
  g.mode = graph_mode_from(o.cuda_graph);
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
}

torch::Tensor Step::micro_batch_input(const data::Batch& batch, int64_t offset, int64_t n) {
  auto images = batch.images.narrow(0, offset, n);
  if (!batch.erase.defined()) return model_input(images, o_.forward);
  // Random erasing follows normalization (torchvision's order): the uint8 images are converted here,
  // erased, and reach the model as float.
  const auto& dev = o_.forward.device;
  auto x = erase_boxes(images_to_float(images.to(dev, /*non_blocking=*/true), o_.forward),
                       batch.erase.narrow(0, offset, n).to(dev, /*non_blocking=*/true));
  return model_input(x, o_.forward);
}

Logits Step::micro_batch_logits(const data::Batch& batch, int64_t offset, int64_t n) {
  auto labels = batch.labels.narrow(0, offset, n);
  if (!mix_.any() && !batch.erase.defined())
    return forward_logits(*p_.model, batch.images.narrow(0, offset, n), labels, o_.forward);
  if (!mix_.any())
    return logits_of(*p_.model, micro_batch_input(batch, offset, n), labels.to(o_.forward.device, /*non_blocking=*/true),
                     o_.forward);
  // Rows [offset, offset + n) are mixed with their partners B - 1 - k: the mirrored slice, reversed. Each
  // side is erased first (timm erases in its loader, before Mixup).
  const int64_t mirror = batch.size() - offset - n;
  auto partner = micro_batch_input(batch, mirror, n).flip(0);
  auto partner_labels = batch.labels.narrow(0, mirror, n).to(o_.forward.device, /*non_blocking=*/true).flip(0);
  auto x = mix_images(micro_batch_input(batch, offset, n), partner, mix_, offset);
  if (o_.forward.channels_last && x.dim() == 4) x = x.contiguous(at::MemoryFormat::ChannelsLast);
  Logits out = logits_of(*p_.model, x, labels.to(o_.forward.device, /*non_blocking=*/true), o_.forward);
  const int64_t classes = out.columns < 0 ? out.logits.size(1) : out.columns;
  out.targets = mix_targets(out.targets, partner_labels, mix_, offset, classes, o_.loss.label_smoothing);
  return out;
}

torch::Tensor Step::forward_backward(const data::Batch& batch, int64_t offset, int64_t n, double normalizer,
                                     PhasePeakRecorder& phases) {
  phases.enter("forward");
  Logits out = micro_batch_logits(batch, offset, n);
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
  const auto& params = p_.optimizer->params();
  std::vector<torch::Tensor> tensors;
  for (const auto& s : params) tensors.push_back(s.param);
  p_.scaler->unscale_(tensors);
  return clip_grad_norm(params, o_.grad_clip);
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

void HostReadback::start(const torch::Tensor& values) {
  queued_ = false;
  if (!values.is_cuda()) {
    pending_ = values.cpu();
    return;
  }
  const int64_t n = values.numel();
  if (!host_.defined() || host_.numel() < n)
    host_ = torch::empty({n}, torch::TensorOptions().dtype(torch::kFloat).pinned_memory(true));
  pending_ = host_.narrow(0, 0, n);
  pending_.copy_(values, /*non_blocking=*/true);
  const c10::impl::VirtualGuardImpl guard(values.device().type());
  if (!copied_) copied_.emplace(values.device().type());  // one event, recorded again at every start
  copied_->record(guard.getStream(values.device()));
  queued_ = true;
}

torch::Tensor HostReadback::wait() {
  if (queued_) compat::wait_for(*copied_);
  queued_ = false;
  return pending_;
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
  const Passes passes = run_micro_batches(batch, sizes, phases, r);
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
      if (last && p_.grad_sync) p_.grad_sync->arm();
      loss_sum += forward_backward(batch, offset, sizes[i], normalizer, phases);
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
  k.checkpointing = controller_.checkpointing() || o_.activation_checkpointing == "every_k";
  k.input_shape = batch.images.sizes().vec();
  k.limit = limit;
  return k;
}

GraphAction Step::decide_graph(const GraphKey& key, int64_t step) {
  const GraphAction a = graph_policy_.decide(key);
  if (graph_.held() && !graph_policy_.holds_graph()) release_graph();
  log_graph_events(step);
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
    log_graph_events(step);
    drop_failed_attempt();
    snapshot_->restore();
    return false;
  }
  // Nothing ran during the capture, but every tensor it allocated stays in the pool: the allocator's peak
  // over the capture is the memory every replay of it uses.
  graph_policy_.on_captured(p_.memory->peak_bytes(), seconds_since(t));
  log_graph_events(step);
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

void Step::log_graph_events(int64_t step) {
  for (const auto& e : graph_policy_.take_events()) {
    if (e.kind == "disabled") spdlog::warn("CUDA graph: {}", e.reason);
    else spdlog::info("CUDA graph: {}", e.reason);
    if (!p_.metrics) continue;
    nlohmann::json j = e.to_json();
    j["step"] = step;
    j["current_bytes"] = p_.memory->current_bytes();
    p_.metrics->write(j);
  }
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
  log_controller_events(step - 1);  // as of the steps completed before this one, like the run's own events
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
  log_graph_events(step);
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

// ---- the micro-batch search ------------------------------------------------------------------------

// A probe is the step's worst micro-batch: the first one's forward and backward, then, when the step
// accumulates (mb below the batch), the second one's with the first one's gradients alive. One pass alone
// misses those gradients, and picked sizes whose real step then ran out of memory. Its peak is what the
// curve search fits. Nothing trains: the gradients are zeroed after, and find_micro_batch puts the
// snapshot back.
//
// One line per probe: on a CPU a probe of a large micro-batch takes minutes, and the search must not be
// silent for that long. A stop is honoured before a probe and at every block boundary inside one (forward
// and backward), so a SIGTERM waits for one block, not for a probe that takes minutes on a CPU.
//
// Timing (memory.auto_search: auto, trainer/memory/auto_search.h): a probe's second pass at the size of
// its first runs warm (the first paid the size's one-off costs: cuDNN's choice of algorithms, the
// allocator's growth), so it is timed, synchronized with the device, and kept as the size's warm seconds.
// Where a probe has no such pass, time_at runs a warm-up pass and a timed one.
class Step::Probe {
 public:
  Probe(Step& step, const data::Batch& batch, const SearchControl& control, MicroBatchSearch& found)
      : s_(step),
        batch_(batch),
        control_(control),
        found_(found),
        blocks_(step.p_.model->num_blocks()),
        timer_(PassTimer::steady(device_sync(step.o_.forward.device))) {}

  /// What the searches call: the outcome at `mb`, found before the restart or measured now; a size asked
  /// again (auto's first two probes, taken up by the search it chose) answers from this search's own.
  ProbeOutcome operator()(int64_t mb, ProbeRole role) {
    if (const auto s = seen_.find(mb); s != seen_.end()) return s->second;
    if (const auto k = control_.known.find(mb); k != control_.known.end()) return seen_[mb] = reuse(mb, role, k->second);
    const auto t = std::chrono::steady_clock::now();
    const CudnnAttempt kind = role == ProbeRole::kConfirm ? CudnnAttempt::kConfirmProbe : CudnnAttempt::kCalibrationProbe;
    ProbeOutcome o = measure(mb, kind);
    // A probe that timed a new size and ran out of memory may have failed in the timing's workspaces.
    if (!o.fits && s_.cudnn_.on_oom()) o = measure(mb, kind);
    if (control_.on_probe) control_.on_probe(mb, o);
    log_measured(mb, role, o, seconds_since(t));
    return seen_[mb] = o;
  }

  /// memory.auto_search: auto: the floor and the curve's second point, timed; then doubling or the curve
  /// (choose_search), which takes up those two probes. The largest size that fitted (0: not the floor).
  int64_t search_auto(int64_t floor, int64_t size, int64_t limit) {
    const ProbeOutcome f = (*this)(floor, ProbeRole::kCalibrate);
    if (!f.fits || floor == size) {
      found_.ended = f.fits ? "whole" : "floor";
      found_.method = "curve";
      found_.choice = {{"method", "curve"}, {"reason", "the first probe decided it: " + found_.ended}};
      return f.fits ? floor : 0;
    }
    const int64_t second = std::min(size, std::max(floor + 1, kCurveSecondPoint * floor));
    const ProbeOutcome s = (*this)(second, ProbeRole::kCalibrate);
    const SearchChoice c = choose(floor, f, second, s, size, limit);
    found_.method = c.method;
    found_.choice = c.to_json();
    cost_ = c.timed ? std::optional<PassCost>(c.cost) : std::nullopt;
    spdlog::info("micro_batch auto: {}", c.reason);
    if (c.method == "curve") {
      const CurveSearch cs = find_max_micro_batch_by_curve(std::ref(*this), floor, size, limit);
      found_.ended = cs.ended;
      return cs.micro_batch;
    }
    auto fits = [&](int64_t m) { return (*this)(m, ProbeRole::kCalibrate).fits; };
    return s.fits ? find_max_micro_batch(fits, second, size) : find_max_micro_batch(fits, floor, second - 1);
  }

  /// The speed choice on the agreed largest size `largest`: it and its halvings timed within
  /// kSpeedBudgetS of projected pass time, each rank's figures agreed (the slowest rank's per size: a
  /// data-parallel step runs at its slowest rank's pace), then choose_fastest. Every rank calls it.
  SpeedChoice choose_speed(int64_t largest, int64_t floor) {
    const std::vector<int64_t> candidates = speed_candidates(largest, floor);
    const std::vector<int64_t> sizes = cost_ ? speed_sizes_within(*cost_, candidates, ran_) : std::vector<int64_t>{};
    std::vector<double> failed(candidates.size(), 0.0), rate(candidates.size(), 0.0);
    for (size_t i = 0; i < sizes.size(); ++i) {
      const double secs = time_at(sizes[i], /*speed=*/true);
      if (secs < 0) failed[i] = 1;
      else if (secs > 0) rate[i] = static_cast<double>(sizes[i]) / secs;
    }
    if (s_.p_.dist) {
      std::vector<double> v = failed;
      for (double r : rate) v.push_back(-r);
      const auto a = s_.p_.dist->all_max(v, "the speed table agreement");
      for (size_t i = 0; i < candidates.size(); ++i) failed[i] = a[i], rate[i] = -a[candidates.size() + i];
    }
    std::vector<SpeedPoint> table;
    for (size_t i = 0; i < candidates.size(); ++i)
      if (failed[i] > 0 || rate[i] > 0) table.push_back({candidates[i], failed[i] == 0, rate[i]});
    SpeedChoice c = choose_fastest(table, largest);
    if (table.size() < candidates.size())
      c.reason += " (" + std::to_string(candidates.size() - table.size()) + " of " + std::to_string(candidates.size()) +
                  " candidates not timed: " + (cost_ ? "over the " + std::to_string(static_cast<int>(kSpeedBudgetS)) +
                                                           " s budget of timed passes"
                                                     : std::string("the first probes carry no timing")) + ")";
    return c;
  }

 private:
  /// On CUDA the device's synchronization, so that a timed pass is the kernels' time, not their queueing.
  static std::function<void()> device_sync(const c10::Device& device) {
    if (!device.is_cuda()) return {};
    return [index = device.index()] { torch::cuda::synchronize(index); };
  }

  /// choose_search from the first two probes: their warm seconds give the cost line, their peaks the
  /// predicted largest size; untimed (the curve) when they were read back after a restart.
  SearchChoice choose(int64_t floor, const ProbeOutcome& f, int64_t second, const ProbeOutcome& s, int64_t size,
                      int64_t limit) {
    if (control_.known.count(floor) || (s.fits && control_.known.count(second))) return untimed_search_choice();
    const double tf = time_at(floor);
    const double ts = s.fits ? time_at(second) : -1;
    if (tf <= 0) return untimed_search_choice();
    // Without a second warm pass (it did not fit): all of the floor's time per sample, an upper bound.
    const PassCost cost =
        ts > 0 ? PassCost::through(floor, tf, second, ts) : PassCost{0, tf / static_cast<double>(floor)};
    int64_t predicted = size;
    if (s.fits && limit > 0)
      predicted = predict_max_micro_batch(
          fit_memory_curve({{floor, f.peak_bytes}, {second, s.peak_bytes}}), limit, size);
    return choose_search(cost, floor, second, s.fits, size, predicted, batch_.size());
  }

  /// A warm pass's seconds at `mb`: for the search's choice a probe's second pass if it had one, else a
  /// timed pass; for the speed table (`speed`) the fastest of repeated timed passes (PassTimer::fastest).
  /// First a warm-up pass where the size never ran in this search. -1 when a pass ran out of memory.
  double time_at(int64_t mb, bool speed = false) {
    if (const auto w = warm_s_.find(mb); !speed && w != warm_s_.end()) return w->second;
    try {
      if (!ran_.count(mb)) {  // a size no probe ran: its first pass takes the one-off costs
        s_.apply_cudnn(CudnnAttempt::kCalibrationProbe, {mb}, 0);
        one_pass(0, mb);
        ran_.insert(mb);
      }
      if (speed) return timer_.fastest([&] { one_pass(0, mb); });
      return warm_s_[mb] = timer_.time([&] { one_pass(0, mb); });
    } catch (const std::exception& e) {
      if (!is_oom_error(e)) throw;
      s_.drop_failed_attempt();
      return -1;
    }
  }

  /// Found by an earlier process under the same conditions (the run's auto_search.json).
  ProbeOutcome reuse(int64_t mb, ProbeRole role, const ProbeOutcome& o) {
    ++found_.probes;
    ++found_.reused;
    spdlog::info("micro_batch auto: probe {}: micro-batch {} {}{} (found before the restart)", found_.probes, mb,
                 o.fits ? "fits" : "does not fit", o.fits ? " at " + format_bytes(o.peak_bytes) : "");
    found_.trace.push_back({{"micro_batch", mb}, {"role", to_string(role)}, {"fits", o.fits},
                            {"peak_bytes", o.peak_bytes}, {"reused", true}});
    return o;
  }

  /// One run of the probe at `mb`: its passes under the cuDNN policy's flag, and its peak; an OOM is a
  /// probe that does not fit.
  ProbeOutcome measure(int64_t mb, CudnnAttempt kind) {
    ++found_.probes;
    stop_if_asked("before probe " + std::to_string(found_.probes) + " (micro-batch " + std::to_string(mb) + ")");
    const std::vector<int64_t> sizes = probe_pass_sizes(mb, batch_.size());
    const CudnnDecision d = s_.apply_cudnn(kind, sizes, 0);
    for (int64_t t : d.tuned_sizes()) found_.tuned_sizes.push_back(t);
    s_.p_.memory->reset_peak();
    if (control_.stop) watch_blocks(mb);
    struct Unwatch {  // the check lives as long as the probe, whatever way it ends
      models::ModelImpl& m;
      ~Unwatch() { m.set_block_check(nullptr); }
    } unwatch{*s_.p_.model};
    ProbeOutcome o;
    try {
      const double warm = run_passes(sizes);
      o.peak_bytes = s_.p_.memory->peak_bytes();
      s_.p_.optimizer->zero_grad();
      o.fits = true;
      ran_.insert(mb);
      if (warm > 0) warm_s_[mb] = warm;
    } catch (const SearchStopped&) {
      s_.drop_failed_attempt();
      throw;
    } catch (const std::exception& e) {
      if (!is_oom_error(e)) throw;
      s_.drop_failed_attempt();
    }
    return o;
  }

  /// Forward and backward of each micro-batch in turn, the gradients accumulating. The seconds of the
  /// second pass when it has the first one's size (warm), else 0.
  double run_passes(const std::vector<int64_t>& sizes) {
    double warm = 0;
    for (int64_t at = 0, i = 0; i < static_cast<int64_t>(sizes.size()); at += sizes[i], ++i) {
      if (i == 1 && sizes[1] == sizes[0]) warm = timer_.time([&] { one_pass(at, sizes[i]); });
      else one_pass(at, sizes[i]);
    }
    return warm;
  }

  /// One forward and backward of samples [at, at + n).
  void one_pass(int64_t at, int64_t n) {
    Logits out = forward_logits(*s_.p_.model, batch_.images.narrow(0, at, n), batch_.labels.narrow(0, at, n),
                                s_.o_.forward);
    summed_loss(out.logits, out.targets, s_.o_.loss, out.columns).backward();
  }

  void stop_if_asked(const std::string& where) const {
    if (control_.stop && control_.stop()) throw SearchStopped(where);
  }

  /// The stop check at every block boundary of this probe's passes.
  void watch_blocks(int64_t mb) {
    s_.p_.model->set_block_check([this, mb, n = found_.probes](int64_t i, bool backward) {
      stop_if_asked(std::string(backward ? "in backward" : "in forward") + " at block " + std::to_string(i + 1) +
                    " of " + std::to_string(blocks_) + " of probe " + std::to_string(n) + " (micro-batch " +
                    std::to_string(mb) + ")");
    });
  }

  /// The probe's line, and what it left behind in the trace (its own tensors are gone: this is what the
  /// next probe starts from).
  void log_measured(int64_t mb, ProbeRole role, const ProbeOutcome& o, double secs) {
    spdlog::info("micro_batch auto: probe {}: micro-batch {} {}{} ({:.1f} s)", found_.probes, mb,
                 o.fits ? "fits" : "does not fit", o.fits ? " at " + format_bytes(o.peak_bytes) : "", secs);
    nlohmann::json t = {{"micro_batch", mb}, {"role", to_string(role)}, {"fits", o.fits},
                        {"peak_bytes", o.peak_bytes}, {"held_after_bytes", s_.p_.memory->current_bytes()},
                        {"s", secs}};
    if (const auto w = warm_s_.find(mb); w != warm_s_.end()) t["warm_s"] = w->second;
    found_.trace.push_back(std::move(t));
  }

  Step& s_;
  const data::Batch& batch_;
  const SearchControl& control_;
  MicroBatchSearch& found_;
  const int64_t blocks_;
  const PassTimer timer_;
  std::map<int64_t, ProbeOutcome> seen_;  // this search's outcomes by size
  std::map<int64_t, double> warm_s_;      // a warm pass's seconds by size
  std::set<int64_t> ran_;                 // sizes whose passes ran in this search (warm for the next)
  std::optional<PassCost> cost_;          // auto: the line through the first two probes' warm passes
};

MicroBatchSearch Step::find_micro_batch(const data::Batch& batch, int64_t min_micro_batch, int64_t limit,
                                        int64_t start, const SearchControl& control) {
  // Measured on real samples with the optimizer state already allocated, so the job starts fast rather
  // than OOM-ing its way down.
  p_.optimizer->zero_grad();
  MicroBatchSearch found;
  Probe probe(*this, batch, control, found);
  const int64_t size = batch.size();
  const int64_t floor = std::min(min_micro_batch, size);
  found.start = start > 0 ? std::clamp(start, floor, size) : 0;
  found.method = found.start > 0 ? "start" : o_.auto_search;
  if (found.method == "auto") found.method_from = "auto";
  std::optional<StepSnapshot> snapshot;
  int64_t mb = search_micro_batch(probe, floor, size, limit, snapshot, found);
  mb = agree_on_micro_batch(mb, found);
  // The speed choice, on every rank alike: the agreed size and the configured search are the same on all.
  std::optional<SpeedChoice> speed;
  if (found.method_from == "auto" && !found.stopped && mb >= floor) speed = probe.choose_speed(mb, floor);
  if (snapshot) snapshot->restore();  // the probes must not count as training
  if (found.stopped) return found;
  if (mb < 0)
    throw OomGaveUp("micro_batch auto: the model and its optimizer state do not fit in memory (limit " +
                    (limit > 0 ? format_bytes(limit) : std::string("none")) +
                    "); raise memory.limit or use a smaller model");
  // Nothing fits even at the floor: start there, and let the caller or the ladder's next rung
  // (recomputation) try.
  found.floor_fits = mb >= floor;
  found.largest = std::max(mb, floor);
  found.micro_batch = speed ? speed->micro_batch : found.largest;
  if (speed) found.speed = speed->to_json();
  return found;
}

int64_t Step::search_micro_batch(Probe& probe, int64_t floor, int64_t size, int64_t limit,
                                 std::optional<StepSnapshot>& snapshot, MicroBatchSearch& found) {
  int64_t mb = -1;  // -1: the optimizer state or the snapshot did not fit
  try {
    p_.optimizer->allocate_state();
    snapshot.emplace(*p_.model, o_.forward.device);
    if (found.method == "auto") {
      mb = probe.search_auto(floor, size, limit);
    } else if (found.method == "curve") {
      const CurveSearch cs = find_max_micro_batch_by_curve(std::ref(probe), floor, size, limit);
      found.ended = cs.ended;
      mb = cs.micro_batch;  // 0: not even the floor fits
    } else {
      // The prediction of a memory curve file is the confirm probe: where the run will likely start.
      auto fits = [&](int64_t m) {
        return probe(m, m == found.start ? ProbeRole::kConfirm : ProbeRole::kCalibrate).fits;
      };
      mb = find_max_micro_batch(fits, floor, size, found.start);
    }
  } catch (const SearchStopped& e) {
    found.stopped = true;
    found.stopped_at = e.what();
  } catch (const std::exception& e) {
    if (!is_oom_error(e)) throw;
    drop_failed_attempt();
  }
  return mb;
}

int64_t Step::agree_on_micro_batch(int64_t mb, MicroBatchSearch& found) {
  // The smallest over ranks: the micro-batch count per step (and so the collectives) must be equal. A
  // rank that was stopped still comes here, so that every rank learns of it and none waits for it.
  if (!p_.dist) return mb;
  const auto a = p_.dist->all_max({-static_cast<double>(mb), found.stopped ? 1.0 : 0.0}, "the micro-batch agreement");
  if (a[1] > 0 && !found.stopped) {
    found.stopped = true;
    found.stopped_at = "on another rank";
  }
  return static_cast<int64_t>(-a[0]);
}

Pretune Step::pretune(const data::Batch& batch, int64_t step) {
  Pretune out;
  const auto sizes = cudnn_.pretune_sizes(controller_.global_batch(), controller_.micro_batch(),
                                          controller_.min_micro_batch());
  if (sizes.empty()) return out;
  const auto t = std::chrono::steady_clock::now();
  p_.optimizer->zero_grad();
  std::optional<StepSnapshot> snapshot;
  try {
    snapshot.emplace(*p_.model, o_.forward.device, o_.batched_snapshot);
  } catch (const std::exception& e) {
    if (!is_oom_error(e)) throw;
    drop_failed_attempt();
    out.skipped = sizes;
  }
  for (int64_t s : snapshot ? sizes : std::vector<int64_t>{}) {
    if (s > batch.size()) continue;
    apply_cudnn(CudnnAttempt::kPretune, {s}, step);
    try {
      Logits o = forward_logits(*p_.model, batch.images.narrow(0, 0, s), batch.labels.narrow(0, 0, s), o_.forward);
      summed_loss(o.logits, o.targets, o_.loss, o.columns).backward();
      p_.optimizer->zero_grad();
      out.tuned.push_back(s);
    } catch (const std::exception& e) {
      if (!is_oom_error(e)) throw;
      drop_failed_attempt();
      out.skipped.push_back(s);
    }
  }
  if (snapshot) snapshot->restore();  // nothing trained
  set_cudnn_benchmark(false);
  out.seconds = seconds_since(t);
  spdlog::info("cuDNN pretune: timed micro-batch {} in {:.1f} s{}", nlohmann::json(out.tuned).dump(), out.seconds,
               out.skipped.empty() ? "" : "; out of memory at " + nlohmann::json(out.skipped).dump());
  if (p_.metrics)
    p_.metrics->event("cudnn_pretune", {{"step", step}, {"tuned", out.tuned}, {"skipped", out.skipped},
                                        {"seconds", out.seconds}});
  return out;
}

void Step::on_limit_changed(int64_t limit, int64_t step) {
  controller_.on_limit_changed(limit);
  log_controller_events(step);
}

void Step::log_controller_events(int64_t step) {
  for (const auto& e : controller_.take_events()) {
    spdlog::info("memory: {}", e.reason);
    if (!p_.metrics) continue;
    nlohmann::json j = e.to_json();
    j["event"] = to_string(e.kind);
    j["step"] = step;
    j["current_bytes"] = p_.memory->current_bytes();
    p_.metrics->write(j);
  }
}

CudnnDecision Step::apply_cudnn(CudnnAttempt attempt, const std::vector<int64_t>& sizes, int64_t step) {
  CudnnDecision d = cudnn_.decide(attempt, sizes);
  set_cudnn_benchmark(d.benchmark);
  log_cudnn_decisions(step);
  return d;
}

void Step::log_cudnn_decisions(int64_t step) {
  // Off a CUDA device nothing reads cuDNN's flag: the decisions are still recorded (metrics.jsonl), but a
  // line saying "timing it" would tell a CPU user of a wait that does not happen.
  const bool cuda = o_.forward.device.is_cuda();
  for (const auto& d : cudnn_.take_decisions()) {
    if (cuda && (d.retry || d.benchmark)) spdlog::info("cuDNN: {}", d.reason);
    else spdlog::debug("cuDNN: {}", d.reason);
    if (!p_.metrics) continue;
    nlohmann::json j = d.to_json();
    j["step"] = step;
    p_.metrics->write(j);
  }
}

void Step::apply_activation_checkpointing() {
  const int64_t n = p_.model->num_blocks();
  std::vector<bool> mask(n, false);
  for (int64_t i = 0; i < n; ++i) {
    if (controller_.checkpointing()) mask[i] = true;
    else if (o_.activation_checkpointing == "every_k") mask[i] = i % o_.checkpoint_every_k == 0;
  }
  p_.model->set_checkpointed_blocks(mask);
}

}  // namespace trainer
