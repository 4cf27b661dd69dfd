// Evaluation on the test split: loss, top-1 and top-5 per sample (images) or per token (language
// models), through the same forward path as training. It backs off on its own: an OOM halves the
// evaluation micro-batch and redoes that chunk, without touching the training micro-batch.
#include <spdlog/spdlog.h>

#include "trainer/run.h"

namespace trainer {

namespace {

// Running sums over the split, on the device (one host sync at the end).
struct EvalSums {
  torch::Tensor loss, correct1, correct5;
  int64_t targets = 0;

  explicit EvalSums(const torch::Device& device)
      : loss(torch::zeros({}, torch::dtype(torch::kDouble).device(device))),
        correct1(torch::zeros({}, torch::dtype(torch::kLong).device(device))),
        correct5(torch::zeros({}, torch::dtype(torch::kLong).device(device))) {}

  // Everything that allocates comes before the sums change, so a chunk that runs out of memory and is
  // redone counts once.
  void add(const Logits& out) {
    namespace F = torch::nn::functional;
    auto l = F::cross_entropy(out.logits, out.targets, F::CrossEntropyFuncOptions().reduction(torch::kSum));
    auto top = std::get<1>(out.logits.topk(std::min<int64_t>(5, out.logits.size(1)), 1));  // (n, 5) class ids
    auto hit = top.eq(out.targets.unsqueeze(1));
    auto c1 = hit.narrow(1, 0, 1).sum(), c5 = hit.sum();
    loss += l.to(torch::kDouble);
    correct1 += c1;
    correct5 += c5;
    targets += out.targets.size(0);
  }
};

}  // namespace

EvalResult TrainingRun::evaluate() {
  EvalResult r;
  if (!has_eval()) return r;
  torch::NoGradGuard no_grad;
  // Data parallel: BatchNorm statistics are each rank's own (as in DDP without SyncBatchNorm); the
  // evaluation uses rank 0's, as the checkpoint does, on every rank's share of the split.
  if (dist_) {
    auto buffers = model_->buffers();
    dist_->broadcast(std::vector<torch::Tensor>(buffers.begin(), buffers.end()), "the BatchNorm statistics");
  }
  model_->eval();
  // The evaluation split in order, as batches of train.eval_batch samples (images or token windows).
  std::function<std::optional<data::Batch>()> next_eval;
  std::unique_ptr<data::EvalLoader> image_eval;
  std::unique_ptr<data::TokenEvalLoader> token_eval;
  if (tokens_) {
    data::TokenEvalOptions eo;
    eo.batch = cfg_.train.eval_batch;
    eo.context = cfg_.model.context;
    eo.rank = env_.rank;
    eo.world_size = env_.world_size;
    token_eval = std::make_unique<data::TokenEvalLoader>(test_tokens_, eo);
    next_eval = [&] { return token_eval->next(); };
  } else {
    data::EvalOptions eo;
    eo.batch = cfg_.train.eval_batch;
    eo.workers = cfg_.data.workers > 0 ? cfg_.data.workers : at::get_num_threads();
    eo.normalize = cfg_.data.normalize;
    eo.pin_memory = device_.is_cuda();
    eo.rank = env_.rank;
    eo.world_size = env_.world_size;
    image_eval = std::make_unique<data::EvalLoader>(test_images_, eo);
    next_eval = [&] { return image_eval->next(); };
  }
  EvalSums sums(device_);
  int64_t batches = 0;
  telemetry_.set_phase("eval");
  while (auto b = next_eval()) {
    telemetry_.heartbeat();
    if (cfg_.train.eval_batches > 0 && batches++ >= cfg_.train.eval_batches) break;
    for (int64_t start = 0; start < b->size();) {
      const int64_t n = std::min(eval_micro_batch_, b->size() - start);
      try {
        sums.add(forward_logits(*model_, b->images.narrow(0, start, n), b->labels.narrow(0, start, n), forward_));
        start += n;
      } catch (const std::exception& e) {
        if (!is_oom_error(e) || eval_micro_batch_ == 1) throw;
        memory_->empty_cache();
        const int64_t old = eval_micro_batch_;
        eval_micro_batch_ = std::max<int64_t>(1, eval_micro_batch_ / 2);
        spdlog::warn("evaluation: out of memory at micro-batch {}, retrying at {}", old, eval_micro_batch_);
        metrics_.event("eval_backoff", {{"step", step_}, {"old_micro_batch", old}, {"new_micro_batch", eval_micro_batch_},
                                        {"limit", limit_bytes_}, {"current_bytes", memory_->current_bytes()}});
      }
    }
  }
  model_->train();
  // Per sample for images, per token for language models; summed over ranks. A sync, once per evaluation.
  std::vector<double> totals{sums.loss.item<double>(), static_cast<double>(sums.correct1.item<int64_t>()),
                             static_cast<double>(sums.correct5.item<int64_t>()), static_cast<double>(sums.targets)};
  if (dist_) totals = dist_->all_sum(totals, "the evaluation totals");
  r.samples = static_cast<int64_t>(totals[3]);
  r.loss = totals[0] / totals[3];
  r.top1 = totals[1] / totals[3];
  r.top5 = totals[2] / totals[3];
  return r;
}

}  // namespace trainer
