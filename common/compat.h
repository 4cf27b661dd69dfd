// The one place where LibTorch versions differ. Nothing else in the tree checks TORCH_VERSION_*.
//
//   what                       LibTorch 1.13 (Debian, CPU)              LibTorch 2.x (pip, CUDA)
//   autocast on/off, dtype     set_enabled / set_cpu_enabled,           set_autocast_enabled(device, on),
//                              set_autocast_{gpu,cpu}_dtype             set_autocast_dtype(device, dtype)  (2.4+)
//   fused attention            none                                     at::scaled_dot_product_attention (2.0+),
//                                                                       its enable_gqa: fewer key/value heads (2.5+)
//   AMP fused kernels          CUDA only                                CUDA (and CPU in newer releases)
//   c10::Allocator             `DataPtr allocate(size_t) const`         `DataPtr allocate(size_t)` (non-const)
//                                                                       and a pure `copy_data` (2.3+)
//   c10d process groups        ProcessGroupGloo/NCCL derive from        they derive from c10d::Backend (2.0+)
//                              c10d::ProcessGroup
//   CUDA allocator stats       CUDACachingAllocator::getDeviceStats(int) and friends take an int device in
//                              1.13 and a c10::DeviceIndex in 2.x; both accept a DeviceIndex argument.
//   multi-tensor ops           _foreach_{add,mul,addcmul,addcdiv,      also _foreach_copy_ and _foreach_mul_ by
//                              sqrt,div,norm} (scalar and list forms)  a 0-dim tensor (2.1+); _foreach_lerp_
//                                                                      (2.0+)
//   fused optimizers           _fused_adam_ (CUDA) only                 _fused_adamw_ and _fused_sgd_, CUDA and CPU
//                                                                       kernels (2.4+; 2.11's headers checked),
//                                                                       with found_inf: skipped on the device
//                                                                       (both kernels, checked on the CPU's);
//                                                                       a tensor learning rate (.tensor_lr, 2.11's
//                                                                       headers), which a CUDA graph replays
//   profiler events            KinetoEvent::startUs/durationUs          startNs/durationNs (detected, not versioned)
//   profiler traces            Debian's build has no Kineto: events     ProfilerResult::save writes Kineto's
//                              are collected, save() throws             Chrome trace (the pip wheels have Kineto)
//   events                     c10::Event::query only                   also c10::Event::synchronize (2.11 checked;
//                                                                       wait_for)
//   cuDNN tuning               setBenchmarkCuDNN, setBenchmarkLimitCuDNN in both; the switch that stops the
//                              caching allocator's cache being emptied after each benchmark timing
//                              (at::native::_cudnn_set_conv_benchmark_empty_cache) only in 2.x
#pragma once

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/Allocator.h>
#include <c10/core/Event.h>
#include <torch/version.h>

#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

#define TRAINER_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if TRAINER_TORCH_AT_LEAST(2, 1)
#include <ATen/native/ConvUtils.h>  // _cudnn_set_conv_benchmark_empty_cache
#endif

namespace c10d {
class ProcessGroup;
class Backend;
}  // namespace c10d

namespace trainer::compat {

/// LibTorch's version as "major.minor.patch".
inline std::string torch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

// ---- autocast -------------------------------------------------------------------------------------
// `device` is CPU or CUDA; other device types are rejected by the caller.

inline bool autocast_enabled(c10::DeviceType device) {
#if TRAINER_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(device);
#else
  return device == c10::DeviceType::CUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
#endif
}

inline void set_autocast_enabled(c10::DeviceType device, bool on) {
#if TRAINER_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(device, on);
#else
  if (device == c10::DeviceType::CUDA) at::autocast::set_enabled(on);
  else at::autocast::set_cpu_enabled(on);
#endif
}

inline at::ScalarType autocast_dtype(c10::DeviceType device) {
#if TRAINER_TORCH_AT_LEAST(2, 4)
  return at::autocast::get_autocast_dtype(device);
#else
  return device == c10::DeviceType::CUDA ? at::autocast::get_autocast_gpu_dtype()
                                         : at::autocast::get_autocast_cpu_dtype();
#endif
}

inline void set_autocast_dtype(c10::DeviceType device, at::ScalarType dtype) {
#if TRAINER_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(device, dtype);
#else
  if (device == c10::DeviceType::CUDA) at::autocast::set_autocast_gpu_dtype(dtype);
  else at::autocast::set_autocast_cpu_dtype(dtype);
#endif
}

// ---- c10d -----------------------------------------------------------------------------------------

/// The class ProcessGroupGloo and ProcessGroupNCCL derive from, which has the collectives
/// (allreduce, broadcast, allgather) with the same signatures in every version.
#if TRAINER_TORCH_AT_LEAST(2, 0)
using C10dBackend = c10d::Backend;
#else
using C10dBackend = c10d::ProcessGroup;
#endif

/// True where Gloo has a reduce-scatter (checked in 2.11; 1.13's Gloo throws "does not support
/// reduce_scatter"). Without it, dist.shard: gradients sums the bucket with an all-reduce and keeps the
/// rank's slice: the same values. 2.11's Gloo carries its reduce-scatter out as an all-reduce too (its
/// profile shows gloo:all_reduce inside c10d::reduce_scatter_); NCCL's moves half the bytes.
constexpr bool kHasGlooReduceScatter = TRAINER_TORCH_AT_LEAST(2, 11);

// ---- attention ------------------------------------------------------------------------------------

/// True where LibTorch has the fused scaled_dot_product_attention (2.0+).
constexpr bool kHasFusedAttention = TRAINER_TORCH_AT_LEAST(2, 0);

// ---- allocators -----------------------------------------------------------------------------------

/// Base for a custom c10::Allocator that builds on every LibTorch version without checking it: both
/// `allocate` overloads are defined (whichever one the build declares pure is overridden, the other is
/// an ordinary member) and `copy_data` is defined (it overrides the 2.3+ pure virtual, and is unused in
/// 1.13). Subclasses implement `allocate_bytes`.
struct AllocatorBase : c10::Allocator {
  virtual c10::DataPtr allocate_bytes(size_t n) const = 0;
  c10::DataPtr allocate(size_t n) const { return allocate_bytes(n); }
  c10::DataPtr allocate(size_t n) { return allocate_bytes(n); }
  void copy_data(void* dest, const void* src, size_t count) const { std::memcpy(dest, src, count); }
};

/// True where the fused kernel takes fewer key/value heads than query heads (enable_gqa, 2.5+).
constexpr bool kHasGroupedAttention = TRAINER_TORCH_AT_LEAST(2, 5);

/// at::scaled_dot_product_attention(q, k, v, no mask, dropout_p, is_causal) for q (B, nh, T, hs) and
/// k, v (B, nh, S, hs), scale 1/sqrt(hs). LibTorch picks the kernel (flash, memory-efficient or math).
/// k and v may have nh / g heads where kHasGroupedAttention (query head h reads key/value head h / g,
/// enable_gqa). Where kHasFusedAttention is false it throws c10::Error; models/attention.h has the plain
/// equivalent.
inline at::Tensor fused_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p,
                                  bool is_causal) {
#if TRAINER_TORCH_AT_LEAST(2, 5)
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, dropout_p, is_causal, /*scale=*/std::nullopt,
                                          /*enable_gqa=*/k.size(-3) != q.size(-3));
#elif TRAINER_TORCH_AT_LEAST(2, 0)
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, dropout_p, is_causal);
#else
  TORCH_CHECK(false, "fused attention needs LibTorch 2.0 or later, this is ", torch_version(),
              "; use the plain attention backend");
  return {};
#endif
}

// ---- multi-tensor ops -------------------------------------------------------------------------------

/// dst[i].copy_(src[i]) for every i, in one multi-tensor op where LibTorch has it.
inline void foreach_copy_(at::TensorList dst, at::TensorList src) {
#if TRAINER_TORCH_AT_LEAST(2, 1)
  at::_foreach_copy_(dst, src);
#else
  for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
#endif
}

/// t.mul_(factor) for every t, factor a 0-dim tensor on their device (no host sync).
inline void foreach_mul_(at::TensorList tensors, const at::Tensor& factor) {
#if TRAINER_TORCH_AT_LEAST(2, 1)
  at::_foreach_mul_(tensors, factor);
#else
  for (const auto& t : tensors) t.mul_(factor.to(t.dtype()));
#endif
}

/// dst[i].lerp_(end[i], weight) for every i, in one multi-tensor op where LibTorch has it; the same
/// arithmetic either way (the CPU's foreach lerp is the per-tensor lerp).
inline void foreach_lerp_(at::TensorList dst, at::TensorList end, double weight) {
#if TRAINER_TORCH_AT_LEAST(2, 0)
  at::_foreach_lerp_(dst, end, weight);
#else
  for (size_t i = 0; i < dst.size(); ++i) dst[i].lerp_(end[i], weight);
#endif
}

// ---- fused optimizers ---------------------------------------------------------------------------

/// True where at::_fused_adamw_ and at::_fused_sgd_ exist with CPU and CUDA kernels (2.4+). 1.13 has
/// only _fused_adam_ (CUDA, no decoupled weight decay).
constexpr bool kHasFusedOptimizers = TRAINER_TORCH_AT_LEAST(2, 4);

/// The `skip` of the fused kernels below: a float32 one-element tensor on the parameters' device, or
/// undefined. Where it holds exactly 1 the kernel returns before writing anything (PyTorch's found_inf,
/// which its GradScaler hands to fused optimizers so that no host read comes before the update).
#if TRAINER_TORCH_AT_LEAST(2, 4)
inline std::optional<at::Tensor> fused_skip(const at::Tensor& skip) {
  return skip.defined() ? std::optional<at::Tensor>(skip) : std::nullopt;
}
#endif

/// at::_fused_adamw_ (no amsgrad, not maximizing, no grad scale): for each i, p[i] *= 1 - lr * weight_decay,
/// then Adam's update with the bias corrections of step `steps[i]` (float32 0-dim tensors on the
/// parameters' device, read, not incremented); nothing where `skip` (fused_skip) is 1. Every tensor on
/// one device, one dtype per list. `lr`: a double, or a float32 one-element tensor on the parameters'
/// device that the kernel reads when it runs (a captured CUDA graph replays with each step's rate; the
/// kernel widens it from float32 to double, so a double rounded to float32 first gives the same bits).
/// Throws c10::Error where kHasFusedOptimizers is false.
template <typename Rate>
inline void fused_adamw_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                         at::TensorList steps, const Rate& lr, double beta1, double beta2, double weight_decay,
                         double eps, const at::Tensor& skip = {}) {
#if TRAINER_TORCH_AT_LEAST(2, 4)
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr, beta1, beta2, weight_decay,
                    eps, /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/std::nullopt, fused_skip(skip));
#else
  (void)params, (void)grads, (void)exp_avgs, (void)exp_avg_sqs, (void)steps, (void)lr, (void)beta1, (void)beta2,
      (void)weight_decay, (void)eps, (void)skip;
  TORCH_CHECK(false, "the fused AdamW kernel needs LibTorch 2.4 or later, this is ", torch_version());
#endif
}

/// at::_fused_sgd_ (no dampening, not maximizing, no grad scale): g += weight_decay * p; with momentum,
/// buf = momentum * buf + g (`momentum_buffers` empty when momentum is 0) and g = nesterov ? g + momentum *
/// buf : buf; p -= lr * g; nothing where `skip` (fused_skip) is 1. `lr` as for fused_adamw_. Throws
/// c10::Error where kHasFusedOptimizers is false.
template <typename Rate>
inline void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, double weight_decay,
                       double momentum, const Rate& lr, bool nesterov, const at::Tensor& skip = {}) {
#if TRAINER_TORCH_AT_LEAST(2, 4)
  // is_first_step false: the buffers start at zero, so the first step's momentum * 0 + g is PyTorch's
  // first-step buf = g.
  at::_fused_sgd_(params, grads, momentum_buffers, weight_decay, momentum, lr, /*dampening=*/0.0, nesterov,
                  /*maximize=*/false, /*is_first_step=*/false, /*grad_scale=*/std::nullopt, fused_skip(skip));
#else
  (void)params, (void)grads, (void)momentum_buffers, (void)weight_decay, (void)momentum, (void)lr, (void)nesterov,
      (void)skip;
  TORCH_CHECK(false, "the fused SGD kernel needs LibTorch 2.4 or later, this is ", torch_version());
#endif
}

// ---- events -----------------------------------------------------------------------------------------

/// Blocks the host until `event`'s recorded work is done (at once if it was never recorded). 2.11's
/// c10::Event has synchronize(); 1.13's only query(), polled here (Debian's 1.13 has no CUDA to wait on).
inline void wait_for(const c10::Event& event) {
#if TRAINER_TORCH_AT_LEAST(2, 4)
  event.synchronize();
#else
  while (!event.query()) std::this_thread::yield();
#endif
}

// ---- the profiler ---------------------------------------------------------------------------------
// Templates on the event type, so this header needs no profiler include.

namespace detail {
template <typename E, typename = void>
struct HasStartNs : std::false_type {};
template <typename E>
struct HasStartNs<E, std::void_t<decltype(std::declval<const E&>().startNs())>> : std::true_type {};
}  // namespace detail

/// A torch::autograd::profiler::KinetoEvent's start, in microseconds (1.13 counts in us, 2.x in ns).
template <typename KinetoEvent>
double profiler_event_start_us(const KinetoEvent& e) {
  if constexpr (detail::HasStartNs<KinetoEvent>::value) return static_cast<double>(e.startNs()) / 1000.0;
  else return static_cast<double>(e.startUs());
}

/// Its duration, in microseconds.
template <typename KinetoEvent>
double profiler_event_duration_us(const KinetoEvent& e) {
  if constexpr (detail::HasStartNs<KinetoEvent>::value) return static_cast<double>(e.durationNs()) / 1000.0;
  else return static_cast<double>(e.durationUs());
}

// ---- cuDNN ------------------------------------------------------------------------------------------

/// Whether cuDNN's benchmark timing empties the CUDA caching allocator's cache after each timing
/// (LibTorch's default: yes). Returns false where this LibTorch has no such switch (1.13, whose v7 path
/// always empties it; seen absent in 1.13's headers, present in 2.11's ConvUtils.h; torch._inductor has
/// called it since 2.1, read).
inline bool set_cudnn_benchmark_empty_cache(bool on) {
#if TRAINER_TORCH_AT_LEAST(2, 1)
  at::native::_cudnn_set_conv_benchmark_empty_cache(on);
  return true;
#else
  (void)on;
  return false;
#endif
}

}  // namespace trainer::compat
