// An exponential moving average of a model's weights (train.ema_decay), equal to timm's ModelEmaV3
// (timm/utils/model_ema.py) with its defaults: update_after_step 0, min_decay 0, warmup_gamma 1,
// warmup_power 2/3, foreach lerp, the average kept on the model's device in the model's dtypes, and
// exclude_buffers false:
//
//   after optimizer step s (1-based), when s % every == 0:
//     d = decay(s)                                        ModelEmaV3.get_decay(s), below
//     ema.lerp_(model, 1 - d)   for every floating parameter AND floating buffer (BatchNorm's
//                               running_mean and running_var are averaged, as ModelEmaV3 does by default)
//     ema.copy_(model)          for every integer buffer (num_batches_tracked is copied)
//
//   decay(s) = 0                                            for s <= 1 (the first update copies the model)
//            = decay                                        without warmup
//            = clamp(1 - (1 + (s - 1) / gamma)^-power, min_decay, decay)   with warmup (use_warmup)
//
// `every` is torchvision's --model-ema-steps (references/classification/train.py): the average is updated
// every N optimizer steps; the decay of an update is still decay(s) of the optimizer step s.
//
// Memory: the constructor allocates one copy of every parameter and buffer on the model's device (resident
// like the weights: build it before anything measures memory). update() allocates nothing: one in-place
// multi-tensor lerp (common/compat.h's foreach_lerp_) and in-place copies.
//
// The tensors are the model's state-dict entries (PyTorch's Module.state_dict order and names, undefined
// tensors skipped), so state() saves as a state dict that Python's torch.load and `trainer eval` read.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace trainer {

struct EmaOptions {
  double decay = 0.9999;          ///< the average's decay per update, in (0, 1) (ModelEmaV3's decay)
  double min_decay = 0.0;         ///< warmup: the decay is at least this
  bool warmup = false;            ///< ModelEmaV3's use_warmup: the decay grows with the step up to `decay`
  double warmup_gamma = 1.0;      ///< warmup: its inverse gamma
  double warmup_power = 2.0 / 3;  ///< warmup: its power
  int64_t every = 1;              ///< update after every N-th optimizer step (N >= 1)
};

/// ModelEmaV3.get_decay(step) with update_after_step 0: the decay of the update after optimizer step `step`.
double ema_decay(const EmaOptions& options, int64_t step);

/// The averaged copies of a model's parameters and buffers. Not copyable (it owns device memory).
class ModelEma {
 public:
  /// Copies (clone) every parameter and buffer of `model`, on its device: the average starts at the weights.
  /// Throws std::invalid_argument for a decay outside (0, 1) or every < 1, naming it.
  ModelEma(const torch::nn::Module& model, EmaOptions options);
  ModelEma(const ModelEma&) = delete;
  ModelEma& operator=(const ModelEma&) = delete;

  /// Whether the update after optimizer step `step` changes the average (step % every == 0).
  bool due(int64_t step) const { return step > 0 && step % options_.every == 0; }

  /// After optimizer step `step` of `model` (the module the average was built from, or one of the same
  /// structure): when due(step), the average moves toward the model's values (see the top of this file).
  /// Returns the decay used, or -1 when the step was not due. No gradient is recorded; nothing is allocated.
  double update(const torch::nn::Module& model, int64_t step);

  /// The average set to `model`'s values (ModelEmaV3.set): a start from the weights.
  void set(const torch::nn::Module& model);

  /// The averaged tensors by state-dict name, in state-dict order (they alias the average: no copy).
  std::vector<std::pair<std::string, torch::Tensor>> state() const;

  /// Loads `tensors` (a state dict by name, e.g. a checkpoint's ema.pt) into the average, in place: every
  /// name of the model must be there with its shape, and no other. Throws std::runtime_error naming
  /// `source` and the keys that do not fit; nothing is changed then.
  void load(const std::vector<std::pair<std::string, torch::Tensor>>& tensors, const std::string& source);

  /// Exchanges the model's values and the average's without copying (each tensor's storage is swapped:
  /// the model's tensors stay the same objects, so an optimizer's references hold). Calling it twice
  /// restores both. For an evaluation of the average inside training (see EmaSwap).
  void swap(torch::nn::Module& model);

  /// Copies the average into `model`'s parameters and buffers (for an export or an evaluation).
  void copy_into(torch::nn::Module& model) const;

  /// Device bytes the average holds.
  int64_t bytes() const;

  const EmaOptions& options() const { return options_; }

 private:
  struct Entry {
    std::string name;
    torch::Tensor value;  // the average; for an alias, the first entry's tensor
    int64_t alias_of;     // -1, or the index of the entry this name shares its model tensor with
  };
  EmaOptions options_;
  std::vector<Entry> entries_;
  std::vector<torch::Tensor> lerped_;  // the floating averages (no aliases), for the multi-tensor lerp
};

/// The average swapped into the model while it lives (ModelEma::swap on construction and destruction).
class EmaSwap {
 public:
  EmaSwap(ModelEma& ema, torch::nn::Module& model) : ema_(ema), model_(model) { ema_.swap(model_); }
  ~EmaSwap() { ema_.swap(model_); }
  EmaSwap(const EmaSwap&) = delete;
  EmaSwap& operator=(const EmaSwap&) = delete;

 private:
  ModelEma& ema_;
  torch::nn::Module& model_;
};

}  // namespace trainer
