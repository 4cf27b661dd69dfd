// Mixup and CutMix, with timm's semantics (timm.data.Mixup, modes `batch` and `elem`), and the soft
// targets they make.
//
//   mixup   x_k <- lam * x_k + (1 - lam) * x_partner(k)
//   cutmix  x_k <- x_k with the box [y0, y1) x [x0, x1) taken from x_partner(k); lam <- 1 - box area / H W
//           (timm's correct_lam)
//   target  t_k = lam * smooth(y_k) + (1 - lam) * smooth(y_partner(k)),
//           smooth(y) = (1 - s) one_hot(y) + s / classes   (train.label_smoothing folded in once, as
//           timm's mixup_target and PyTorch's label_smoothing define it)
//
// partner(k) = B - 1 - k over the rank's batch of B samples (timm's x.flip(0)). Where timm mixes each batch
// it is given, the trainer mixes the rank's whole share of the global batch, whatever the micro-batch:
// micro-batch [offset, offset + n) is mixed with the mirrored slice, so a backoff, a grow-back or another
// micro-batch size changes nothing of what is mixed, and the step over accumulated micro-batches equals
// the step over one batch (the trainer's promise for every step). Under data parallel each rank mixes
// within its own share, as each process does with timm.
//
// Every draw comes from (seed, step, rank) alone (splitmix64 streams, data/pixels/rng.h): a step retried
// after an out-of-memory error, and a resumed run, draw the same lambdas and boxes bit for bit. The draws
// are timm's, in timm's order (per batch: the mix coin, the switch coin, lam ~ Beta(alpha, alpha), then for
// CutMix the box centre cy, cx, uniform integers in [0, H) and [0, W); per element: the same per sample),
// from our own generator, not NumPy's.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/config/config.h"

namespace trainer {

struct MixOptions {
  double mixup_alpha = 0;   ///< train.mixup_alpha: Beta(alpha, alpha) for Mixup's lam; 0 = no Mixup
  double cutmix_alpha = 0;  ///< train.cutmix_alpha: Beta(alpha, alpha) for CutMix's lam; 0 = no CutMix
  double prob = 1.0;        ///< train.mix_prob: probability that a batch (an element) is mixed at all
  double switch_prob = 0.5; ///< train.mix_switch_prob: with both alphas, probability of CutMix over Mixup
  MixMode mode = MixMode::kBatch;  ///< train.mix_mode: batch (one lam and box per batch) | elem (per sample)
  bool correct_lam = true;  ///< lam from the clipped box's area (timm's correct_lam)

  bool enabled() const { return mixup_alpha > 0 || cutmix_alpha > 0; }
};

/// Throws std::invalid_argument naming the first bad field (alphas >= 0, probabilities in [0, 1]).
void check_mix_options(const MixOptions& o);

/// A CutMix box in a H x W image: rows [y0, y1), columns [x0, x1) (empty when y0 == y1 or x0 == x1).
struct MixBox {
  int64_t y0 = 0, y1 = 0, x0 = 0, x1 = 0;
  int64_t area() const { return (y1 - y0) * (x1 - x0); }
};

/// timm's rand_bbox with margin 0 given the centre (cy, cx): cut = int(side * sqrt(1 - lam)) per side, the
/// box [c - cut / 2, c + (cut + 1) / 2) clipped to the image. `in_float32`: the ratio in float32, as timm
/// computes it per element (its lam is then a NumPy float32), rather than in double (per batch).
MixBox cutmix_box(int64_t height, int64_t width, double lam, int64_t cy, int64_t cx, bool in_float32 = false);

/// What one rank mixes in one step: per sample k of its B, lam[k] (1: unmixed) and, where cutmix[k],
/// the box it takes from its partner (lam[k] then the box's corrected lam).
struct MixDraw {
  bool per_batch = true;        ///< batch mode: lam in double, as timm's float (elem: float32, as timm's array)
  std::vector<double> lam;      ///< the lam the targets use (after CutMix's correction)
  std::vector<uint8_t> cutmix;
  std::vector<MixBox> box;
  std::vector<double> drawn;    ///< the Beta variate before the correction (1 where not mixed)
  std::vector<int64_t> cy, cx;  ///< CutMix's box centres (-1 where not CutMix)

  int64_t size() const { return static_cast<int64_t>(lam.size()); }
  /// Whether any sample is mixed (false: the step runs as without Mixup).
  bool any() const;
};

/// The draw of step `step` (1-based optimizer step) on rank `rank` for `batch` samples of height x
/// width, from `seed` alone. Batch mode: every sample shares the batch's lam and box.
MixDraw draw_mix(const MixOptions& o, int64_t batch, int64_t height, int64_t width, uint64_t seed, int64_t step,
                 int64_t rank);

/// A Beta(alpha, alpha) variate from a splitmix64 stream keyed by `key` (Marsaglia and Tsang's gamma
/// method, X / (X + Y)); exposed for its test.
double beta_sample(double alpha, uint64_t key);

/// Micro-batch [offset, offset + x.size(0)) of a batch of draw.size() samples, mixed: `x` (n, C, H, W)
/// float images of those samples, `partner` the images of their partners (sample B - 1 - k for row
/// k - offset), both on one device in any memory format. Returns the mixed images (x's memory format).
torch::Tensor mix_images(const torch::Tensor& x, const torch::Tensor& partner, const MixDraw& draw, int64_t offset);

/// The soft targets of the same rows: (n, classes) float32 on labels' device, from smoothed_one_hot
/// (trainer/numerics/loss.h). A label outside [0, classes) (an undecodable sample's -100) contributes
/// nothing: its share of the row is zero.
torch::Tensor mix_targets(const torch::Tensor& labels, const torch::Tensor& partner_labels, const MixDraw& draw,
                          int64_t offset, int64_t classes, double label_smoothing);

}  // namespace trainer
