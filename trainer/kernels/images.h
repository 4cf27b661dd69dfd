// uint8 images to the model's float32 input in one pass, behind plain C++ (no LibTorch types):
// trainer/numerics/forward.cpp checks the tensors and calls this; trainer/kernels/images.cu is compiled by nvcc only
// in a CUDA build (TRAINER_WITH_CUDA).
//
// For n bytes x of images laid out channels last (NHWC: element i is of channel i % C):
//   y_i = (x_i * scale - mean[c]) / std[c]        (mean and std given: the normalized input)
//   y_i =  x_i * scale                            (mean null)
// each operation in float32 and rounded on its own, never contracted into a fused multiply-add: the same
// bits as PyTorch's x.to(float).div_(255).sub_(mean).div_(std) on CUDA, whose division by a scalar is a
// multiplication by its float reciprocal (scale = 1.0f / 255.0f). One kernel instead of four, and the
// float32 image written once instead of four times.
#pragma once

#include <cstdint>

namespace trainer::kernels {

/// Writes y (n float32, NHWC like x). `mean` and `std`: C float32 each on the device, or both null.
/// `stream` is a cudaStream_t. Returns an error message, or nullptr.
const char* normalize_images(const uint8_t* x, int64_t n, int64_t channels, float scale, const float* mean,
                             const float* std, float* y, void* stream);

}  // namespace trainer::kernels
