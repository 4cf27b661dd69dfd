// TrainedModel: the model and what updates it (trained_model.h).
#include "trainer/run/trained_model.h"

#include <spdlog/spdlog.h>

#include "models/registry.h"
#include "models/summary.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/resources.h"
#include "trainer/run/from_config.h"
#include "trainer/run/lora.h"

namespace trainer {

namespace {

void warn_without_bfloat16_instructions() {
  if (!cpu_has_bfloat16())
    spdlog::warn("model.param_dtype bfloat16: this CPU has no bfloat16 instructions (avx512_bf16, amx_bf16); "
                 "LibTorch emulates its bfloat16 matmuls, many times slower than float32's: the weights take "
                 "half the memory, the steps far more time");
}

// model.to(bfloat16), then LoRA's adapters back to float32 (peft's: the base in bfloat16, the adapters in
// float32, the adapter's term computed in float32).
void to_bfloat16_keeping_adapters(torch::nn::Module& model) {
  model.to(torch::kBFloat16);
  for (auto& [name, layer] : models::lora_layers(model)) {
    layer->lora_A->to(torch::kFloat);
    layer->lora_B->to(torch::kFloat);
  }
}

}  // namespace

void TrainedModel::build(const std::vector<int64_t>& sample_shape, bool tokens) {
  torch::manual_seed(cfg_.seed);
  vocab_ = tokens ? vocab_size(cfg_) : 0;
  model_ = build_model(cfg_, sample_shape, vocab_);
  if (!cfg_.model.init_from.empty()) load_init_weights(*model_, cfg_, vocab_);
  // LoRA: the base's fingerprint is taken in float32, before the weights may move to bfloat16.
  lora_base_ = apply_lora(*model_, cfg_);
  // bfloat16 weights: initialized (or loaded) in float32 as always, then rounded to nearest, parameters and
  // buffers alike, as PyTorch's model.to(torch.bfloat16). LoRA's adapters stay float32.
  if (cfg_.model.param_dtype == ParamDtype::kBfloat16) {
    if (device_.is_cuda())
      throw ConfigError("config: key 'model.param_dtype': bfloat16 weights run on the CPU only (on " + device_.str() +
                        " use float32 with amp.enabled)");
    to_bfloat16_keeping_adapters(*model_);
    warn_without_bfloat16_instructions();
  }
  model_->to(device_);
  if (cfg_.model.channels_last && !tokens) models::to_channels_last(*model_);
  optimizer_ = std::make_unique<Optimizer>(param_slots(*model_, cfg_.optim.decay_norm_and_bias), cfg_.optim);
  optimizer_->set_rounding_seed(static_cast<uint64_t>(cfg_.seed));
  flops_per_sample_ = model_->forward_flops(sample_shape);
  spdlog::info("model: {} with {} parameters, {:.3f} GFLOPs per sample forward", cfg_.model.name,
               models::count_parameters(*model_), flops_per_sample_ / 1e9);
}

void TrainedModel::store_weights_in_bfloat16() {
  optimizer_->zero_grad();  // float32 gradients would not accumulate into bfloat16 weights
  // Parameter by parameter (Module::to sets each one's data): the optimizer's handles stay valid, and beyond
  // the float32 weights one tensor's bfloat16 copy at a time is allocated.
  to_bfloat16_keeping_adapters(*model_);
  // With LoRA the trained weights are the adapters, which stay float32: AdamW's update is unchanged.
  if (lora_base_.is_null()) optimizer_->use_bfloat16_weights(/*stochastic=*/true);
  forward_.param_dtype = torch::kBFloat16;
  warn_without_bfloat16_instructions();
}

void TrainedModel::make_scaler() {
  GradScalerOptions so;
  so.enabled(loss_scaling(cfg_));
  so.init_scale(cfg_.amp.init_scale).growth_factor(cfg_.amp.growth_factor).backoff_factor(cfg_.amp.backoff_factor)
      .growth_interval(cfg_.amp.growth_interval);
  scaler_ = std::make_unique<GradScaler>(so);
}

void TrainedModel::setup_ema() {
  if (cfg_.train.ema_decay == 0) return;
  // Now, before the micro-batch search and the first step: the copy is resident device memory that the
  // ladder's decisions must see. Under data parallel every rank starts from the broadcast weights and
  // keeps its own average of identical weights (rank 0's is saved).
  EmaOptions o;
  o.decay = cfg_.train.ema_decay;
  o.warmup = cfg_.train.ema_warmup;
  o.every = cfg_.train.ema_every;
  ema_ = std::make_unique<ModelEma>(*model_, o);
  spdlog::info("ema: decay {}{}, updated every {} step(s); {} on {}", o.decay, o.warmup ? " with warmup" : "", o.every,
               format_bytes(ema_->bytes()), device_.str());
}

void TrainedModel::update_ema(int64_t step) {
  // After every optimizer step, also one the GradScaler or the finite check skipped: timm's train.py calls
  // ModelEmaV3.update(model, step=num_updates) after each optimizer.step() whatever the scaler did. Outside
  // the backward's peak; in place, nothing allocated.
  if (ema_) ema_->update(*model_, step);
}

EvalResult TrainedModel::evaluate_ema(const std::function<EvalResult()>& evaluate) {
  const EmaSwap swapped(*ema_, *model_);  // back to the trained weights when this returns or throws
  return evaluate();
}

}  // namespace trainer
