// Evaluation of a split: loss, top-1 and top-5 per sample (images) or per target token (language
// models), through the forward path training uses (trainer/numerics/forward.h). It backs off on its own: an OOM
// halves the evaluation micro-batch and redoes that chunk, without touching the training micro-batch.
// The training run (TrainingRun::evaluate) and `trainer eval` (trainer/commands/eval_command.h) both call it.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>

#include "data/samples/source.h"
#include "models/model.h"
#include "trainer/memory/backend.h"
#include "trainer/numerics/forward.h"
#include "trainer/numerics/loss.h"

namespace trainer {

class Distributed;

struct EvalResult {
  double loss = 0, top1 = 0, top5 = 0;  ///< mean cross-entropy (nats) and accuracies over the targets
  int64_t samples = 0;                  ///< targets scored: images, or tokens
};

/// How an evaluation reads and runs (from_config.h's eval_settings builds it from a config).
struct EvalSettings {
  int64_t batch = 500;      ///< samples (images or windows) per batch, over all ranks: train.eval_batch
  int64_t max_batches = 0;  ///< score the first N batches only (0 = the whole split): train.eval_batches
  int64_t context = 0;      ///< tokens per window (token splits): model.context
  int64_t workers = 1;      ///< image loader threads
  bool normalize = true;    ///< images: data.normalize, with the split's own mean and std
  bool pin_memory = false;  ///< page-locked image batches (CUDA)
  int64_t rank = 0, world_size = 1;
  ForwardOptions forward;
  LossOptions loss{0.0, true};  ///< train.fused_loss; no label smoothing in a score
};

/// Optional callbacks of an evaluation.
struct EvalHooks {
  std::function<void()> heartbeat;                                   ///< before each batch
  std::function<void(int64_t old_micro, int64_t new_micro)> backoff;  ///< after an OOM halved the micro-batch
};

/// One pass over `split` (images or tokens: data/samples/source.h) with `model` in eval mode (its previous mode is restored after). `micro_batch`
/// (in/out) is the size forwarded at once; an OOM halves it (down to 1, then rethrows), after
/// `memory.empty_cache()`, and it stays halved for later calls. With `dist`, rank 0's buffers (BatchNorm
/// statistics) are broadcast first and the sums are added over ranks. One host sync, at the end.
EvalResult evaluate_split(models::ModelImpl& model, const data::EvalSource& split, const EvalSettings& settings,
                          MemoryBackend& memory, int64_t& micro_batch, Distributed* dist = nullptr,
                          const EvalHooks& hooks = {});

}  // namespace trainer
