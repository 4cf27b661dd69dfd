#include "common/versions.h"

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>

namespace trainer {

std::string cuda_runtime_version() {
#ifdef TRAINER_WITH_CUDA
  try {
    if (at::hasCUDA()) {
      const long v = at::detail::getCUDAHooks().versionCUDART();  // e.g. 13000
      return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
    }
  } catch (const std::exception&) {
  }
#endif
  return "";
}

std::string cudnn_version() {
#ifdef TRAINER_WITH_CUDA
  try {
    if (at::hasCUDA() && at::detail::getCUDAHooks().compiledWithCuDNN())
      return std::to_string(at::detail::getCUDAHooks().versionCuDNN());
  } catch (const std::exception&) {
  }
#endif
  return "";
}

}  // namespace trainer
