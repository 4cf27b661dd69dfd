#include "data/pixels/resize.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#define TRAINER_RESIZE_X86 1
#else
#define TRAINER_RESIZE_X86 0
#endif

namespace data {

ResizeCoeffs bilinear_coeffs(int in_size, double in0, double in1, int out_size) {
  const double scale = (in1 - in0) / out_size;
  const double filterscale = std::max(scale, 1.0);
  const double support = 1.0 * filterscale;
  ResizeCoeffs c;
  c.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  c.first.resize(out_size);
  c.count.resize(out_size);
  c.w.assign(static_cast<size_t>(out_size) * c.ksize, 0);
  std::vector<double> k(c.ksize);
  const double ss = 1.0 / filterscale;
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = in0 + (xx + 0.5) * scale;
    int xmin = static_cast<int>(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = static_cast<int>(center + support + 0.5);
    if (xmax > in_size) xmax = in_size;
    xmax -= xmin;
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      double t = (x + xmin - center + 0.5) * ss;
      t = t < 0 ? -t : t;
      const double w = t < 1.0 ? 1.0 - t : 0.0;
      k[x] = w;
      ww += w;
    }
    for (int x = 0; x < xmax; ++x) {
      const double w = ww != 0.0 ? k[x] / ww : k[x];
      c.w[static_cast<size_t>(xx) * c.ksize + x] =
          static_cast<int32_t>(w < 0 ? w * (1 << kResizePrecisionBits) - 0.5 : w * (1 << kResizePrecisionBits) + 0.5);
    }
    c.first[xx] = xmin;
    c.count[xx] = std::max(xmax, 0);
  }
  return c;
}

namespace {

constexpr int32_t kHalf = 1 << (kResizePrecisionBits - 1);

inline uint8_t clip8(int32_t v) {
  v >>= kResizePrecisionBits;
  return static_cast<uint8_t>(v < 0 ? 0 : v > 255 ? 255 : v);
}

/// The rows [ylo, yhi) of the image that the vertical pass reads.
void vertical_span(const ResizeCoeffs& cy, int out_h, int* ylo, int* yhi) {
  *ylo = std::numeric_limits<int>::max();
  *yhi = 0;
  for (int i = 0; i < out_h; ++i) {
    *ylo = std::min(*ylo, cy.first[i]);
    *yhi = std::max(*yhi, cy.first[i] + cy.count[i]);
  }
  if (*yhi <= *ylo) *ylo = *yhi = 0;
}

/// One output pixel of the horizontal pass, the plain way: `p` is the pixel at cx.first[xx].
inline void horizontal_pixel(const uint8_t* p, const int32_t* k, int count, uint8_t* o) {
  int32_t s0 = kHalf, s1 = kHalf, s2 = kHalf;
  for (int x = 0; x < count; ++x) {
    s0 += p[3 * x] * k[x];
    s1 += p[3 * x + 1] * k[x];
    s2 += p[3 * x + 2] * k[x];
  }
  o[0] = clip8(s0);
  o[1] = clip8(s1);
  o[2] = clip8(s2);
}

/// Pillow's two passes as Pillow writes them: horizontal into 8-bit rows (only the rows the vertical
/// pass reads), then vertical, mirroring while it writes.
void resample_plain(const uint8_t* src, size_t stride, int col0, int row0, const ResizeCoeffs& cx,
                    const ResizeCoeffs& cy, int out_w, int out_h, bool hflip, uint8_t* out) {
  int ylo, yhi;
  vertical_span(cy, out_h, &ylo, &yhi);
  const int mid_rows = yhi - ylo;
  std::vector<uint8_t> mid(static_cast<size_t>(mid_rows) * out_w * 3);
  for (int r = 0; r < mid_rows; ++r) {
    const uint8_t* in = src + static_cast<size_t>(ylo + r - row0) * stride;
    uint8_t* o = mid.data() + static_cast<size_t>(r) * out_w * 3;
    for (int xx = 0; xx < out_w; ++xx)
      horizontal_pixel(in + static_cast<size_t>(cx.first[xx] - col0) * 3, cx.w.data() + static_cast<size_t>(xx) * cx.ksize,
                       cx.count[xx], o + 3 * xx);
  }
  const size_t row_bytes = static_cast<size_t>(out_w) * 3;
  std::vector<int32_t> acc(row_bytes);
  for (int yy = 0; yy < out_h; ++yy) {
    const int32_t* k = cy.w.data() + static_cast<size_t>(yy) * cy.ksize;
    std::fill(acc.begin(), acc.end(), kHalf);
    for (int y = 0; y < cy.count[yy]; ++y) {
      const uint8_t* m = mid.data() + static_cast<size_t>(cy.first[yy] + y - ylo) * row_bytes;
      const int32_t ky = k[y];
      for (size_t i = 0; i < row_bytes; ++i) acc[i] += m[i] * ky;
    }
    uint8_t* o = out + static_cast<size_t>(yy) * row_bytes;
    if (!hflip) {
      for (size_t i = 0; i < row_bytes; ++i) o[i] = clip8(acc[i]);
    } else {
      for (int xx = 0; xx < out_w; ++xx)
        for (int ch = 0; ch < 3; ++ch) o[3 * (out_w - 1 - xx) + ch] = clip8(acc[3 * xx + ch]);
    }
  }
}

#if TRAINER_RESIZE_X86

/// One output pixel of the horizontal pass over R rows `stride` bytes apart, from `p` (the pixel at
/// cx.first[xx] in the first row), with the weights `k` of horizontal_rows_avx2; stored to `o`, out_w * 3
/// bytes a row. STORE bytes a pixel: 4 writes the pixel's RGB and one byte after it, 3 writes RGB alone.
template <int R, int STORE>
__attribute__((target("avx2"))) inline void horizontal_pixel_avx2(const uint8_t* p, size_t stride, const int32_t* k,
                                                                  int n, uint8_t* o, size_t row_bytes) {
  const __m128i spread = _mm_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  __m256i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
  for (int j = 0; j < n; ++j) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + 8 * j));
    for (int r = 0; r < R; ++r) {
      const __m128i two = _mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + r * stride + 6 * j)), spread);
      acc[r] = _mm256_add_epi32(acc[r], _mm256_mullo_epi32(_mm256_cvtepu8_epi32(two), w));  // [R G B 0 R' G' B' 0]
    }
  }
  for (int r = 0; r < R; ++r) {
    __m128i s = _mm_add_epi32(_mm_add_epi32(_mm256_castsi256_si128(acc[r]), _mm256_extracti128_si256(acc[r], 1)),
                              _mm_set1_epi32(kHalf));
    s = _mm_srai_epi32(s, kResizePrecisionBits);
    s = _mm_packus_epi16(_mm_packs_epi32(s, s), s);  // the clamp to [0, 255] of clip8
    const uint32_t rgbx = static_cast<uint32_t>(_mm_cvtsi128_si32(s));
    std::memcpy(o + r * row_bytes, &rgbx, STORE);
  }
}

/// The horizontal pass over R rows `stride` bytes apart from `in`, into R rows of `o`. The rows share each
/// pixel's position and weights, so they are done together. `wx` holds the weights in pairs of taps
/// spread over a pixel's lanes (see resample_avx2). A pixel is stored as 4 bytes, the 4th overwritten by
/// the next pixel; a row's last pixel stores 3, as the next row may already be there.
template <int R>
__attribute__((target("avx2"))) inline void horizontal_rows_avx2(const uint8_t* in, size_t stride,
                                                                 const uint8_t* src_end, int col0,
                                                                 const ResizeCoeffs& cx, const int32_t* wx, int pairs,
                                                                 int out_w, bool hflip, uint8_t* o) {
  const size_t row_bytes = static_cast<size_t>(out_w) * 3;
  for (int q = 0; q < out_w; ++q) {  // q: where the pixel is stored; xx: which one it is
    const int xx = hflip ? out_w - 1 - q : q;
    const uint8_t* p = in + static_cast<size_t>(cx.first[xx] - col0) * 3;
    const int n = (cx.count[xx] + 1) / 2;
    if (static_cast<size_t>(src_end - (p + (R - 1) * stride)) < static_cast<size_t>(6 * n + 2)) {
      // The last pair's 8-byte load of the last row would pass the end of `src`: the plain way.
      for (int r = 0; r < R; ++r)
        horizontal_pixel(p + r * stride, cx.w.data() + static_cast<size_t>(xx) * cx.ksize, cx.count[xx],
                         o + r * row_bytes + 3 * q);
      continue;
    }
    const int32_t* k = wx + static_cast<size_t>(xx) * pairs * 8;
    if (q + 1 < out_w)
      horizontal_pixel_avx2<R, 4>(p, stride, k, n, o + 3 * q, row_bytes);
    else
      horizontal_pixel_avx2<R, 3>(p, stride, k, n, o + 3 * q, row_bytes);
  }
}

/// The same sums as resample_plain, eight 32-bit lanes at a time. The mirror moves into the horizontal
/// pass (a mirrored row resized vertically is the vertical resize mirrored), so the vertical pass stores
/// whole vectors.
__attribute__((target("avx2"))) void resample_avx2(const uint8_t* src, size_t stride, const uint8_t* src_end, int col0,
                                                   int row0, const ResizeCoeffs& cx, const ResizeCoeffs& cy, int out_w,
                                                   int out_h, bool hflip, uint8_t* out) {
  int ylo, yhi;
  vertical_span(cy, out_h, &ylo, &yhi);
  const int mid_rows = yhi - ylo;
  const size_t row_bytes = static_cast<size_t>(out_w) * 3;

  // Horizontal weights in pairs of taps, each spread over a pixel's four lanes: [k0 k0 k0 k0 k1 k1 k1 k1].
  // A pixel with an odd count gets a zero weight for the tap after its last; that tap's bytes are read
  // (they lie inside `src` or the pixel takes the plain path) and add nothing.
  const int pairs = (cx.ksize + 1) / 2;
  std::vector<int32_t> wx(static_cast<size_t>(out_w) * pairs * 8);
  for (int xx = 0; xx < out_w; ++xx)
    for (int t = 0; t < cx.count[xx]; ++t)
      for (int lane = 0; lane < 4; ++lane)
        wx[(static_cast<size_t>(xx) * pairs + t / 2) * 8 + (t % 2) * 4 + lane] = cx.w[static_cast<size_t>(xx) * cx.ksize + t];

  std::vector<uint8_t> mid(static_cast<size_t>(mid_rows) * row_bytes);
  int r = 0;
  for (; r + 4 <= mid_rows; r += 4)
    horizontal_rows_avx2<4>(src + static_cast<size_t>(ylo + r - row0) * stride, stride, src_end, col0, cx, wx.data(),
                            pairs, out_w, hflip, mid.data() + static_cast<size_t>(r) * row_bytes);
  for (; r < mid_rows; ++r)
    horizontal_rows_avx2<1>(src + static_cast<size_t>(ylo + r - row0) * stride, stride, src_end, col0, cx, wx.data(),
                            pairs, out_w, hflip, mid.data() + static_cast<size_t>(r) * row_bytes);

  // Vertical: 32 bytes of an output row at a time, in four accumulators of eight lanes.
  const __m256i half8 = _mm256_set1_epi32(kHalf);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int yy = 0; yy < out_h; ++yy) {
    const int32_t* k = cy.w.data() + static_cast<size_t>(yy) * cy.ksize;
    const int n = cy.count[yy];
    const uint8_t* base = mid.data() + static_cast<size_t>(cy.first[yy] - ylo) * row_bytes;
    uint8_t* o = out + static_cast<size_t>(yy) * row_bytes;
    size_t i = 0;
    for (; i + 32 <= row_bytes; i += 32) {
      __m256i a0 = half8, a1 = half8, a2 = half8, a3 = half8;
      for (int y = 0; y < n; ++y) {
        const __m256i w = _mm256_set1_epi32(k[y]);
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + static_cast<size_t>(y) * row_bytes + i));
        const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
        a0 = _mm256_add_epi32(a0, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(lo), w));
        a1 = _mm256_add_epi32(a1, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)), w));
        a2 = _mm256_add_epi32(a2, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(hi), w));
        a3 = _mm256_add_epi32(a3, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)), w));
      }
      a0 = _mm256_srai_epi32(a0, kResizePrecisionBits);
      a1 = _mm256_srai_epi32(a1, kResizePrecisionBits);
      a2 = _mm256_srai_epi32(a2, kResizePrecisionBits);
      a3 = _mm256_srai_epi32(a3, kResizePrecisionBits);
      // packs/packus work within 128-bit halves: the dwords come out as bytes [0-3 8-11 16-19 24-27 | 4-7
      // 12-15 20-23 28-31]; `order` puts them back.
      const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(a0, a1), _mm256_packs_epi32(a2, a3));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), _mm256_permutevar8x32_epi32(bytes, order));
    }
    for (; i < row_bytes; ++i) {
      int32_t s = kHalf;
      for (int y = 0; y < n; ++y) s += base[static_cast<size_t>(y) * row_bytes + i] * k[y];
      o[i] = clip8(s);
    }
  }
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}

#endif  // TRAINER_RESIZE_X86

}  // namespace

namespace {
std::atomic<int> forced_kernel{static_cast<int>(ResizeKernel::Auto)};
}

void force_resize_kernel(ResizeKernel k) { forced_kernel = static_cast<int>(k); }

ResizeKernel resize_kernel_auto() {
  const auto forced = static_cast<ResizeKernel>(forced_kernel.load());
  if (forced != ResizeKernel::Auto) return forced;
#if TRAINER_RESIZE_X86
  if (cpu_has_avx2()) return ResizeKernel::Avx2;
#endif
  return ResizeKernel::Plain;
}

const char* resize_kernel_name(ResizeKernel k) {
  if (k == ResizeKernel::Auto) k = resize_kernel_auto();
  return k == ResizeKernel::Avx2 ? "avx2" : "plain";
}

void resample(const uint8_t* src, size_t stride, const uint8_t* src_end, int col0, int row0, const ResizeCoeffs& cx,
              const ResizeCoeffs& cy, int out_w, int out_h, bool hflip, uint8_t* out, ResizeKernel kernel) {
  if (kernel == ResizeKernel::Auto) kernel = resize_kernel_auto();
#if TRAINER_RESIZE_X86
  if (kernel == ResizeKernel::Avx2 && cpu_has_avx2())
    return resample_avx2(src, stride, src_end, col0, row0, cx, cy, out_w, out_h, hflip, out);
#else
  (void)src_end;
#endif
  resample_plain(src, stride, col0, row0, cx, cy, out_w, out_h, hflip, out);
}

}  // namespace data
