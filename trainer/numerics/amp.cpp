#include "trainer/numerics/amp.h"

#include "common/compat.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <algorithm>
#include <limits>
#include <stdexcept>
#include <utility>

namespace trainer {

namespace {

void check_autocast_device(c10::DeviceType device, const char* where) {
  if (device != c10::DeviceType::CPU && device != c10::DeviceType::CUDA) {
    throw std::invalid_argument(std::string(where) + ": autocast supports cpu and cuda, got device type " +
                                c10::DeviceTypeName(device) + "; use amp.enabled: false on this device");
  }
}

}  // namespace

// ---- autocast ------------------------------------------------------------------------------------

AutocastGuard::AutocastGuard(c10::DeviceType device, at::ScalarType dtype, bool enabled)
    : device_(device) {
  check_autocast_device(device, "AutocastGuard");
  prev_enabled_ = compat::autocast_enabled(device);
  prev_dtype_ = compat::autocast_dtype(device);
  compat::set_autocast_enabled(device, enabled);
  compat::set_autocast_dtype(device, dtype);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  // The cast cache holds low-precision copies of leaf weights; it must die with the outermost scope,
  // or an optimizer step would leave stale copies behind for the next forward.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  compat::set_autocast_enabled(device_, prev_enabled_);
  compat::set_autocast_dtype(device_, prev_dtype_);
}

at::ScalarType amp_scalar_type(AmpDtype dtype) { return dtype == AmpDtype::kFp16 ? at::kHalf : at::kBFloat16; }

void validate_amp(bool enabled, AmpDtype dtype, bool scaler_enabled, c10::DeviceType device) {
  if (!enabled) return;
  const at::ScalarType type = amp_scalar_type(dtype);
  check_autocast_device(device, "amp.enabled");
  if (type == at::kHalf && device == c10::DeviceType::CPU) {
    throw std::invalid_argument(
        "amp.dtype: fp16 is not supported on CPU (CPU autocast in LibTorch 1.13 casts to bf16 only; this is "
        "LibTorch " + compat::torch_version() + "); use amp.dtype: bf16 on CPU");
  }
  if (type == at::kHalf && !scaler_enabled) {
    throw std::invalid_argument(
        "amp.dtype: fp16 needs the loss scaler (small fp16 gradients underflow to zero); "
        "set amp.scaler.enabled: true or use amp.dtype: bf16");
  }
  if (type == at::kBFloat16 && scaler_enabled) {
    throw std::invalid_argument(
        "amp.scaler.enabled: the loss scaler is for fp16 only (bf16 has fp32's exponent range, scaling "
        "only costs time); set amp.scaler.enabled: false or use amp.dtype: fp16");
  }
}

// ---- JSON form of the scaler state -----------------------------------------------------------------

void to_json(nlohmann::json& j, const GradScalerState& s) {
  j = nlohmann::json{{"scale", s.scale}, {"growth_tracker", s.growth_tracker}};
}

void from_json(const nlohmann::json& j, GradScalerState& s) {
  if (!j.is_object()) throw std::invalid_argument("GradScalerState: expected a JSON object, got " + j.dump());
  for (const char* key : {"scale", "growth_tracker"}) {
    if (!j.contains(key)) {
      throw std::invalid_argument(std::string("GradScalerState: missing key '") + key + "' in " + j.dump());
    }
  }
  if (!j.at("scale").is_number()) {
    throw std::invalid_argument("GradScalerState: 'scale' must be a number, got " + j.at("scale").dump());
  }
  if (!j.at("growth_tracker").is_number_integer()) {
    throw std::invalid_argument("GradScalerState: 'growth_tracker' must be an integer, got " +
                                j.at("growth_tracker").dump());
  }
  s.scale = j.at("scale").get<double>();
  s.growth_tracker = j.at("growth_tracker").get<int64_t>();
}

// ---- reference (plain-tensor) kernels ----------------------------------------------------------------

void amp_unscale_plain_(const std::vector<torch::Tensor>& grads, torch::Tensor& found_inf,
                        const torch::Tensor& inv_scale) {
  TORCH_CHECK(found_inf.numel() == 1 && found_inf.scalar_type() == at::kFloat,
              "amp_unscale_plain_: found_inf must be a one-element fp32 tensor");
  TORCH_CHECK(inv_scale.numel() == 1 && inv_scale.scalar_type() == at::kFloat,
              "amp_unscale_plain_: inv_scale must be a one-element fp32 tensor");
  torch::NoGradGuard no_grad;
  for (const auto& g : grads) {
    // isfinite rather than a sum: a sum of large finite values can overflow and look like an inf.
    auto nonfinite = torch::logical_not(torch::isfinite(g)).any().to(at::kFloat).to(found_inf.device());
    found_inf.copy_(torch::maximum(found_inf, nonfinite.reshape_as(found_inf)));
    auto inv = inv_scale.to(g.device());
    if (g.scalar_type() == at::kHalf || g.scalar_type() == at::kBFloat16) {
      // The fused kernel multiplies in fp32 and rounds once back to the gradient's dtype.
      g.copy_(g.to(at::kFloat).mul_(inv));
    } else {
      g.mul_(inv);
    }
  }
}

void amp_update_scale_plain_(torch::Tensor& scale, torch::Tensor& growth_tracker,
                             const torch::Tensor& found_inf, double growth_factor,
                             double backoff_factor, int64_t growth_interval) {
  TORCH_CHECK(scale.numel() == 1 && scale.scalar_type() == at::kFloat,
              "amp_update_scale_plain_: scale must be a one-element fp32 tensor");
  TORCH_CHECK(growth_tracker.numel() == 1 && growth_tracker.scalar_type() == at::kInt,
              "amp_update_scale_plain_: growth_tracker must be a one-element int32 tensor");
  // The fused kernel is a single thread doing exactly this on the device; here the values are read
  // to the host, which is free for CPU tensors.
  float s = scale.item<float>();
  int32_t tracker = growth_tracker.item<int32_t>();
  if (found_inf.item<float>() != 0.0f) {
    s = static_cast<float>(s * backoff_factor);
    tracker = 0;
  } else {
    const int32_t successful = tracker + 1;
    if (successful == growth_interval) {
      const float grown = static_cast<float>(s * growth_factor);
      if (std::isfinite(grown)) s = grown;  // never grow into an fp32 overflow
      tracker = 0;
    } else {
      tracker = successful;
    }
  }
  scale.fill_(s);
  growth_tracker.fill_(tracker);
}

// ---- GradScaler ----------------------------------------------------------------------------------

GradScaler::GradScaler(GradScalerOptions options) : options_(std::move(options)) {
  const auto& o = options_;
  if (!(std::isfinite(o.init_scale()) && o.init_scale() > 0.0)) {
    throw std::invalid_argument("amp.scaler.init_scale must be finite and > 0, got " +
                                std::to_string(o.init_scale()));
  }
  if (!(o.growth_factor() > 1.0)) {
    throw std::invalid_argument("amp.scaler.growth_factor must be > 1, got " +
                                std::to_string(o.growth_factor()));
  }
  if (!(o.backoff_factor() > 0.0 && o.backoff_factor() < 1.0)) {
    throw std::invalid_argument("amp.scaler.backoff_factor must be in (0, 1), got " +
                                std::to_string(o.backoff_factor()));
  }
  if (o.growth_interval() < 1 || o.growth_interval() > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument("amp.scaler.growth_interval must be >= 1 (and fit int32), got " +
                                std::to_string(o.growth_interval()));
  }
  scale_ = torch::full({1}, o.init_scale(), torch::kFloat);
  growth_tracker_ = torch::zeros({1}, torch::kInt);
  found_inf_ = torch::zeros({1}, torch::kFloat);
}

torch::Tensor GradScaler::scale(const torch::Tensor& loss) {
  if (!options_.enabled()) return loss;
  // The scale follows the loss to its device once, so later steps need no host round trip.
  if (scale_.device() != loss.device()) {
    scale_ = scale_.to(loss.device());
    growth_tracker_ = growth_tracker_.to(loss.device());
    found_inf_ = found_inf_.to(loss.device());
  }
  return loss * scale_;
}

void GradScaler::unscale_(const std::vector<torch::Tensor>& params) {
  if (!options_.enabled() || unscaled_) return;
  // Reciprocal in double, then fp32: the same inv_scale the Python scaler computes.
  const auto inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  found_inf_ = torch::zeros({1}, scale_.options());

  // The fused kernel wants one device and one dtype per call; group like Python's scaler does.
  std::vector<std::pair<std::pair<c10::Device, at::ScalarType>, std::vector<torch::Tensor>>> groups;
  for (const auto& p : params) {
    const auto& g = p.grad();
    if (!g.defined()) continue;
    if (g.is_sparse()) {
      throw std::invalid_argument("GradScaler::unscale_: sparse gradients are not supported; use dense "
                                  "embeddings/parameters with AMP");
    }
    const std::pair<c10::Device, at::ScalarType> key{g.device(), g.scalar_type()};
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& e) { return e.first == key; });
    if (it == groups.end()) it = groups.insert(groups.end(), {key, {}});
    it->second.push_back(g);
  }
  for (auto& [key, grads] : groups) {
    const c10::Device device = key.first;
    auto found = torch::zeros({1}, torch::TensorOptions().dtype(at::kFloat).device(device));
    auto inv = inv_scale.to(device);
    if (device.is_cuda()) {
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found, inv);
    } else {
      amp_unscale_plain_(grads, found, inv);
    }
    found_inf_ = torch::maximum(found_inf_, found.to(found_inf_.device()));
  }
  unscaled_ = true;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return true;
  }
  if (stepped_) {
    throw std::runtime_error("GradScaler::step: called twice in one step; call update() after each step()");
  }
  if (!unscaled_) {
    std::vector<torch::Tensor> params;
    for (auto& group : optimizer.param_groups()) {
      for (auto& p : group.params()) params.push_back(p);
    }
    unscale_(params);
  }
  stepped_ = true;
  // The one sync point of the step: whether to step must be known on the host.
  if (found_inf_.item<float>() != 0.0f) return false;
  optimizer.step();
  return true;
}

void GradScaler::update() {
  if (!options_.enabled()) return;
  if (!unscaled_) {
    throw std::runtime_error("GradScaler::update: no unscale_() or step() since the last update(); call "
                             "scaler.step(optimizer) before scaler.update()");
  }
  if (scale_.is_cuda()) {
    at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, options_.growth_factor(),
                           options_.backoff_factor(), options_.growth_interval());
  } else {
    amp_update_scale_plain_(scale_, growth_tracker_, found_inf_, options_.growth_factor(),
                            options_.backoff_factor(), options_.growth_interval());
  }
  unscaled_ = false;
  stepped_ = false;
}

void GradScaler::abandon_step() {
  unscaled_ = false;
  stepped_ = false;
}

double GradScaler::get_scale() const {
  if (!options_.enabled()) return 1.0;
  return scale_.to(at::kDouble).item<double>();
}

bool GradScaler::found_inf() const {
  if (!options_.enabled()) return false;
  return found_inf_.item<float>() != 0.0f;
}

GradScalerState GradScaler::state() const {
  GradScalerState s;
  s.scale = scale_.to(at::kDouble).item<double>();
  s.growth_tracker = growth_tracker_.to(at::kLong).item<int64_t>();
  return s;
}

void GradScaler::load_state(const GradScalerState& state) {
  if (!(std::isfinite(state.scale) && state.scale > 0.0)) {
    throw std::invalid_argument("GradScaler::load_state: scale must be finite and > 0, got " +
                                std::to_string(state.scale) + "; the checkpoint's scaler state is corrupt");
  }
  if (state.growth_tracker < 0) {
    throw std::invalid_argument("GradScaler::load_state: growth_tracker must be >= 0, got " +
                                std::to_string(state.growth_tracker) + "; the checkpoint's scaler state is "
                                "corrupt");
  }
  // A run resumed with a smaller growth_interval would otherwise never reach the interval again (the
  // update compares with ==); cap it so the next clean step grows the scale.
  const int64_t tracker = std::min(state.growth_tracker, options_.growth_interval() - 1);
  scale_.fill_(state.scale);
  growth_tracker_.fill_(tracker);
  found_inf_.zero_();
  unscaled_ = false;
  stepped_ = false;
}

}  // namespace trainer
