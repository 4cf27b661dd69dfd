// Activation checkpointing: run a block without keeping its intermediate activations, and recompute
// them in backward. LibTorch's C++ API has no torch.utils.checkpoint; this is its reentrant variant.
#pragma once

#include <torch/torch.h>

#include <functional>

namespace models {

/// Returns fn(input) without keeping fn's intermediate activations for backward: only `input` is
/// saved. In backward, fn is run again with gradients on and the incoming gradient is propagated
/// through the recomputed graph, so `input` receives its gradient and the parameters of `owner`
/// receive theirs (accumulated into .grad by the autograd engine, as without checkpointing).
///
/// Exactness: the recomputation sees what the forward saw, so gradients equal the plain ones.
///   - RNG: the CPU generator state (and the CUDA generator of `input`'s device when `input` is a
///     CUDA tensor) at forward time is restored for the recomputation, so dropout draws the same mask;
///     the global RNG state is put back afterwards, so after backward it is what it would have been
///     without checkpointing.
///   - Autocast: the enabled flag and dtype of CPU and CUDA autocast at forward time are restored for
///     the recomputation (backward usually runs outside the autocast scope). The autocast weight cache
///     is bypassed in both runs, so a no-grad cast never leaks into a later forward.
///   - Buffers: `owner`'s buffers (BatchNorm running statistics, num_batches_tracked) are snapshotted
///     before the recomputation and restored after it, so they are updated once per forward, not twice.
///
/// When grad mode is off, or neither `input` nor any parameter of `owner` requires grad, this is
/// just fn(input).
///
/// Limits:
///   - one tensor in, one tensor out; fn must return a tensor computed from `input` (not `input` itself);
///   - fn may use only `owner`'s parameters (those of `owner` and its descendants); a parameter from
///     elsewhere would get no gradient through the checkpoint;
///   - `owner`, and whatever fn captures, must stay alive until backward has run;
///   - no double backward (create_graph) through a checkpoint;
///   - fn must not modify `input` in place.
torch::Tensor checkpoint(torch::nn::Module& owner,
                         const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                         const torch::Tensor& input);

}  // namespace models
