// A readable description of a model: what `trainer --dry-run` prints before any training.
#pragma once

#include "models/model.h"

#include <torch/torch.h>

#include <string>
#include <vector>

namespace models {

/// Number of scalar parameters of `module` and all its descendants (buffers not counted).
int64_t count_parameters(const torch::nn::Module& module);

/// A multi-line table: one row per top-level child (name, type, parameters; a container of blocks shows
/// as "N x Block"), then total and trainable (requires_grad) parameters, forward GFLOPs per sample of
/// shape `sample_shape` (model.forward_flops, multiply-add = 2) and training GFLOPs per sample, taken as
/// 3x forward (backward costs about twice the forward). Ends with a newline.
std::string summarize(const ModelImpl& model, const std::vector<int64_t>& sample_shape);

}  // namespace models
