// The optimizer step: forward/backward over micro-batches, the update, and recovery from running out of
// memory in any part of it.
#include <spdlog/spdlog.h>

#include "trainer/run.h"

#include <ATen/autocast_mode.h>

namespace trainer {

namespace F = torch::nn::functional;

torch::Tensor TrainingRun::micro_batch_loss(const torch::Tensor& images, const torch::Tensor& labels, double normalizer) {
  auto x = images.to(device_, /*non_blocking=*/true);
  if (cfg_.model.channels_last && x.dim() == 4) x = x.contiguous(at::MemoryFormat::ChannelsLast);
  auto y = labels.to(device_, /*non_blocking=*/true).reshape({-1});  // (B) classes or (B*T) next tokens
  torch::Tensor logits;
  {
    AutocastGuard autocast(device_.type(), amp_dtype_, cfg_.amp.enabled);
    logits = model_->forward(x);
  }
  // Summed, then divided by the targets (samples, or tokens) of the whole optimizer step: micro-batches
  // of any sizes add up to the mean over the global batch (no "mean of means").
  auto loss = F::cross_entropy(logits.to(torch::kFloat).reshape({y.size(0), -1}), y,
                               F::CrossEntropyFuncOptions().reduction(torch::kSum).label_smoothing(cfg_.train.label_smoothing));
  return loss / normalizer;
}

void TrainingRun::attempt_step(const data::Batch& batch, double lr, StepResult& r) {
  // Per-phase peaks for the memory report; the last phase is recorded (as failed) also when an OOM unwinds.
  PhasePeakRecorder phases(*memory_, *memory_report_, step_ + 1, controller_->micro_batch());
  optimizer_->zero_grad();
  const auto sizes = controller_->micro_batch_sizes();
  // The targets of the whole optimizer step over all ranks (every rank holds an equal slice): summed
  // over micro-batches and ranks, the gradients are the mean over the global batch.
  const double normalizer = static_cast<double>(batch.labels.numel() * env_.world_size);
  torch::Tensor loss_sum = torch::zeros({}, torch::dtype(torch::kFloat).device(device_));
  torch::Tensor norm;
  double global_loss = 0;
  int64_t offset = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t n = sizes[i];
    const bool last = i + 1 == sizes.size();
    std::exception_ptr oom;  // this rank's out-of-memory error in this micro-batch
    try {
      // Gradients cross ranks once per step: the last backward sends them, bucket by bucket, as it goes.
      if (last && grad_sync_) grad_sync_->arm();
      phases.enter("forward");
      torch::Tensor loss = micro_batch_loss(batch.images.narrow(0, offset, n), batch.labels.narrow(0, offset, n), normalizer);
      phases.enter("backward");
      scaler_->scale(loss).backward();
      loss_sum += loss.detach();
      if (last) {
        phases.enter("optimizer");  // from here on: the gradient exchange, optimizer state, unscale, norm
        if (grad_sync_) {
          r.grad_buckets_in_backward = grad_sync_->sent_during_backward();
          grad_sync_->finish();
        }
        // Everything the update needs is allocated before the ranks agree that the step succeeded: after
        // that, nothing can run out of memory on one rank only (Optimizer::step allocates nothing then).
        optimizer_->allocate_state();
        const auto& params = optimizer_->params();
        std::vector<torch::Tensor> tensors;
        for (const auto& p : params) tensors.push_back(p.param);
        scaler_->unscale_(tensors);
        norm = clip_grad_norm(params, cfg_.optim.grad_clip);
      }
    } catch (const std::exception& e) {
      if (!is_oom_error(e)) throw;
      if (grad_sync_) grad_sync_->abandon();  // the same collectives as the ranks that did not fail
      if (!dist_) throw;
      oom = std::current_exception();
    }
    if (dist_) {
      // Before anyone enters the next collective, every rank learns whether any rank ran out of memory
      // in this micro-batch; then all of them abandon the step together. The last one also sums the loss.
      std::vector<double> v(env_.world_size + 1, 0.0);
      v[env_.rank] = oom ? 1.0 : 0.0;
      if (last && !oom) v[env_.world_size] = loss_sum.item<double>();
      auto a = dist_->all_sum(v, "the out-of-memory agreement");
      if (oom) std::rethrow_exception(oom);
      for (int64_t k = 0; k < env_.world_size; ++k) {
        if (a[k] > 0) {
          // train_step's recovery (drop_failed_attempt) drops the gradients, as for this rank's own OOM.
          throw PeerOutOfMemory("rank " + std::to_string(k) + " ran out of memory in micro-batch " + std::to_string(i + 1) +
                                " of " + std::to_string(sizes.size()));
        }
      }
      if (last) global_loss = a[env_.world_size];
    }
    offset += n;
  }
  // The one host sync per step: the step must be skipped on non-finite values, and the metrics line
  // wants the loss. (GradScaler in PyTorch syncs here too.)
  if (dist_) {
    r.loss = global_loss;
    r.grad_norm = norm.item<double>();
  } else {
    auto host = torch::stack({loss_sum, norm.to(loss_sum.device())}).cpu();
    r.loss = host[0].item<double>();
    r.grad_norm = host[1].item<double>();
  }
  r.updated = std::isfinite(r.loss) && std::isfinite(r.grad_norm) && !scaler_->found_inf();
  if (r.updated) optimizer_->step(lr);
  scaler_->update();
  r.micro_batch = controller_->micro_batch();
  r.accum_steps = static_cast<int64_t>(sizes.size());
}

void TrainingRun::drop_failed_attempt() {
  // Everything the failed attempt held: its graph and activations died with attempt_step's locals;
  // the partial gradients go now; cached autocast casts and the allocator's cached blocks after them.
  optimizer_->zero_grad();
  scaler_->abandon_step();
  at::autocast::clear_cache();
  memory_->empty_cache();
}

StepResult TrainingRun::train_step(const data::Batch& batch) {
  StepResult r;
  r.lr = learning_rate(cfg_.schedule, cfg_.optim.lr, step_, total_steps_, warmup_steps_);
  memory_->reset_peak();
  r.mem_start_bytes = memory_->current_bytes();

  // A retried step must start from the same state: BatchNorm running statistics (updated by the failed
  // attempt's forwards) and the RNG (dropout) are restored; the samples are the same batch tensors.
  std::vector<std::pair<torch::Tensor, torch::Tensor>> buffers;
  {
    torch::NoGradGuard ng;
    for (auto& b : model_->buffers()) buffers.emplace_back(b, b.clone());
  }
  auto rng = at::detail::getDefaultCPUGenerator().get_state();

  while (true) {
    try {
      attempt_step(batch, r.lr, r);
      break;
    } catch (const std::exception& e) {
      const bool peer = dynamic_cast<const PeerOutOfMemory*>(&e) != nullptr;
      if (!peer && !is_oom_error(e)) throw;
      if (!peer) {
        MemoryReport rep = memory_report_->write(step_ + 1, *memory_, "oom", e.what());
        spdlog::warn("{}\n{}", rep.path.empty() ? rep.write_error : "memory report: " + rep.path, rep.text);
      }
      drop_failed_attempt();
      {
        torch::NoGradGuard ng;
        for (auto& [live, saved] : buffers) live.copy_(saved);
      }
      at::Generator(at::detail::getDefaultCPUGenerator()).set_state(rng);
      ++r.oom_retries;
      const int64_t peak = memory_->peak_bytes();
      OomAction action = controller_->on_oom(agreed_limit_);
      spdlog::warn("{} in step {} (limit {}, peak {}): {}", peer ? std::string(e.what()) : "out of memory", step_ + 1,
                   limit_bytes_ ? format_bytes(limit_bytes_) : "none", format_bytes(peak), action.event.reason);
      nlohmann::json j = action.event.to_json();
      j["event"] = "oom";
      j["step"] = step_ + 1;
      j["mem_peak_bytes"] = peak;
      j["current_bytes"] = memory_->current_bytes();
      j["error"] = std::string(e.what()).substr(0, 300);
      if (dist_) j["rank"] = env_.rank;
      if (peer) j["peer"] = true;
      metrics_.write(j);
      controller_->take_events();  // the OOM event was just written with more detail
      if (action.kind == OomAction::Kind::kGiveUp) throw OomGaveUp(action.event.reason);
      apply_activation_checkpointing();
      memory_->reset_peak();
    }
  }
  // Grow back: after enough clean steps with headroom, or when the limit rose, the controller tries a
  // larger micro-batch (or checkpointing off) on the next step. A failed probe costs one retried step.
  // Every rank's controller decides alike from the same inputs: the highest peak of all ranks against
  // the lowest limit (agreed_limit_), so a probe starts, succeeds or fails on all ranks together.
  int64_t peak = memory_->peak_bytes();
  if (dist_) peak = static_cast<int64_t>(dist_->all_max({static_cast<double>(peak)}, "the peak memory agreement")[0]);
  controller_->maybe_grow(agreed_limit_, peak);
  log_controller_events();
  apply_activation_checkpointing();
  if (!r.updated) {
    ++nonfinite_in_a_row_;
    metrics_.event("nonfinite", {{"step", step_ + 1}, {"loss", r.loss}, {"grad_norm", r.grad_norm},
                                 {"scaler", scaler_->is_enabled()}});
    if (!scaler_->is_enabled()) spdlog::warn("step {}: non-finite loss or gradient norm, update skipped", step_ + 1);
    if (nonfinite_in_a_row_ >= 5 && !scaler_->is_enabled())
      throw std::runtime_error("training diverged: 5 steps in a row with a non-finite loss or gradient norm; "
                               "lower optim.lr or set optim.grad_clip");
  } else {
    nonfinite_in_a_row_ = 0;
  }
  return r;
}

int64_t TrainingRun::find_auto_micro_batch(const data::Batch& batch) {
  // The largest micro-batch whose forward+backward fits under the cap, measured on real samples with
  // the optimizer state already allocated, so the job starts fast rather than OOM-ing its way down.
  optimizer_->zero_grad();
  auto fits = [&](int64_t mb) {
    try {
      auto loss = micro_batch_loss(batch.images.narrow(0, 0, mb), batch.labels.narrow(0, 0, mb), 1.0);
      loss.backward();
      optimizer_->zero_grad();
      return true;
    } catch (const std::exception& e) {
      if (!is_oom_error(e)) throw;
      drop_failed_attempt();
      return false;
    }
  };
  optimizer_->allocate_state();
  std::vector<std::pair<torch::Tensor, torch::Tensor>> buffers;
  {
    torch::NoGradGuard ng;
    for (auto& b : model_->buffers()) buffers.emplace_back(b, b.clone());
  }
  auto rng = at::detail::getDefaultCPUGenerator().get_state();
  int64_t mb = find_max_micro_batch(fits, std::min(cfg_.memory.min_micro_batch, rank_batch()), rank_batch());
  // The smallest over ranks: the micro-batch count per step (and so the collectives) must be equal.
  if (dist_) mb = static_cast<int64_t>(-dist_->all_max({-static_cast<double>(mb)}, "the micro-batch agreement")[0]);
  {
    torch::NoGradGuard ng;
    for (auto& [live, saved] : buffers) live.copy_(saved);  // the probes must not count as training
  }
  at::Generator(at::detail::getDefaultCPUGenerator()).set_state(rng);
  MicroBatchOptions co = controller_options();
  co.micro_batch = mb;
  controller_ = std::make_unique<MicroBatchController>(co);
  controller_->on_limit_changed(agreed_limit_);
  controller_->take_events();
  spdlog::info("micro_batch auto: {} fits under {} (accumulation {})", mb,
               limit_bytes_ ? format_bytes(limit_bytes_) : "no limit", controller_->accum_steps());
  metrics_.event("auto_micro_batch", {{"micro_batch", mb}, {"accum_steps", controller_->accum_steps()},
                                      {"limit", limit_bytes_}});
  return mb;
}

}  // namespace trainer
