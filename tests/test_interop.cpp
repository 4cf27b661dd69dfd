// Weights in and out: a torchvision ResNet-18 state dict saved by Python's torch.save loads by name
// (model.init_from) and gives torchvision's outputs; the trainer's weights load back into torchvision.
#include <gtest/gtest.h>

#include "models/registry.h"
#include "test_util.h"
#include "trainer/checkpoint/state_dict.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_interop {

TEST(Interop, TorchvisionStateDictInAndOut) {
  testutil::TempDir dir;
  const std::string script = testutil::source_dir() + "/tests/ref/torchvision_state_dict.py";
  auto w = testutil::run(testutil::python() + " " + script + " write " + dir.str());
  ASSERT_EQ(w.exit_code, 0) << w.output;

  auto model = models::create_model("resnet18", models::ModelOptions().num_classes(10));
  trainer::load_state_dict(*model, (dir / "tv.pt").string(), /*strict=*/true);
  model->eval();
  std::map<std::string, torch::Tensor> io;
  for (auto& [k, v] : trainer::read_tensors((dir / "io.pt").string())) io[k] = v;
  torch::NoGradGuard ng;
  auto y = model->forward(io.at("x"));
  EXPECT_TRUE(torch::allclose(y, io.at("y"), 1e-4, 1e-5)) << (y - io.at("y")).abs().max();

  // Out: the trainer's weights (as `trainer export` writes them) into torchvision, same outputs.
  trainer::save_state_dict(*model, (dir / "exported.pt").string());
  trainer::NamedTensors out = {{"x", io.at("x")}, {"y2", y}};
  {
    std::ofstream f(dir / "io2.pt", std::ios::binary);
    f << trainer::tensors_to_bytes(out);
  }
  auto c = testutil::run(testutil::python() + " " + script + " check " + dir.str());
  ASSERT_EQ(c.exit_code, 0) << c.output;
  double diff = std::stod(c.output.substr(c.output.find("maxdiff ") + 8));
  EXPECT_LT(diff, 1e-5) << c.output;

  // A mis-shaped state dict is refused with the key named.
  auto other = models::create_model("resnet18", models::ModelOptions().num_classes(7));
  try {
    trainer::load_state_dict(*other, (dir / "tv.pt").string(), /*strict=*/true);
    FAIL() << "expected an error for fc.weight";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("fc.weight"), std::string::npos) << e.what();
  }
}

}  // namespace test_interop
