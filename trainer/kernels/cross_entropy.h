// The fused cross-entropy's CUDA kernels, behind plain C++ (no LibTorch types): trainer/numerics/loss.cpp checks
// the tensors and calls these; trainer/kernels/cross_entropy.cu is compiled by nvcc only in a CUDA build
// (TRAINER_WITH_CUDA).
//
// For N rows of V logits x (bfloat16, float16 or float32; row i starts at element i * row_stride, its V
// elements contiguous: GPT's logits narrowed from a padded vocabulary are read in place) and N targets t:
//   lse_i  = log sum_j exp(x_ij)                                   (float32, one pass: an online max and sum)
//   loss_i = lse_i - (1 - e) x_it - e mean_j x_ij                  (e: label smoothing; 0 where t_i = ignore)
//   dx_ij  = g (exp(x_ij - lse_i) - e / V - (1 - e) [j = t_i])     (g: the gradient of the summed loss)
// which is PyTorch's cross_entropy with label_smoothing and reduction 'sum', computed in float32 from the
// logits as they are: no float32 copy of the logits, no log-probabilities kept for the backward pass, and
// the gradient written once, in the logits' own type.
//
// Soft targets (Mixup's and CutMix's rows of class weights, label smoothing folded in): N rows of V float32
// weights t, contiguous, in place of the class ids:
//   w_i    = sum_j t_ij
//   loss_i = w_i lse_i - sum_j t_ij x_ij                           (= -sum_j t_ij log_softmax(x_i)_j)
//   dx_ij  = g (exp(x_ij - lse_i) w_i - t_ij)
// which is timm's SoftTargetCrossEntropy summed over the rows. A row of zeros (an undecodable sample) adds
// nothing and gets a zero gradient; a logit of -inf with a weight of 0 adds nothing (0 * -inf is not NaN here).
#pragma once

#include <cstdint>

namespace trainer::kernels {

enum class LogitsType { kFloat32, kFloat16, kBFloat16 };

/// Writes loss[i] and lse[i] (float32, N each). A target outside [0, V) that is not `ignore_index` makes
/// that row's loss NaN (a non-finite loss: the step is not applied) rather than reading out of bounds.
/// `stream` is a cudaStream_t. Returns an error message, or nullptr.
const char* cross_entropy_forward(const void* logits, LogitsType type, int64_t row_stride, const int64_t* targets,
                                  int64_t rows, int64_t vocab, int64_t ignore_index, float label_smoothing,
                                  float* loss, float* lse, void* stream);

/// Writes grad (N rows of `width` >= V at the same row_stride as the logits, the logits' type: the V real
/// columns and zeros in the padding columns after them; what lies between rows is left as it is) from the forward pass's lse and the summed loss's gradient
/// `grad_sum` (one float32 on the device: no host sync). Rows with target `ignore_index` get zeros.
const char* cross_entropy_backward(const void* logits, LogitsType type, int64_t row_stride, const int64_t* targets,
                                   const float* lse, const float* grad_sum, int64_t rows, int64_t vocab,
                                   int64_t width, int64_t ignore_index, float label_smoothing, void* grad,
                                   void* stream);

/// The forward pass over soft targets `soft` (rows x vocab float32, contiguous): loss[i], lse[i] and
/// weight[i] = w_i (float32, N each; the backward pass reads lse and weight).
const char* soft_cross_entropy_forward(const void* logits, LogitsType type, int64_t row_stride, const float* soft,
                                       int64_t rows, int64_t vocab, float* loss, float* lse, float* weight,
                                       void* stream);

/// The backward pass over soft targets, laid out as cross_entropy_backward's (zeros in the padding columns).
const char* soft_cross_entropy_backward(const void* logits, LogitsType type, int64_t row_stride, const float* soft,
                                        const float* lse, const float* weight, const float* grad_sum, int64_t rows,
                                        int64_t vocab, int64_t width, void* grad, void* stream);

}  // namespace trainer::kernels
