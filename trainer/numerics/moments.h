// AdamW's and LAMB's two moments (exp_avg, exp_avg_sq) in optim.state_dtype, and the block loop that
// updates them in fewer bytes.
//
//   state_dtype   each moment of a tensor of N values                     bytes a parameter (both moments)
//   float32       float32, N                                               8
//   bfloat16      bfloat16, N (rounded to nearest even)                    4
//   int8          uint8 codes, N, and float32 scales, N / 256 (quant8.h)   2.03 (float32, 8, for a tensor
//                                                                          under 4,096 values or not whole blocks)
//
// float32 moments are plain tensors, updated by the rules' own ops (plain, foreach, fused). The others are
// updated by update(): for each block of 256 values, the two moments are decoded to float32 into the
// stack, the rule's arithmetic runs on them and on the parameter's and gradient's values, and what it left
// is encoded back. Nothing is allocated (the OOM rule of optim.h), and the state is read and written once
// per step, as torchao's compiled AdamW8bit does. Blocks run in parallel over LibTorch's intra-op threads.
// CPU only: a CUDA parameter with low-precision state is refused when the optimizer is built. AdamW's
// update of bfloat16 weights (model.param_dtype) runs the same loop, whatever the moments' dtype.
//
// Checkpoints name the entries as float32 state does ("exp_avg.<param>", "exp_avg_sq.<param>") and add the
// scales of quantized tensors ("exp_avg_absmax.<param>", "exp_avg_sq_absmax.<param>"); an entry's dtype
// (float32, bfloat16, uint8) says how it is held. load() converts another state_dtype's entries: float32 or
// bfloat16 to int8 quantizes, int8 to float32 dequantizes; it says so, for the caller's one warning.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "trainer/config/config.h"
#include "trainer/numerics/optim_rule.h"

namespace trainer {

struct ParamSlot;  // optim.h

class AdamMoments {
 public:
  explicit AdamMoments(StateDtype dtype) : dtype_(dtype) {}

  StateDtype dtype() const { return dtype_; }
  /// Whether the moments are plain float32 tensors (state_dtype float32), for the rules' own ops.
  bool float32() const { return dtype_ == StateDtype::kFloat32; }
  /// Zero moments for every parameter, unless already one per parameter.
  void allocate(const std::vector<ParamSlot>& params);
  /// Drops them (a checkpoint of step 0 holds none).
  void clear();
  /// float32 state: the moments, one tensor per parameter.
  std::vector<torch::Tensor>& exp_avg() { return m_; }
  std::vector<torch::Tensor>& exp_avg_sq() { return v_; }

  /// The values [begin, begin + n) of one parameter, n <= 256, with its two moments there in float32: what
  /// the function leaves in m and v is stored back. Must touch nothing outside its range.
  using BlockFn = std::function<void(float* m, float* v, int64_t begin, int64_t n)>;
  /// Runs `f` over every block of parameter `i` (in parallel): the update of moments in fewer bytes, and of
  /// bfloat16 weights (whose float32 moments it reads and writes in place).
  void update(size_t i, const BlockFn& f);

  /// The checkpoint's entries: the moments, then the scales of the quantized ones.
  std::vector<StateBuffers> buffers();
  /// Restores the moments from a checkpoint's entries, converting those held in another dtype. Returns
  /// what was converted ("" when nothing): "float32 to int8", ... Throws std::runtime_error naming an
  /// entry that is missing or has another shape.
  std::string load(const std::map<std::string, torch::Tensor>& state, const std::vector<ParamSlot>& params);
  /// Holds the moments in `dtype` from now on: each parameter's are converted (as load() converts) and the
  /// old ones freed before the next parameter's, so that the memory it needs beyond the old state is one
  /// parameter's new moments (and a float32 copy of one moment when int8 codes are read). Returns what was
  /// converted ("float32 to int8"; "" when nothing is allocated yet). On an allocation failure the
  /// parameters already converted stay converted and the rest keep their dtype until the next call:
  /// dtype() is the new one only once all are.
  std::string convert(StateDtype dtype, const std::vector<ParamSlot>& params);
  /// Bytes held by the moments and their scales.
  int64_t bytes() const;
  /// The bytes both moments of a parameter of `numel` values take in `dtype`, without building them: what
  /// bytes() counts for it (the memory plan's rule).
  static int64_t bytes_for(int64_t numel, StateDtype dtype);

 private:
  StateDtype dtype_;
  std::vector<torch::Tensor> m_, v_;                // float32 | bfloat16 | uint8 codes: the parameter's shape
  std::vector<torch::Tensor> m_absmax_, v_absmax_;  // int8: the scales of quantized tensors (else undefined)
};

/// A rule whose state is Adam's two moments (AdamW, LAMB): held in optim.state_dtype by AdamMoments, which
/// saves, loads and converts them for both.
class MomentsRule : public OptimizerRule {
 public:
  explicit MomentsRule(const OptimConfig& cfg) : OptimizerRule(cfg), moments_(cfg.state_dtype) {}

  void allocate_state(const std::vector<ParamSlot>& params) override { moments_.allocate(params); }
  std::vector<StateBuffers> state_buffers() override { return moments_.buffers(); }
  std::string load_state(const std::map<std::string, torch::Tensor>& state, const std::vector<ParamSlot>& params) override {
    return moments_.load(state, params);
  }
  std::string convert_state(StateDtype dtype, const std::vector<ParamSlot>& params) override {
    cfg_.state_dtype = dtype;
    return moments_.convert(dtype, params);
  }

 protected:
  AdamMoments moments_;
};

}  // namespace trainer
