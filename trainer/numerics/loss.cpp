#include "trainer/numerics/loss.h"

#include <stdexcept>
#include <string>

#ifdef TRAINER_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "trainer/kernels/cross_entropy.h"
#endif

namespace trainer {
namespace {

constexpr int64_t kIgnoreIndex = -100;  // PyTorch's default ignore_index

#ifdef TRAINER_WITH_CUDA
kernels::LogitsType logits_type(const torch::Tensor& x) {
  switch (x.scalar_type()) {
    case torch::kFloat: return kernels::LogitsType::kFloat32;
    case torch::kHalf: return kernels::LogitsType::kFloat16;
    case torch::kBFloat16: return kernels::LogitsType::kBFloat16;
    default: throw std::invalid_argument("fused cross-entropy: logits of type " + std::string(c10::toString(x.scalar_type())));
  }
}

void check_launch(const char* error) {
  if (error) throw std::runtime_error(std::string("fused cross-entropy: ") + error);
}

// Rows of contiguous logits at any row stride are read in place (GPT's, narrowed from the padded
// vocabulary); anything else is copied first.
bool in_place_rows(const torch::Tensor& x) {
  return (x.stride(1) == 1 || x.size(1) <= 1) && (x.size(0) <= 1 || x.stride(0) >= x.size(1));
}
int64_t row_stride(const torch::Tensor& x) { return x.size(0) <= 1 ? x.size(1) : x.stride(0); }

void* current_stream(const torch::Tensor& x) { return c10::cuda::getCurrentCUDAStream(x.device().index()).stream(); }

// Forward: the summed loss over the first `vocab` columns, keeping the logits (not a copy), the targets and
// each row's log-sum-exp. Backward: the gradient of all the logits' columns (zeros past `vocab`) in their
// own type, scaled by the incoming gradient on the device.
class FusedCrossEntropy : public torch::autograd::Function<FusedCrossEntropy> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& logits,
                               const torch::Tensor& targets, double label_smoothing, int64_t vocab) {
    const c10::cuda::CUDAGuard guard(logits.device());
    auto x = in_place_rows(logits) ? logits : logits.contiguous();
    auto t = targets.to(torch::kLong).contiguous();
    const int64_t rows = x.size(0);
    auto f32 = x.options().dtype(torch::kFloat);
    auto loss = torch::empty({rows}, f32), lse = torch::empty({rows}, f32);
    check_launch(kernels::cross_entropy_forward(x.data_ptr(), logits_type(x), row_stride(x), t.data_ptr<int64_t>(),
                                                rows, vocab, kIgnoreIndex, static_cast<float>(label_smoothing),
                                                loss.data_ptr<float>(), lse.data_ptr<float>(), current_stream(x)));
    ctx->save_for_backward({x, t, lse});
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["vocab"] = vocab;
    return loss.sum();
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &t = saved[1], &lse = saved[2];
    const c10::cuda::CUDAGuard guard(x.device());
    auto g = grads[0].to(torch::kFloat).contiguous();  // a scalar on the device: read there, no host sync
    // The same row stride as the logits (16-byte aligned rows where theirs are); the columns between rows
    // are never read: the gradient is the (N, W) view.
    const int64_t width = x.size(1);
    auto dx = torch::empty({x.size(0), row_stride(x)}, x.options()).narrow(1, 0, width);
    check_launch(kernels::cross_entropy_backward(
        x.data_ptr(), logits_type(x), row_stride(x), t.data_ptr<int64_t>(), lse.data_ptr<float>(), g.data_ptr<float>(),
        x.size(0), ctx->saved_data["vocab"].toInt(), width, kIgnoreIndex,
        static_cast<float>(ctx->saved_data["label_smoothing"].toDouble()), dx.data_ptr(), current_stream(x)));
    return {dx, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// The same over soft targets (N, vocab) float32: the summed -t log_softmax(x) of trainer/kernels/cross_entropy.h,
// keeping the logits, the targets, each row's log-sum-exp and its weight sum.
class FusedSoftCrossEntropy : public torch::autograd::Function<FusedSoftCrossEntropy> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& logits,
                               const torch::Tensor& soft, int64_t vocab) {
    const c10::cuda::CUDAGuard guard(logits.device());
    auto x = in_place_rows(logits) ? logits : logits.contiguous();
    auto t = soft.to(x.device(), torch::kFloat).contiguous();
    const int64_t rows = x.size(0);
    if (t.dim() != 2 || t.size(0) != rows || t.size(1) != vocab)
      throw std::invalid_argument("fused cross-entropy: soft targets of shape " + c10::str(t.sizes()) + " for " +
                                  std::to_string(rows) + " rows of " + std::to_string(vocab) + " classes");
    auto f32 = x.options().dtype(torch::kFloat);
    auto loss = torch::empty({rows}, f32), lse = torch::empty({rows}, f32), weight = torch::empty({rows}, f32);
    check_launch(kernels::soft_cross_entropy_forward(x.data_ptr(), logits_type(x), row_stride(x), t.data_ptr<float>(),
                                                     rows, vocab, loss.data_ptr<float>(), lse.data_ptr<float>(),
                                                     weight.data_ptr<float>(), current_stream(x)));
    ctx->save_for_backward({x, t, lse, weight});
    return loss.sum();
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &t = saved[1], &lse = saved[2], &weight = saved[3];
    const c10::cuda::CUDAGuard guard(x.device());
    auto g = grads[0].to(torch::kFloat).contiguous();
    const int64_t width = x.size(1);
    auto dx = torch::empty({x.size(0), row_stride(x)}, x.options()).narrow(1, 0, width);
    check_launch(kernels::soft_cross_entropy_backward(x.data_ptr(), logits_type(x), row_stride(x), t.data_ptr<float>(),
                                                      lse.data_ptr<float>(), weight.data_ptr<float>(),
                                                      g.data_ptr<float>(), x.size(0), t.size(1), width, dx.data_ptr(),
                                                      current_stream(x)));
    return {dx, torch::Tensor(), torch::Tensor()};
  }
};
#endif

}  // namespace

bool fused_loss_built() {
#ifdef TRAINER_WITH_CUDA
  return true;
#else
  return false;
#endif
}

bool fused_loss_runs(const torch::Tensor& logits, const LossOptions& options) {
  const auto type = logits.scalar_type();
  return options.fused && fused_loss_built() && logits.is_cuda() && logits.dim() == 2 &&
         (type == torch::kFloat || type == torch::kHalf || type == torch::kBFloat16);
}

torch::Tensor summed_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                   const LossOptions& options, int64_t columns) {
  if (columns < 0) columns = logits.size(-1);
  if (columns == 0 || columns > logits.size(-1))
    throw std::invalid_argument("summed_cross_entropy: " + std::to_string(columns) + " real columns of " +
                                std::to_string(logits.size(-1)));
#ifdef TRAINER_WITH_CUDA
  if (fused_loss_runs(logits, options)) return FusedCrossEntropy::apply(logits, targets, options.label_smoothing, columns);
#endif
  namespace F = torch::nn::functional;
  const auto real = columns == logits.size(-1) ? logits : logits.narrow(-1, 0, columns);
  return F::cross_entropy(real.to(torch::kFloat), targets,
                          F::CrossEntropyFuncOptions().reduction(torch::kSum).label_smoothing(options.label_smoothing));
}

torch::Tensor smoothed_one_hot(const torch::Tensor& labels, int64_t classes, double label_smoothing) {
  const double off = label_smoothing / static_cast<double>(classes);
  const double on = 1.0 - label_smoothing + off;
  auto y = labels.to(torch::kLong).reshape({-1});
  auto valid = y.ge(0).logical_and(y.lt(classes));
  auto t = torch::full({y.size(0), classes}, off, torch::dtype(torch::kFloat).device(y.device()));
  t.scatter_(1, torch::where(valid, y, torch::zeros_like(y)).unsqueeze(1), on);
  return t.mul_(valid.unsqueeze(1).to(torch::kFloat));
}

torch::Tensor summed_loss(const torch::Tensor& logits, const torch::Tensor& targets, const LossOptions& options,
                          int64_t columns) {
  const bool soft = targets.is_floating_point();
  if (options.kind == LossKind::kCrossEntropy && !soft) return summed_cross_entropy(logits, targets, options, columns);
  if (columns < 0) columns = logits.size(-1);
#ifdef TRAINER_WITH_CUDA
  if (options.kind == LossKind::kCrossEntropy && fused_loss_runs(logits, options)) {
    if (columns > logits.size(-1))
      throw std::invalid_argument("summed_loss: " + std::to_string(columns) + " real columns of " +
                                  std::to_string(logits.size(-1)));
    return FusedSoftCrossEntropy::apply(logits, targets, columns);
  }
#endif
  const auto x = (columns == logits.size(-1) ? logits : logits.narrow(-1, 0, columns)).to(torch::kFloat);
  auto t = soft ? targets.to(torch::kFloat) : smoothed_one_hot(targets, columns, options.label_smoothing);
  if (t.sizes() != x.sizes())
    throw std::invalid_argument("summed_loss: soft targets of shape " + c10::str(t.sizes()) + " for logits " +
                                c10::str(x.sizes()));
  if (options.kind == LossKind::kCrossEntropy) return (-t * torch::log_softmax(x, -1)).sum();
  // Rows of an undecodable sample (all-zero targets from class ids) add nothing, as in cross-entropy.
  const auto kept = soft ? torch::Tensor() : targets.reshape({-1}).ge(0).logical_and(targets.reshape({-1}).lt(columns));
  if (options.bce_target_threshold > 0) t = t.gt(options.bce_target_threshold).to(torch::kFloat);
  namespace F = torch::nn::functional;
  auto each = F::binary_cross_entropy_with_logits(x, t, F::BinaryCrossEntropyWithLogitsFuncOptions().reduction(torch::kNone));
  if (kept.defined()) each = each * kept.unsqueeze(1).to(torch::kFloat);
  return options.bce_sum_classes ? each.sum() : each.sum() / static_cast<double>(columns);
}

}  // namespace trainer
