// The versions a run records (checkpoint manifests, bench results): of LibTorch's CUDA runtime and cuDNN.
// LibTorch's own version is compat::torch_version() (common/compat.h).
#pragma once

#include <string>

namespace trainer {

/// The CUDA runtime LibTorch uses, "13.0"; "" in a build without CUDA or on a machine without it.
std::string cuda_runtime_version();

/// cuDNN's version number as LibTorch reports it (e.g. "91900"); "" without CUDA or cuDNN.
std::string cudnn_version();

}  // namespace trainer
