#include "trainer/step/evaluate.h"

#include <spdlog/spdlog.h>

#include <optional>

#include "trainer/dist/dist.h"

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
  void add(const Logits& out, const LossOptions& loss_options) {
    auto l = summed_cross_entropy(out.logits, out.targets, loss_options, out.columns);
    auto logits = out.real().to(torch::kFloat);  // ranked as float32, as before the fused loss
    auto top = std::get<1>(logits.topk(std::min<int64_t>(5, logits.size(1)), 1));  // (n, 5) class ids
    auto hit = top.eq(out.targets.unsqueeze(1));
    auto c1 = hit.narrow(1, 0, 1).sum(), c5 = hit.sum();
    loss += l.to(torch::kDouble);
    correct1 += c1;
    correct5 += c5;
    targets += out.targets.size(0);
  }
};

// How `settings` reads the split: in order, as batches of settings.batch samples (images or token windows).
data::EvalPassOptions eval_pass_options(const EvalSettings& s) {
  data::EvalPassOptions o;
  o.batch = s.batch;
  o.rank = s.rank;
  o.world_size = s.world_size;
  o.workers = s.workers;
  o.normalize = s.normalize;
  o.pin_memory = s.pin_memory;
  o.context = s.context;
  return o;
}

}  // namespace

EvalResult evaluate_split(models::ModelImpl& model, const data::EvalSource& split, const EvalSettings& settings,
                          MemoryBackend& memory, int64_t& micro_batch, Distributed* dist, const EvalHooks& hooks) {
  torch::NoGradGuard no_grad;
  // Data parallel: BatchNorm statistics are each rank's own (as in DDP without SyncBatchNorm); the
  // evaluation uses rank 0's, as the checkpoint does, on every rank's share of the split.
  if (dist) {
    auto buffers = model.buffers();
    dist->broadcast(std::vector<torch::Tensor>(buffers.begin(), buffers.end()), "the BatchNorm statistics");
  }
  const bool was_training = model.is_training();
  model.eval();
  const std::unique_ptr<data::EvalPass> reader = split.pass(eval_pass_options(settings));
  EvalSums sums(settings.forward.device);
  int64_t batches = 0;
  while (auto b = reader->next()) {
    if (hooks.heartbeat) hooks.heartbeat();
    if (settings.max_batches > 0 && batches++ >= settings.max_batches) break;
    for (int64_t start = 0; start < b->size();) {
      const int64_t n = std::min(micro_batch, b->size() - start);
      try {
        sums.add(forward_logits(model, b->images.narrow(0, start, n), b->labels.narrow(0, start, n), settings.forward), settings.loss);
        start += n;
      } catch (const std::exception& e) {
        if (!is_oom_error(e) || micro_batch == 1) throw;
        memory.empty_cache();
        const int64_t old = micro_batch;
        micro_batch = std::max<int64_t>(1, micro_batch / 2);
        spdlog::warn("evaluation: out of memory at micro-batch {}, retrying at {}", old, micro_batch);
        if (hooks.backoff) hooks.backoff(old, micro_batch);
      }
    }
  }
  model.train(was_training);
  // Per sample for images, per token for language models; summed over ranks. A sync, once per evaluation.
  std::vector<double> totals{sums.loss.item<double>(), static_cast<double>(sums.correct1.item<int64_t>()),
                             static_cast<double>(sums.correct5.item<int64_t>()), static_cast<double>(sums.targets)};
  if (dist) totals = dist->all_sum(totals, "the evaluation totals");
  EvalResult r;
  r.samples = static_cast<int64_t>(totals[3]);
  r.loss = totals[0] / totals[3];
  r.top1 = totals[1] / totals[3];
  r.top5 = totals[2] / totals[3];
  return r;
}

}  // namespace trainer
