// The augmentations a step applies on the device, per micro-batch: random erasing after normalization,
// then Mixup or CutMix with the mirrored slice (mixing.h). A micro-batch's input and its targets depend
// only on the batch, the step's draw and the slice, never on the micro-batch size, so a backoff or a
// grow-back changes nothing of what the model sees.
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "data/samples/batch.h"
#include "models/model.h"
#include "trainer/mix/mixing.h"
#include "trainer/numerics/forward.h"

namespace trainer {

/// RandomErasing on the device, after normalization: sets every channel of box b of image b to 0.
/// x: (B, C, H, W) float, any memory format (NHWC from images_to_float); boxes: (B, 4) int64 rows (top,
/// left, height, width) on x's device (data::Batch::erase), an empty box erasing nothing. A few
/// element-wise kernels over (B, H, W) booleans and one masked fill; returns x.
torch::Tensor erase_boxes(torch::Tensor x, const torch::Tensor& boxes);

/// The model's input for samples [offset, offset + n) of `batch`: model_input, with the batch's erase boxes
/// (decoded images: data::Batch::erase) applied after normalization.
torch::Tensor augmented_input(const data::Batch& batch, int64_t offset, int64_t n, const ForwardOptions& forward);

/// The logits of samples [offset, offset + n) against their targets: class ids, or under Mixup/CutMix
/// (`mix` drawn for this step) the rows mixed with their partners and soft targets, smoothed by
/// `label_smoothing` once.
Logits augmented_logits(models::ModelImpl& model, const data::Batch& batch, int64_t offset, int64_t n,
                        const MixDraw& mix, const ForwardOptions& forward, double label_smoothing);

}  // namespace trainer
