#include "trainer/mix/mixing.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "data/pixels/rng.h"
#include "trainer/numerics/loss.h"

namespace trainer {
namespace {

constexpr uint64_t kMixStream = 0x6d6978ULL;  // "mix"

// A uniform double in (0, 1): the top 53 bits, centred in their interval (never 0, never 1).
double uniform(data::SplitMix64& rng) { return (static_cast<double>(rng.next() >> 11) + 0.5) * 0x1p-53; }

double normal(data::SplitMix64& rng) {  // Box-Muller, one of the pair
  const double u = uniform(rng), v = uniform(rng);
  return std::sqrt(-2.0 * std::log(u)) * std::cos(2.0 * M_PI * v);
}

// log of a Gamma(a, 1) variate: Marsaglia and Tsang (2000) for a >= 1; for a < 1, Gamma(a + 1) * U^(1/a),
// kept in logs so that a tiny alpha does not underflow to 0 / 0 in the Beta.
double log_gamma_sample(double a, data::SplitMix64& rng) {
  if (a < 1) {
    const double boost = std::log(uniform(rng)) / a;
    return log_gamma_sample(a + 1, rng) + boost;
  }
  const double d = a - 1.0 / 3.0, c = 1.0 / std::sqrt(9.0 * d);
  for (;;) {
    const double x = normal(rng);
    double v = 1.0 + c * x;
    if (v <= 0) continue;
    v = v * v * v;
    const double u = uniform(rng);
    if (u < 1.0 - 0.0331 * x * x * x * x || std::log(u) < 0.5 * x * x + d * (1.0 - v + std::log(v)))
      return std::log(d * v);
  }
}

double beta_from(double alpha, data::SplitMix64& rng) {
  const double lx = log_gamma_sample(alpha, rng), ly = log_gamma_sample(alpha, rng);
  return 1.0 / (1.0 + std::exp(ly - lx));  // X / (X + Y)
}

bool coin(data::SplitMix64& rng, double p) { return uniform(rng) < p; }

// One mixing decision, in timm's order: whether to mix, Mixup or CutMix, then lam.
struct Decision {
  bool mixed = false, cutmix = false;
  double lam = 1;
};

Decision decide(const MixOptions& o, data::SplitMix64& rng) {
  Decision d;
  if (!coin(rng, o.prob)) return d;
  d.mixed = true;
  if (o.mixup_alpha > 0 && o.cutmix_alpha > 0) d.cutmix = coin(rng, o.switch_prob);
  else d.cutmix = o.cutmix_alpha > 0;
  d.lam = beta_from(d.cutmix ? o.cutmix_alpha : o.mixup_alpha, rng);
  return d;
}

// The box and the corrected lam of one CutMix decision. Per element, timm's lam is a float32 and so is the
// arithmetic of its box (NumPy keeps float32 under a Python scalar).
void place_box(bool per_batch, int64_t h, int64_t w, data::SplitMix64& rng, MixDraw& out,
               size_t k) {
  out.cy[k] = static_cast<int64_t>(rng.below(static_cast<uint64_t>(h)));
  out.cx[k] = static_cast<int64_t>(rng.below(static_cast<uint64_t>(w)));
  out.box[k] = cutmix_box(h, w, out.drawn[k], out.cy[k], out.cx[k], /*in_float32=*/!per_batch);
  out.lam[k] = 1.0 - static_cast<double>(out.box[k].area()) / static_cast<double>(h * w);
}

MixBox clipped_box(int64_t h, int64_t w, int64_t cut_h, int64_t cut_w, int64_t cy, int64_t cx) {
  MixBox b;
  b.y0 = std::clamp<int64_t>(cy - cut_h / 2, 0, h);
  b.y1 = std::clamp<int64_t>(cy + (cut_h + 1) / 2, 0, h);
  b.x0 = std::clamp<int64_t>(cx - cut_w / 2, 0, w);
  b.x1 = std::clamp<int64_t>(cx + (cut_w + 1) / 2, 0, w);
  return b;
}

}  // namespace

void check_mix_options(const MixOptions& o) {
  auto bad = [](const std::string& what) { throw std::invalid_argument(what); };
  if (!(o.mixup_alpha >= 0)) bad("train.mixup_alpha must be >= 0 (0 = no Mixup)");
  if (!(o.cutmix_alpha >= 0)) bad("train.cutmix_alpha must be >= 0 (0 = no CutMix)");
  if (!(o.prob >= 0 && o.prob <= 1)) bad("train.mix_prob must be in [0, 1]");
  if (!(o.switch_prob >= 0 && o.switch_prob <= 1)) bad("train.mix_switch_prob must be in [0, 1]");
}

MixBox cutmix_box(int64_t height, int64_t width, double lam, int64_t cy, int64_t cx, bool in_float32) {
  if (in_float32) {
    const float ratio = std::sqrt(1.0f - static_cast<float>(lam));
    return clipped_box(height, width, static_cast<int64_t>(static_cast<float>(height) * ratio),
                       static_cast<int64_t>(static_cast<float>(width) * ratio), cy, cx);
  }
  const double ratio = std::sqrt(1.0 - lam);
  return clipped_box(height, width, static_cast<int64_t>(static_cast<double>(height) * ratio),
                     static_cast<int64_t>(static_cast<double>(width) * ratio), cy, cx);
}

bool MixDraw::any() const {
  return std::any_of(lam.begin(), lam.end(), [](double l) { return l != 1.0; }) ||
         std::any_of(cutmix.begin(), cutmix.end(), [](uint8_t c) { return c != 0; });
}

double beta_sample(double alpha, uint64_t key) {
  data::SplitMix64 rng(key);
  return beta_from(alpha, rng);
}

MixDraw draw_mix(const MixOptions& o, int64_t batch, int64_t height, int64_t width, uint64_t seed, int64_t step,
                 int64_t rank) {
  MixDraw out;
  out.per_batch = o.mode == MixMode::kBatch;
  const auto n = static_cast<size_t>(batch);
  out.lam.assign(n, 1.0);
  out.drawn.assign(n, 1.0);
  out.cutmix.assign(n, 0);
  out.box.assign(n, MixBox{});
  out.cy.assign(n, -1);
  out.cx.assign(n, -1);
  if (!o.enabled() || batch == 0) return out;
  data::SplitMix64 rng(data::hash_key(data::hash_key(seed, kMixStream), static_cast<uint64_t>(step),
                                      static_cast<uint64_t>(rank)));
  for (size_t k = 0; k < n; ++k) {
    if (out.per_batch && k > 0) {  // every sample shares the first one's decision
      out.lam[k] = out.lam[0], out.drawn[k] = out.drawn[0], out.cutmix[k] = out.cutmix[0];
      out.box[k] = out.box[0], out.cy[k] = out.cy[0], out.cx[k] = out.cx[0];
      continue;
    }
    const Decision d = decide(o, rng);
    if (!d.mixed) continue;
    out.drawn[k] = out.per_batch ? d.lam : static_cast<double>(static_cast<float>(d.lam));
    out.lam[k] = out.drawn[k];
    out.cutmix[k] = d.cutmix;
    if (d.cutmix) {
      place_box(out.per_batch, height, width, rng, out, k);
      if (!o.correct_lam) out.lam[k] = out.drawn[k];  // the drawn lam, whatever the clipping did
    }
    if (!out.per_batch) out.lam[k] = static_cast<double>(static_cast<float>(out.lam[k]));
  }
  return out;
}

namespace {

void check_rows(const MixDraw& draw, int64_t offset, int64_t n, const char* what) {
  if (offset < 0 || offset + n > draw.size())
    throw std::invalid_argument(std::string(what) + ": rows [" + std::to_string(offset) + ", " +
                                std::to_string(offset + n) + ") outside a draw of " + std::to_string(draw.size()));
}

// lam and 1 - lam of rows [offset, offset + n) as float32 (n) tensors on `device`: batch mode as timm
// scales by a Python float (1 - lam in double), element mode by float32 arrays (1 - lam in float32).
std::pair<torch::Tensor, torch::Tensor> lam_columns(const MixDraw& draw, int64_t offset, int64_t n,
                                                    const torch::Device& device) {
  std::vector<float> lam(static_cast<size_t>(n)), rest(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const double l = draw.lam[static_cast<size_t>(offset + i)];
    lam[i] = static_cast<float>(l);
    rest[i] = draw.per_batch ? static_cast<float>(1.0 - l) : 1.0f - static_cast<float>(l);
  }
  auto opts = torch::TensorOptions().dtype(torch::kFloat);
  return {torch::from_blob(lam.data(), {n}, opts).clone().to(device),
          torch::from_blob(rest.data(), {n}, opts).clone().to(device)};
}

}  // namespace

torch::Tensor mix_images(const torch::Tensor& x, const torch::Tensor& partner, const MixDraw& draw, int64_t offset) {
  const int64_t n = x.size(0);
  check_rows(draw, offset, n, "mix_images");
  if (partner.sizes() != x.sizes()) throw std::invalid_argument("mix_images: partner images of another shape");
  auto [lam, rest] = lam_columns(draw, offset, n, x.device());
  // Mixup rows blend (CutMix rows keep lam 1 here: their pixels are copied below).
  std::vector<float> blend(static_cast<size_t>(n), 0.0f);
  for (int64_t i = 0; i < n; ++i) blend[i] = draw.cutmix[offset + i] ? 0.0f : 1.0f;
  auto is_blend = torch::from_blob(blend.data(), {n}, torch::kFloat).clone().to(x.device()).to(torch::kBool);
  auto shape = std::vector<int64_t>{n, 1, 1, 1};
  auto mixed = x * lam.view(shape) + partner * rest.view(shape);
  auto out = torch::where(is_blend.view(shape), mixed, x);
  if (draw.per_batch && n > 0 && draw.cutmix[offset]) {  // one box for every row: one copy
    const MixBox& b = draw.box[offset];
    out.narrow(2, b.y0, b.y1 - b.y0).narrow(3, b.x0, b.x1 - b.x0)
        .copy_(partner.narrow(2, b.y0, b.y1 - b.y0).narrow(3, b.x0, b.x1 - b.x0));
    return out;
  }
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<size_t>(offset + i);
    if (!draw.cutmix[k] || draw.box[k].area() == 0) continue;
    const MixBox& b = draw.box[k];
    out[i].narrow(1, b.y0, b.y1 - b.y0).narrow(2, b.x0, b.x1 - b.x0)
        .copy_(partner[i].narrow(1, b.y0, b.y1 - b.y0).narrow(2, b.x0, b.x1 - b.x0));
  }
  return out;
}

torch::Tensor mix_targets(const torch::Tensor& labels, const torch::Tensor& partner_labels, const MixDraw& draw,
                          int64_t offset, int64_t classes, double label_smoothing) {
  const int64_t n = labels.numel();
  check_rows(draw, offset, n, "mix_targets");
  auto [lam, rest] = lam_columns(draw, offset, n, labels.device());
  return smoothed_one_hot(labels, classes, label_smoothing) * lam.unsqueeze(1) +
         smoothed_one_hot(partner_labels, classes, label_smoothing) * rest.unsqueeze(1);
}

}  // namespace trainer
