// What the optimizer tests share to compare with torchao (tests/ref/optim8_ref.py, whose environment is the
// 2.11 leg's): the script, the skip where torchao is missing, a model's tensors, their gradients, and a run
// of torchao's AdamW8bit or single_param_adam on them.
#pragma once

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "train_util.h"
#include "trainer/config/config.h"

namespace optimref {

inline std::string ref_script() { return testutil::source_dir() + "/tests/ref/optim8_ref.py"; }

#define SKIP_WITHOUT_TORCHAO()                                                                                  \
  do {                                                                                                          \
    const std::string missing = testutil::missing_module_of(optimref::ref_script());                          \
    if (!missing.empty())                                                                                       \
      GTEST_SKIP() << "the reference Python " << testutil::python() << " has no module " << missing           \
                   << " (torchao: the 2.11 leg's environment has it)";                                         \
  } while (0)

/// One tensor of a model: its name, its float32 value, whether weight decay applies.
struct Param {
  std::string name;
  torch::Tensor value;
  bool decay;
};

/// `steps` gradients per tensor, their scale changing from step to step as a training run's do.
inline std::vector<torch::Tensor> gradients(const std::vector<Param>& ps, int steps) {
  torch::manual_seed(4);
  std::vector<torch::Tensor> g;
  for (int s = 0; s < steps; ++s)
    for (const auto& p : ps) g.push_back(torch::randn(p.value.sizes()) * (0.01 * (1 + s % 5)));
  return g;
}

/// torchao's AdamW (int8: AdamW8bit; bfloat16: single_param_adam on bfloat16 moments), eagerly, with `c`'s
/// hyperparameters and the rate lr[s] at step s, on the tensors in `param_dtype` (float32 or bfloat16,
/// rounded to nearest; c.stochastic_rounding rounds the updated ones stochastically): the parameters after
/// the last step, as float32; undefined (and a failed expectation) when the script fails. small_state
/// "float32": the moments of the tensors torchao leaves unquantized in float32, as the trainer keeps them
/// (torchao's own: the parameters' dtype).
inline torch::Tensor run_torchao(const std::vector<Param>& ps, const trainer::OptimConfig& c,
                                 const std::vector<torch::Tensor>& grads, const std::vector<double>& lr,
                                 const std::string& param_dtype = "float32", const std::string& small_state = "") {
  testutil::TempDir dir;
  nlohmann::json spec = {{"steps", lr.size()}, {"lr", lr}, {"weight_decay", c.weight_decay},
                         {"betas", {c.beta1, c.beta2}}, {"eps", c.eps}, {"compile", false},
                         {"state", trainer::mode_name(c.state_dtype)}, {"param_dtype", param_dtype},
                         {"stochastic", c.stochastic_rounding}};
  if (!small_state.empty()) spec["small_state"] = small_state;
  std::vector<torch::Tensor> init;
  for (const auto& p : ps) {
    spec["shapes"].push_back(p.value.sizes().vec());
    spec["decay"].push_back(p.decay);
    init.push_back(p.value);
  }
  testutil::write_file(dir / "spec.json", spec.dump());
  testutil::write_raw(dir / "init.bin", init);
  testutil::write_raw(dir / "grads.bin", grads);
  const auto r = testutil::run(testutil::python() + " " + ref_script() + " adamw " + dir.str());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return r.exit_code == 0 ? testutil::read_raw(dir / "out.bin", torch::kFloat) : torch::Tensor();
}

}  // namespace optimref
