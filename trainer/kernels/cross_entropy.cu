// The fused cross-entropy (trainer/kernels/cross_entropy.h): one block per row of logits, float32 inside.
//
// What it replaces, per step of GPT-2 small at batch 16 x 1024 (16,384 rows of 50,304 bf16 logits, 1.6 GB):
// the plain path casts the logits to float32 (3.3 GB written), takes log_softmax (3.3 GB more, kept for the
// backward pass), picks the targets; backward writes a float32 gradient (3.3 GB) and casts it to bf16.
// Here the forward pass reads the logits once and writes two floats a row; the backward pass reads them
// once more and writes the bf16 gradient: about 5 GB of traffic instead of about 20 (llm.c's fused
// classifier does the same in one kernel; this one keeps PyTorch's autograd contract).
#include "trainer/kernels/cross_entropy.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

namespace trainer::kernels {
namespace {

constexpr int kThreads = 256;  // 8 warps per row
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// VEC elements loaded or stored as one 16-byte access (VEC 1: one element).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// A running log-sum-exp: the largest logit m seen, the sum s of exp(x - m), and `sum`: of x with class ids
// (label smoothing's mean), of t x with soft targets, whose weights t add up in w. Two partial states merge
// exactly (up to float rounding), in any order.
struct Lse {
  float m, s, sum, w;
};

__device__ __forceinline__ Lse merge(Lse a, Lse b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f, a.sum + b.sum, a.w + b.w};  // nothing but -inf yet: exp(-inf - -inf) is NaN
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m), a.sum + b.sum, a.w + b.w};
}

__device__ __forceinline__ void add_exp(Lse& a, float x) {
  if (x > a.m) {
    a.s = a.s * expf(a.m - x) + 1.f;
    a.m = x;
  } else if (x != -INFINITY) {  // exp(-inf) adds nothing; with m still -inf it would be exp(NaN)
    a.s += expf(x - a.m);
  }
}

__device__ __forceinline__ void add(Lse& a, float x) {
  add_exp(a, x);
  a.sum += x;
}

__device__ __forceinline__ void add_soft(Lse& a, float x, float t) {
  add_exp(a, x);
  a.w += t;
  if (t != 0.f) a.sum += t * x;  // a masked logit (-inf) of weight 0 adds nothing
}

__device__ __forceinline__ Lse shuffle(Lse a, int offset) {
  return {__shfl_xor_sync(0xffffffffu, a.m, offset), __shfl_xor_sync(0xffffffffu, a.s, offset),
          __shfl_xor_sync(0xffffffffu, a.sum, offset), __shfl_xor_sync(0xffffffffu, a.w, offset)};
}

// The whole block's state, in every thread.
__device__ Lse block_reduce(Lse a) {
  __shared__ Lse warp_states[kWarps];
  __shared__ Lse total;
  for (int offset = 16; offset > 0; offset >>= 1) a = merge(a, shuffle(a, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_states[warp] = a;
  __syncthreads();
  if (warp == 0) {
    a = lane < kWarps ? warp_states[lane] : Lse{-INFINITY, 0.f, 0.f, 0.f};
    for (int offset = kWarps / 2; offset > 0; offset >>= 1) a = merge(a, shuffle(a, offset));
    if (lane == 0) total = a;
  }
  __syncthreads();
  a = total;
  __syncthreads();  // `total` is read by all before a later row of this block writes it again
  return a;
}

// SOFT: `soft` holds the targets (rows x vocab weights) and `weight` receives each row's w; else `targets`
// holds class ids.
template <typename T, int VEC, bool SOFT>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const T* __restrict__ logits, int64_t stride, const int64_t* __restrict__ targets,
                   const float* __restrict__ soft, int64_t rows, int64_t vocab, int64_t ignore_index, float smoothing,
                   float* __restrict__ loss, float* __restrict__ lse, float* __restrict__ weight) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* x = logits + row * stride;
    const float* tw = SOFT ? soft + row * vocab : nullptr;
    auto take = [&](Lse& a, float xj, int64_t j) {
      if constexpr (SOFT) add_soft(a, xj, tw[j]);
      else add(a, xj);
    };
    Lse a{-INFINITY, 0.f, 0.f, 0.f};
    const int64_t body = vocab / VEC * VEC;  // VEC at a time, then the last vocab % VEC one by one
    for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < body; j += kThreads * VEC) {
      const Pack<T, VEC> p = *reinterpret_cast<const Pack<T, VEC>*>(x + j);
#pragma unroll
      for (int k = 0; k < VEC; ++k) take(a, to_float(p.v[k]), j + k);
    }
    for (int64_t j = body + threadIdx.x; j < vocab; j += kThreads) take(a, to_float(x[j]), j);
    a = block_reduce(a);
    if (threadIdx.x != 0) continue;
    const float l = a.m + logf(a.s);
    lse[row] = l;
    if constexpr (SOFT) {
      weight[row] = a.w;
      loss[row] = a.w == 0.f ? 0.f : a.w * l - a.sum;  // a row of zeros: nothing, also where l is not finite
    } else {
      const int64_t t = targets[row];
      if (t == ignore_index) {
        loss[row] = 0.f;
      } else if (t < 0 || t >= vocab) {
        loss[row] = NAN;  // PyTorch stops with a device-side assert; a NaN loss skips the step instead
      } else {
        // Without smoothing the mean is left out, also where it is -inf (a masked logit): 0 * -inf is NaN.
        const float mean = smoothing > 0.f ? smoothing * (a.sum / static_cast<float>(vocab)) : 0.f;
        loss[row] = l - (1.f - smoothing) * to_float(x[t]) - mean;
      }
    }
  }
}

template <typename T, int VEC, bool SOFT>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const T* __restrict__ logits, int64_t stride, const int64_t* __restrict__ targets,
                    const float* __restrict__ soft, const float* __restrict__ weight, const float* __restrict__ lse,
                    const float* __restrict__ grad_sum, int64_t rows, int64_t vocab, int64_t width,
                    int64_t ignore_index, float smoothing, T* __restrict__ grad) {
  const float g = *grad_sum;
  const float uniform = smoothing / static_cast<float>(vocab);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* x = logits + row * stride;
    T* dx = grad + row * stride;
    const int64_t t = SOFT ? 0 : targets[row];
    const bool ignored = !SOFT && t == ignore_index;
    const float* tw = SOFT ? soft + row * vocab : nullptr;
    const float w = SOFT ? weight[row] : 0.f;
    const float l = lse[row];
    auto grad_of = [&](float xj, int64_t j) {
      if constexpr (SOFT) {
        return from_float<T>(g * (expf(xj - l) * w - tw[j]));
      } else {
        const float hit = j == t ? 1.f - smoothing : 0.f;
        return from_float<T>(ignored ? 0.f : g * (expf(xj - l) - uniform - hit));
      }
    };
    const int64_t body = vocab / VEC * VEC;
    for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < body; j += kThreads * VEC) {
      const Pack<T, VEC> p = *reinterpret_cast<const Pack<T, VEC>*>(x + j);
      Pack<T, VEC> d;
#pragma unroll
      for (int k = 0; k < VEC; ++k) d.v[k] = grad_of(to_float(p.v[k]), j + k);
      *reinterpret_cast<Pack<T, VEC>*>(dx + j) = d;
    }
    for (int64_t j = body + threadIdx.x; j < vocab; j += kThreads) dx[j] = grad_of(to_float(x[j]), j);
    for (int64_t j = vocab + threadIdx.x; j < width; j += kThreads) dx[j] = from_float<T>(0.f);  // padding
  }
}

// Enough blocks to fill any GPU several times over; a block takes further rows when there are more.
unsigned grid_for(int64_t rows) { return static_cast<unsigned>(rows < (1 << 20) ? rows : (1 << 20)); }

// 16-byte accesses when every row of both starts on a 16-byte boundary; else one element at a time.
template <typename T>
bool vectorizable(int64_t stride, const void* a, const void* b) {
  constexpr int vec = 16 / sizeof(T);
  return stride % vec == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0 && reinterpret_cast<uintptr_t>(b) % 16 == 0;
}

const char* launched() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

// The targets of one launch: class ids (soft == nullptr) or soft targets and their row weights.
struct Targets {
  const int64_t* ids;
  const float* soft;
  float* weight;  // written by the forward pass, read by the backward pass (soft only)
  int64_t ignore_index;
  float smoothing;
};

template <typename T, int VEC>
void launch_forward(const T* x, int64_t stride, const Targets& t, int64_t rows, int64_t vocab, float* loss,
                    float* lse, cudaStream_t stream) {
  if (t.soft)
    forward_kernel<T, VEC, true><<<grid_for(rows), kThreads, 0, stream>>>(x, stride, nullptr, t.soft, rows, vocab, 0,
                                                                          0.f, loss, lse, t.weight);
  else
    forward_kernel<T, VEC, false><<<grid_for(rows), kThreads, 0, stream>>>(x, stride, t.ids, nullptr, rows, vocab,
                                                                           t.ignore_index, t.smoothing, loss, lse,
                                                                           nullptr);
}

template <typename T>
const char* forward_as(const void* logits, int64_t stride, const Targets& t, int64_t rows, int64_t vocab, float* loss,
                       float* lse, cudaStream_t stream) {
  const T* x = static_cast<const T*>(logits);
  if (vectorizable<T>(stride, logits, logits))
    launch_forward<T, 16 / sizeof(T)>(x, stride, t, rows, vocab, loss, lse, stream);
  else
    launch_forward<T, 1>(x, stride, t, rows, vocab, loss, lse, stream);
  return launched();
}

template <typename T, int VEC>
void launch_backward(const T* x, int64_t stride, const Targets& t, const float* lse, const float* grad_sum,
                     int64_t rows, int64_t vocab, int64_t width, T* dx, cudaStream_t stream) {
  if (t.soft)
    backward_kernel<T, VEC, true><<<grid_for(rows), kThreads, 0, stream>>>(x, stride, nullptr, t.soft, t.weight, lse,
                                                                           grad_sum, rows, vocab, width, 0, 0.f, dx);
  else
    backward_kernel<T, VEC, false><<<grid_for(rows), kThreads, 0, stream>>>(
        x, stride, t.ids, nullptr, nullptr, lse, grad_sum, rows, vocab, width, t.ignore_index, t.smoothing, dx);
}

template <typename T>
const char* backward_as(const void* logits, int64_t stride, const Targets& t, const float* lse, const float* grad_sum,
                        int64_t rows, int64_t vocab, int64_t width, void* grad, cudaStream_t stream) {
  const T* x = static_cast<const T*>(logits);
  T* dx = static_cast<T*>(grad);
  if (vectorizable<T>(stride, logits, grad))
    launch_backward<T, 16 / sizeof(T)>(x, stride, t, lse, grad_sum, rows, vocab, width, dx, stream);
  else
    launch_backward<T, 1>(x, stride, t, lse, grad_sum, rows, vocab, width, dx, stream);
  return launched();
}

const char* forward(const void* logits, LogitsType type, int64_t row_stride, const Targets& t, int64_t rows,
                    int64_t vocab, float* loss, float* lse, void* stream) {
  if (rows == 0) return nullptr;
  if (vocab <= 0 || row_stride < vocab) return "cross_entropy_forward: rows of no logits, or overlapping rows";
  auto s = static_cast<cudaStream_t>(stream);
  switch (type) {
    case LogitsType::kFloat32: return forward_as<float>(logits, row_stride, t, rows, vocab, loss, lse, s);
    case LogitsType::kFloat16: return forward_as<__half>(logits, row_stride, t, rows, vocab, loss, lse, s);
    case LogitsType::kBFloat16: return forward_as<__nv_bfloat16>(logits, row_stride, t, rows, vocab, loss, lse, s);
  }
  return "cross_entropy_forward: unknown logits type";
}

const char* backward(const void* logits, LogitsType type, int64_t row_stride, const Targets& t, const float* lse,
                     const float* grad_sum, int64_t rows, int64_t vocab, int64_t width, void* grad, void* stream) {
  if (rows == 0) return nullptr;
  if (vocab <= 0 || width < vocab || row_stride < width)
    return "cross_entropy_backward: rows of no logits, or overlapping rows";
  auto s = static_cast<cudaStream_t>(stream);
  switch (type) {
    case LogitsType::kFloat32:
      return backward_as<float>(logits, row_stride, t, lse, grad_sum, rows, vocab, width, grad, s);
    case LogitsType::kFloat16:
      return backward_as<__half>(logits, row_stride, t, lse, grad_sum, rows, vocab, width, grad, s);
    case LogitsType::kBFloat16:
      return backward_as<__nv_bfloat16>(logits, row_stride, t, lse, grad_sum, rows, vocab, width, grad, s);
  }
  return "cross_entropy_backward: unknown logits type";
}

}  // namespace

const char* cross_entropy_forward(const void* logits, LogitsType type, int64_t row_stride, const int64_t* targets,
                                  int64_t rows, int64_t vocab, int64_t ignore_index, float label_smoothing,
                                  float* loss, float* lse, void* stream) {
  return forward(logits, type, row_stride, Targets{targets, nullptr, nullptr, ignore_index, label_smoothing}, rows,
                 vocab, loss, lse, stream);
}

const char* cross_entropy_backward(const void* logits, LogitsType type, int64_t row_stride, const int64_t* targets,
                                   const float* lse, const float* grad_sum, int64_t rows, int64_t vocab,
                                   int64_t width, int64_t ignore_index, float label_smoothing, void* grad,
                                   void* stream) {
  return backward(logits, type, row_stride, Targets{targets, nullptr, nullptr, ignore_index, label_smoothing}, lse,
                  grad_sum, rows, vocab, width, grad, stream);
}

const char* soft_cross_entropy_forward(const void* logits, LogitsType type, int64_t row_stride, const float* soft,
                                       int64_t rows, int64_t vocab, float* loss, float* lse, float* weight,
                                       void* stream) {
  if (!soft || !weight) return "soft_cross_entropy_forward: no targets";
  return forward(logits, type, row_stride, Targets{nullptr, soft, weight, 0, 0.f}, rows, vocab, loss, lse, stream);
}

const char* soft_cross_entropy_backward(const void* logits, LogitsType type, int64_t row_stride, const float* soft,
                                        const float* lse, const float* weight, const float* grad_sum, int64_t rows,
                                        int64_t vocab, int64_t width, void* grad, void* stream) {
  if (!soft || !weight) return "soft_cross_entropy_backward: no targets";
  return backward(logits, type, row_stride, Targets{nullptr, soft, const_cast<float*>(weight), 0, 0.f}, lse,
                  grad_sum, rows, vocab, width, grad, stream);
}

}  // namespace trainer::kernels
