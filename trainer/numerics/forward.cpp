#include "trainer/numerics/forward.h"

#include "common/compat.h"

#include <stdexcept>
#include <string>

#include "trainer/numerics/amp.h"

#ifdef TRAINER_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "trainer/kernels/images.h"
#endif

namespace trainer {

bool images_in_one_kernel(const torch::Tensor& x, const ForwardOptions& o) {
#ifdef TRAINER_WITH_CUDA
  const auto& m = o.input_mean;
  const bool stats = !m.defined() || (m.is_cuda() && m.device() == x.device() && m.scalar_type() == torch::kFloat &&
                                      m.is_contiguous() && m.numel() == x.size(1) && o.input_std.sizes() == m.sizes() &&
                                      o.input_std.device() == x.device() &&
                                      o.input_std.scalar_type() == torch::kFloat && o.input_std.is_contiguous());
  return x.is_cuda() && x.scalar_type() == torch::kUInt8 && x.dim() == 4 && stats &&
         x.is_contiguous(at::MemoryFormat::ChannelsLast);
#else
  (void)x, (void)o;
  return false;
#endif
}

torch::Tensor images_to_float(const torch::Tensor& x, const ForwardOptions& o) {
#ifdef TRAINER_WITH_CUDA
  if (images_in_one_kernel(x, o)) {
    auto y = torch::empty(x.sizes(), x.options().dtype(torch::kFloat).memory_format(at::MemoryFormat::ChannelsLast));
    const c10::cuda::CUDAGuard guard(x.device());
    const bool stats = o.input_mean.defined();
    const char* error = kernels::normalize_images(
        x.data_ptr<uint8_t>(), x.numel(), x.size(1), 1.0f / 255.0f, stats ? o.input_mean.data_ptr<float>() : nullptr,
        stats ? o.input_std.data_ptr<float>() : nullptr, y.data_ptr<float>(),
        c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    if (error) throw std::runtime_error(std::string("images to float: ") + error);
    return y;
  }
#endif
  // The element-wise ops keep the batch's memory format (NHWC from the loader).
  auto y = x.to(torch::kFloat).div_(255.0f);
  if (o.input_mean.defined()) y = y.sub_(o.input_mean).div_(o.input_std);
  return y;
}

torch::Tensor model_input(const torch::Tensor& inputs, const ForwardOptions& o) {
  auto x = inputs.to(o.device, /*non_blocking=*/true);
  if (x.scalar_type() == torch::kUInt8) x = images_to_float(x, o);
  if (x.is_floating_point() && x.scalar_type() != o.param_dtype) x = x.to(o.param_dtype);
  if (o.channels_last && x.dim() == 4) return x.contiguous(at::MemoryFormat::ChannelsLast);
  if (x.dim() == 4) return x.contiguous();  // NHWC batches of uint8 images, for a model that is not
  return x;
}

Logits logits_of(models::ModelImpl& model, const torch::Tensor& x, const torch::Tensor& targets,
                 const ForwardOptions& o) {
  // Class ids: (N) classes or (N*T) next tokens; soft targets: (N, classes) as they are.
  auto y = targets.is_floating_point() ? targets : targets.reshape({-1});
  models::ModelImpl::Padded out;
  {
    AutocastGuard autocast(o.device.type(), o.amp_dtype, o.amp);
    out = model.forward_padded(x);
  }
  return {out.logits.reshape({y.size(0), -1}), y, out.columns};
}

Logits forward_logits(models::ModelImpl& model, const torch::Tensor& inputs, const torch::Tensor& labels,
                      const ForwardOptions& o) {
  return logits_of(model, model_input(inputs, o), labels.to(o.device, /*non_blocking=*/true), o);
}

std::string missing_bfloat16_kernel(const std::exception& e) {
  const std::string what = e.what();
  const size_t at = what.find(" not implemented for 'BFloat16'");
  if (at == std::string::npos) return "";
  const size_t start = what.rfind('\n', at);
  const std::string op = what.substr(start == std::string::npos ? 0 : start + 1, at - (start == std::string::npos ? 0 : start + 1));
  return "model.param_dtype: bfloat16 needs a kernel that LibTorch " + compat::torch_version() + " lacks on the CPU (" +
         op + " for BFloat16); use float32 weights";
}

}  // namespace trainer
