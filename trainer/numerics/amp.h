// Mixed precision for the training step: an autocast scope guard, a dynamic loss scaler (GradScaler)
// and the validation of the `amp` config. LibTorch's C++ API has none of these; they follow the
// semantics of Python's torch.autocast and torch.cuda.amp.GradScaler.
//
// The training step calls them in this order (see docs/AMP.md):
//   { AutocastGuard ac(device, dtype, amp_enabled); loss = model(x) ...; }   // forward under autocast
//   scaler.scale(loss).backward();                  // per micro-batch; backward outside the guard
//   scaler.unscale_(params);                        // grads are now true gradients
//   clip_grad_norm_(params, max_norm);              // clip and check the norm on true gradients
//   bool stepped = scaler.step(optimizer);          // skipped (false) if any gradient is inf/NaN
//   scaler.update();                                // backoff on inf, grow after a clean interval
#pragma once

#include <torch/torch.h>

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/config/config.h"

namespace trainer {

// ---- autocast ------------------------------------------------------------------------------------

/// RAII scope of autocast for one device type (CPU or CUDA) on the calling thread.
///
/// On construction it saves the device's autocast enabled flag and lower-precision dtype, sets them to
/// (`enabled`, `dtype`) and increments the autocast nesting count. On destruction it decrements the
/// nesting, clears the autocast weight-cast cache when the nesting reaches 0 (so cached low-precision
/// copies of the weights never outlive the outermost scope, e.g. across an optimizer step), and
/// restores the saved flag and dtype. Guards nest: a disabled guard inside an enabled one turns
/// autocast off for its scope and back on after it.
///
/// Autocast state is thread-local: the guard affects only the thread that created it. Run the forward
/// pass (and the loss) inside the guard and call backward() after it, as in PyTorch.
/// Throws std::invalid_argument for a device type other than CPU or CUDA.
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, at::ScalarType dtype, bool enabled);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_;
  bool prev_enabled_;
  at::ScalarType prev_dtype_;
};

/// amp.dtype's tensor type: bf16 -> at::kBFloat16, fp16 -> at::kHalf.
at::ScalarType amp_scalar_type(AmpDtype dtype);

/// Checks an `amp` configuration before training starts. Throws std::invalid_argument, naming the
/// config keys, when `enabled`, for: fp16 without the loss scaler (fp16 gradients underflow), bf16 with the scaler (bf16 has fp32's
/// exponent range, scaling only costs time), fp16 on CPU (CPU autocast in LibTorch 1.13 supports
/// bf16 only; kept an error on 2.x too, so a config means the same on both), and a device other than
/// CPU or CUDA.
/// When `enabled` is false the scaler setting is ignored: build the scaler with
/// `enabled = amp.enabled && amp.scaler.enabled`.
void validate_amp(bool enabled, AmpDtype dtype, bool scaler_enabled, c10::DeviceType device);

// ---- loss scaling --------------------------------------------------------------------------------

/// Options of GradScaler; the defaults are PyTorch's.
struct GradScalerOptions {
  /// Scale factor at the start of training (a power of two keeps scaling exact).
  TORCH_ARG(double, init_scale) = 65536.0;
  /// The scale is multiplied by this after `growth_interval` consecutive steps without inf/NaN; > 1.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// The scale is multiplied by this on a step with inf/NaN gradients; in (0, 1).
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Number of consecutive clean steps before the scale grows; >= 1.
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// A disabled scaler is a pass-through: scale() returns the loss, step() always steps.
  TORCH_ARG(bool, enabled) = true;
};

/// The part of GradScaler that a checkpoint must hold to resume exactly.
struct GradScalerState {
  double scale = 65536.0;       ///< current scale factor (finite, > 0)
  int64_t growth_tracker = 0;   ///< consecutive clean steps since the last growth or backoff (>= 0)
};

/// JSON form {"scale": <number>, "growth_tracker": <integer>} (nlohmann ADL hooks, so
/// `nlohmann::json j = state;` and `j.get<GradScalerState>()` work). from_json throws
/// std::invalid_argument naming a missing or ill-typed key or an invalid value.
void to_json(nlohmann::json& j, const GradScalerState& s);
void from_json(const nlohmann::json& j, GradScalerState& s);

/// Dynamic loss scaling for fp16 training (Python's torch.cuda.amp.GradScaler).
///
/// Per optimizer step: scale() each micro-batch loss before backward; unscale_() once (optional: step()
/// does it if not done) so gradients can be clipped; step() skips the optimizer step when any
/// gradient is inf/NaN; update() adjusts the scale. The scale lives in a one-element fp32 tensor on
/// the loss's device, so on CUDA nothing synchronizes except step() (which must read found_inf to
/// decide) and the accessors get_scale()/found_inf()/state().
///
/// CUDA gradients use ATen's fused kernels (_amp_foreach_non_finite_check_and_unscale_,
/// _amp_update_scale_); other devices use a plain-tensor path with the same arithmetic (multiply by
/// the fp32 reciprocal of the scale, computed in fp32 for reduced-precision gradients).
class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  /// loss * scale (the scale moved to the loss's device on first use). A disabled scaler returns
  /// `loss` unchanged.
  torch::Tensor scale(const torch::Tensor& loss);

  /// Divides the gradients of `params` (those with a defined gradient) by the scale in place and
  /// records whether any was inf/NaN. Idempotent within one step: a second call before update() does
  /// nothing. Dense gradients only (throws std::invalid_argument for a sparse one).
  void unscale_(const std::vector<torch::Tensor>& params);

  /// Unscales the optimizer's parameters if unscale_() was not called this step, then runs
  /// optimizer.step() unless a gradient was inf/NaN. Returns whether the step ran. Synchronizes with
  /// the device (reads found_inf). Throws std::runtime_error if called twice before update().
  bool step(torch::optim::Optimizer& optimizer);

  /// Ends the step: backs the scale off on inf/NaN, else counts a clean step and grows the scale after
  /// growth_interval of them (growth is skipped if it would overflow fp32). Throws std::runtime_error
  /// if no unscale_()/step() ran since the last update().
  void update();

  /// Forgets an unscale_()/step() of the current step without touching the scale, for a step that is
  /// thrown away and redone (e.g. retried with smaller micro-batches after an out-of-memory error):
  /// the redone step's gradients are scaled again and must be unscaled again.
  void abandon_step();

  /// Current scale (1.0 when disabled). Synchronizes with the device.
  double get_scale() const;
  /// Whether the most recent unscale_() found an inf/NaN gradient (false before any). Synchronizes.
  bool found_inf() const;
  bool is_enabled() const { return options_.enabled(); }
  /// found_inf (as found_inf()) and the scale (as get_scale()) as the one-element fp32 tensors on the
  /// device, for a caller that reads them with other values in one copy. Defined while enabled.
  const torch::Tensor& found_inf_tensor() const { return found_inf_; }
  const torch::Tensor& scale_tensor() const { return scale_; }
  const GradScalerOptions& options() const { return options_; }

  /// Scale and growth tracker, for checkpoints. Synchronizes.
  GradScalerState state() const;
  /// Restores state(); throws std::invalid_argument for a non-finite or non-positive scale or a
  /// negative tracker. A tracker >= growth_interval (a run resumed with a smaller interval) is capped
  /// at growth_interval - 1. Call it between steps (it forgets an unscale_()/step() in progress).
  void load_state(const GradScalerState& state);

 private:
  GradScalerOptions options_;
  torch::Tensor scale_;           // (1,) fp32, on the device of the last scaled loss
  torch::Tensor growth_tracker_;  // (1,) int32, same device as scale_
  torch::Tensor found_inf_;       // (1,) fp32 on scale_'s device; 1.0 if the last unscale_ saw inf/NaN
  bool unscaled_ = false;         // unscale_() ran in this step
  bool stepped_ = false;          // step() ran in this step
};

/// Reference (non-fused) unscale: for each gradient, found_inf = 1 if it has an inf/NaN element, and
/// grad = grad * inv_scale computed in fp32 (or in the gradient's dtype if wider). `found_inf` and
/// `inv_scale` are one-element fp32 tensors. Same contract as at::_amp_foreach_non_finite_check_and_
/// unscale_; used where the fused kernel is unavailable (CPU in LibTorch 1.13).
void amp_unscale_plain_(const std::vector<torch::Tensor>& grads, torch::Tensor& found_inf,
                        const torch::Tensor& inv_scale);

/// Reference (non-fused) scale update with the contract of at::_amp_update_scale_: `scale` is a
/// one-element fp32 tensor, `growth_tracker` a one-element int32 tensor, both updated in place.
void amp_update_scale_plain_(torch::Tensor& scale, torch::Tensor& growth_tracker,
                             const torch::Tensor& found_inf, double growth_factor,
                             double backoff_factor, int64_t growth_interval);

}  // namespace trainer
