// The resize filter of the image decoders (data/pixels/jpeg.h): Pillow's BILINEAR resampling
// (libImaging/Resample.c), reimplemented.
//
// Why this filter: it is the one torchvision applies to PIL images (Resize, RandomResizedCrop), so the
// trainer's inputs have the statistics a torchvision-trained model expects, and the eval transform can be
// compared with torchvision pixel for pixel. Its support widens with the reduction (antialiasing). Both
// passes work in 32-bit integers with 22-bit fixed-point weights, as Pillow's do: a horizontal pass into
// 8-bit rows, then a vertical pass.
//
// Two kernels compute the same bytes:
//   - plain: Pillow's loops as they are, the reference;
//   - avx2: the same integer sums eight lanes at a time (x86-64 CPUs with AVX2, picked at run time). The
//     horizontal pass takes a pixel's taps two at a time ([R G B 0] per tap in eight 32-bit lanes) and
//     four rows at a time (they share the positions and weights); the vertical pass takes 32 bytes of a
//     row at a time. Integer sums do not depend on their order, so its bytes equal the plain kernel's
//     (tests/test_jpeg.cpp checks it on random boxes and sizes).
// With the plain kernel the resize took 47% of the train transform's time on ~500x375 photos (perf);
// with avx2, 20%. docs/BENCHMARKS.md has the side-by-side figure (`trainer bench --decode-only
// --resize-kernel plain|auto`).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace data {

constexpr int kResizePrecisionBits = 32 - 8 - 2;

/// Weights of one pass: output sample i reads `count[i]` inputs from `first[i]` with weights
/// `w[i * ksize ...]` in fixed point (the rest of each row of `w` is 0).
struct ResizeCoeffs {
  int ksize = 0;
  std::vector<int> first, count;
  std::vector<int32_t> w;
};

/// Pillow's precompute_coeffs for the triangle filter (support 1) over the box [in0, in1) of an input of
/// in_size samples, to out_size outputs, then normalize_coeffs_8bpc.
ResizeCoeffs bilinear_coeffs(int in_size, double in0, double in1, int out_size);

enum class ResizeKernel { Auto, Plain, Avx2 };

/// The kernel Auto runs: the one forced, else Avx2 where the CPU has it, else Plain.
ResizeKernel resize_kernel_auto();
/// Makes Auto mean `k` in this process (Auto: the CPU's best again). For `trainer bench --decode-only
/// --resize-kernel`, which measures the kernels side by side.
void force_resize_kernel(ResizeKernel k);
/// "plain" or "avx2" (Auto is resolved first).
const char* resize_kernel_name(ResizeKernel k);

/// Resizes with the coefficients `cx`, `cy`, which index a whole image; its rows [row0, ...) and columns
/// [col0, ...) are in `src`, `stride` bytes a row, RGB, and `src_end` is one past the last byte of `src`
/// that may be read (the avx2 kernel reads a few bytes past a pixel's last tap when they are there).
/// Writes out_h x out_w RGB to `out`, mirrored left to right if `hflip`. Avx2 on a CPU without it runs
/// Plain.
void resample(const uint8_t* src, size_t stride, const uint8_t* src_end, int col0, int row0, const ResizeCoeffs& cx,
              const ResizeCoeffs& cy, int out_w, int out_h, bool hflip, uint8_t* out,
              ResizeKernel kernel = ResizeKernel::Auto);

}  // namespace data
