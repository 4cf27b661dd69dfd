// The model and what updates it, one part of TrainingRun (run.h): the device, the forward's options
// (shared by training and evaluation), the model, its optimizer, the GradScaler, and under
// train.ema_decay the averaged weights. Built once at setup; the step (trainer/step/step.h) and the
// checkpoints (resume.cpp) work on them.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "models/model.h"
#include "trainer/config/config.h"
#include "trainer/numerics/amp.h"
#include "trainer/numerics/ema.h"
#include "trainer/numerics/forward.h"
#include "trainer/numerics/optim.h"
#include "trainer/step/evaluate.h"

namespace trainer {

class TrainedModel {
 public:
  explicit TrainedModel(const Config& cfg) : cfg_(cfg) {}

  /// This rank's device (setup_distributed).
  void set_device(const torch::Device& device) { device_ = device; }
  /// The model of `sample_shape` (a token job: `tokens`), with model.init_from's weights, on the device,
  /// and its optimizer; the seed is the run's.
  void build(const std::vector<int64_t>& sample_shape, bool tokens);
  /// The GradScaler (amp.scaler; disabled unless fp16).
  void make_scaler();
  /// train.ema_decay: the average, after build() (resident before the search and step 1).
  void setup_ema();
  /// train.ema_decay: after each optimizer step (ModelEma::update decides if it is due).
  void update_ema(int64_t step);
  /// `evaluate` with the averaged weights swapped in; back to the trained weights when it returns or throws.
  EvalResult evaluate_ema(const std::function<EvalResult()>& evaluate);
  /// memory.state auto after a give-up with int8 moments: the weights (and buffers) rounded to nearest
  /// bfloat16 in place, the gradients dropped, the optimizer on its bfloat16 update with stochastic
  /// rounding, float inputs cast to bfloat16 from now on. The config must allow it (AdamW on the CPU).
  void store_weights_in_bfloat16();

  const torch::Device& device() const { return device_; }
  /// device, channels_last, autocast: training and evaluation alike (setup_data adds uint8 images' statistics).
  ForwardOptions& forward() { return forward_; }
  const ForwardOptions& forward() const { return forward_; }
  double flops_per_sample() const { return flops_per_sample_; }  ///< forward
  int64_t vocab() const { return vocab_; }  ///< a language model's vocabulary (0: images)
  models::Model& model() { return model_; }
  const models::Model& model() const { return model_; }
  Optimizer& optimizer() { return *optimizer_; }
  const Optimizer& optimizer() const { return *optimizer_; }
  ModelEma* ema() const { return ema_.get(); }  ///< null unless train.ema_decay > 0
  GradScaler& scaler() const { return *scaler_; }
  /// model.lora: the frozen base's fingerprint (trainer/run/lora.h); null json without LoRA.
  const nlohmann::json& lora_base() const { return lora_base_; }

 private:
  const Config& cfg_;
  torch::Device device_{torch::kCPU};
  nlohmann::json lora_base_;
  ForwardOptions forward_;  // device, channels_last, autocast: training and evaluation alike
  double flops_per_sample_ = 0;        // forward
  int64_t vocab_ = 0;                  // a language model's vocabulary (wte may have more rows: model.vocab_multiple)
  models::Model model_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<ModelEma> ema_;  // train.ema_decay > 0: the averaged weights, on device_
  std::unique_ptr<GradScaler> scaler_;
};

}  // namespace trainer
