// LAMB (optim.name: lamb, trainer/numerics/optim.h): one step against the formula worked in double; ten
// steps against timm's Lamb on the same parameters and gradients (tests/ref/lamb_ref.py, the 2.11 leg);
// an OOM in the step leaves every parameter untouched, and the step allocates nothing once the state is
// there; the state round trip and a resume through the executable continue bitwise; bad config values.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>

#include "train_util.h"
#include "trainer/config/config.h"
#include "trainer/memory/backend.h"
#include "trainer/numerics/optim.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_lamb {

using testutil::TempDir;
using trainer::OptimConfig;

namespace {

// A test tensor: its name, its values, whether weight decay applies.
struct Tensor {
  std::string name;
  torch::Tensor value;
  bool decay;
};

std::vector<trainer::ParamSlot> slots_of(const std::vector<Tensor>& ts) {
  std::vector<trainer::ParamSlot> out;
  for (const auto& t : ts) out.push_back({t.name, t.value.clone().requires_grad_(true), t.decay});
  return out;
}

OptimConfig lamb(double wd, double max_grad_norm, bool trust_clip, bool always_adapt) {
  OptimConfig c;
  c.name = trainer::OptimKind::kLamb;
  c.weight_decay = wd;
  c.lamb_max_grad_norm = max_grad_norm;
  c.trust_clip = trust_clip;
  c.always_adapt = always_adapt;
  c.eps = 1e-6;  // timm's default, which the LAMB recipes set
  return c;
}

std::vector<double> values_of(const torch::Tensor& t) {
  const auto c = t.detach().to(torch::kDouble).contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

double norm_of(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v * v;
  return std::sqrt(s);
}

// The first LAMB step from the paper's formula, in double: g' = g / max(1, |G| / max_grad_norm);
// m = (1 - b1) g', v = (1 - b2) g'^2; u = (m / bc1) / (sqrt(v / bc2) + eps) + wd p where p decays;
// r = |p| / |u| (1 where either is 0; at most 1 with trust_clip) where p decays or always_adapt, else 1;
// p - lr r u.
std::vector<std::vector<double>> first_step_by_hand(const std::vector<Tensor>& ts,
                                                    const std::vector<std::vector<double>>& grads, double lr,
                                                    const OptimConfig& c, double* global_norm) {
  double sq = 0;
  for (const auto& g : grads) sq += norm_of(g) * norm_of(g);
  *global_norm = std::sqrt(sq);
  const double div = c.lamb_max_grad_norm > 0 ? std::max(1.0, *global_norm / c.lamb_max_grad_norm) : 1.0;
  const double bc1 = 1 - c.beta1, bc2 = 1 - c.beta2;
  std::vector<std::vector<double>> out;
  for (size_t i = 0; i < ts.size(); ++i) {
    std::vector<double> p = values_of(ts[i].value), u(p.size());
    const bool decays = ts[i].decay && c.weight_decay != 0;
    for (size_t e = 0; e < p.size(); ++e) {
      const double g = grads[i][e] / div;
      const double m = (1 - c.beta1) * g, v = (1 - c.beta2) * g * g;
      u[e] = (m / bc1) / (std::sqrt(v / bc2) + c.eps) + (decays ? c.weight_decay * p[e] : 0.0);
    }
    double r = 1;
    if (decays || c.always_adapt) {
      const double pn = norm_of(p), un = norm_of(u);
      if (pn > 0 && un > 0) r = pn / un;
      if (c.trust_clip) r = std::min(r, 1.0);
    }
    for (size_t e = 0; e < p.size(); ++e) p[e] -= lr * r * u[e];
    out.push_back(p);
  }
  return out;
}

}  // namespace

// (a) A decaying matrix, a zero matrix that decays (trust ratio 1: its norm is 0), a bias that does not
// decay (no adaptation unless always_adapt), gradients whose global norm (13.1) the clip at 1 divides.
TEST(Lamb, OneStepIsTheFormula) {
  const std::vector<Tensor> ts = {
      {"w", torch::tensor({0.5, -1.0, 1.5, 2.0, -0.25, 0.75}, torch::kFloat).reshape({2, 3}), true},
      {"zero", torch::zeros({2, 2}), true},
      {"bias", torch::tensor({0.1, -0.2, 0.3}, torch::kFloat), false}};
  const std::vector<std::vector<double>> grads = {
      {3.0, -4.0, 0.0, 12.0, 0.5, -1.0}, {0.25, -0.5, 1.0, 0.0}, {0.2, -0.1, 0.05}};
  struct Case {
    OptimConfig c;
    bool clips;
  };
  const std::vector<Case> cases = {{lamb(0.1, 1.0, false, false), true},
                                   {lamb(0.1, 0.0, true, true), false},
                                   {lamb(0.0, 20.0, false, true), false}};
  for (const auto& [c, clips] : cases) {
    const std::string what = "wd " + std::to_string(c.weight_decay) + " max_grad_norm " +
                             std::to_string(c.lamb_max_grad_norm) + (c.trust_clip ? " trust_clip" : "") +
                             (c.always_adapt ? " always_adapt" : "");
    auto slots = slots_of(ts);
    for (size_t i = 0; i < ts.size(); ++i)
      slots[i].param.mutable_grad() = torch::tensor(grads[i], torch::kDouble).to(torch::kFloat).reshape(ts[i].value.sizes());
    trainer::Optimizer opt(slots, c);
    EXPECT_EQ(opt.implementation(), "plain");
    const double lr = 0.05;
    opt.step(lr);
    double global = 0;
    const auto want = first_step_by_hand(ts, grads, lr, c, &global);
    EXPECT_EQ(clips, c.lamb_max_grad_norm > 0 && global > c.lamb_max_grad_norm) << what;
    for (size_t i = 0; i < ts.size(); ++i) {
      const auto got = values_of(slots[i].param);
      // float32 throughout: a few roundings of values of order 1.
      for (size_t e = 0; e < got.size(); ++e)
        EXPECT_NEAR(got[e], want[i][e], 4e-7 * std::max(1.0, std::fabs(want[i][e]))) << what << ": " << ts[i].name << "[" << e << "]";
    }
    // The zero matrix moved by lr times the Adam direction (trust ratio 1): about lr in each coordinate
    // with a gradient, nothing where its gradient is 0 and it has no weight to decay.
    const auto z = values_of(slots[1].param);
    EXPECT_NEAR(z[0], -lr, 1e-5) << what;
    EXPECT_NEAR(z[1], lr, 1e-5) << what;
    EXPECT_EQ(z[3], 0.0) << what;
    EXPECT_EQ(opt.steps(), 1);
  }
}

TEST(Lamb, RunsPlainOnly) {
  std::vector<trainer::ParamSlot> slots = {{"w", torch::ones({2, 2}).requires_grad_(true), true}};
  OptimConfig c = lamb(0.01, 1.0, false, false);
  EXPECT_EQ(trainer::Optimizer(slots, c).implementation(), "plain") << "auto";
  for (const char* impl : {"foreach", "fused"}) {
    c.implementation = trainer::mode_from_name<trainer::OptimImpl>(impl);
    const std::string err = testutil::error_text([&] { trainer::Optimizer(slots, c); });
    EXPECT_NE(err.find("optim.implementation: " + std::string(impl) + " has no lamb version"), std::string::npos) << err;
  }
  c.implementation = trainer::OptimImpl::kAuto;
  const std::string err = testutil::error_text([&] { trainer::Optimizer(slots, c, /*foreach=*/true); });
  EXPECT_NE(err.find("has no lamb version"), std::string::npos) << err;
}

namespace {

std::string ref_script() { return testutil::source_dir() + "/tests/ref/lamb_ref.py"; }

void write_floats(const testutil::fs::path& p, const std::vector<torch::Tensor>& ts) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  for (const auto& t : ts) {
    const auto c = t.detach().to(torch::kFloat).contiguous();
    f.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
  }
}

torch::Tensor read_floats(const testutil::fs::path& p) {
  auto bytes = testutil::read_bytes(p);
  return torch::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size() / 4)}, torch::kFloat).clone();
}

}  // namespace

// (b) Ten steps of ours against timm's Lamb with two param groups (decay / no decay), the same gradients
// (clipped on some steps, not others), a rising rate, two tensors without a gradient on one step each.
// timm on the CPU with foreach=True runs the same ops tensor by tensor: bitwise equal. Its single-tensor
// path (foreach=False) applies the bias corrections to the tensors instead of folding them into scalars:
// equal within 2e-6 (absolute, on parameters of order 1; about 16 float32 roundings).
TEST(Lamb, TenStepsMatchTimm) {
  const std::string missing = testutil::missing_module_of(ref_script());
  if (!missing.empty())
    GTEST_SKIP() << "the reference Python " << testutil::python() << " has no module " << missing
                 << " (timm: the 2.11 leg's environment has it)";
  const std::vector<OptimConfig> cases = {lamb(0.01, 1.0, false, false), lamb(0.1, 0.0, true, true),
                                          lamb(0.05, 2.0, false, true), lamb(0.0, 1.0, true, false)};
  torch::manual_seed(5);
  const std::vector<Tensor> ts = {{"w1", torch::randn({8, 5}) * 0.3, true},
                                  {"b1", torch::randn({8}) * 0.1, false},
                                  {"zero", torch::zeros({4, 4}), true},
                                  {"ln", 1 + 0.1 * torch::randn({5}), false},
                                  {"w2", torch::randn({3, 2, 2}) * 0.5, true}};
  const int steps = 10;
  const std::vector<double> grad_scale = {0.05, 3.0, 0.2, 1.0, 5.0, 0.01, 0.5, 2.0, 0.1, 1.5};
  const std::vector<std::pair<int, int>> no_grad = {{4, 3}, {1, 6}};  // (tensor, step)
  std::vector<torch::Tensor> grads;
  for (int s = 0; s < steps; ++s)
    for (const auto& t : ts) grads.push_back(torch::randn(t.value.sizes()) * grad_scale[s]);
  std::vector<double> lrs;
  for (int s = 0; s < steps; ++s) lrs.push_back(0.02 * (s + 1) / steps);
  for (size_t k = 0; k < cases.size(); ++k) {
    const OptimConfig& c = cases[k];
    TempDir dir;
    nlohmann::json spec = {{"steps", steps}, {"lr", lrs}, {"weight_decay", c.weight_decay},
                           {"betas", {c.beta1, c.beta2}}, {"eps", c.eps}, {"max_grad_norm", c.lamb_max_grad_norm},
                           {"trust_clip", c.trust_clip}, {"always_adapt", c.always_adapt}, {"no_grad", no_grad}};
    std::vector<torch::Tensor> init;
    for (const auto& t : ts) {
      spec["shapes"].push_back(t.value.sizes().vec());
      spec["decay"].push_back(t.decay);
      init.push_back(t.value);
    }
    testutil::write_file(dir / "spec.json", spec.dump());
    write_floats(dir / "init.bin", init);
    write_floats(dir / "grads.bin", grads);
    const auto r = testutil::run(testutil::python() + " " + ref_script() + " run " + dir.str());
    ASSERT_EQ(r.exit_code, 0) << r.output;

    auto slots = slots_of(ts);
    trainer::Optimizer opt(slots, c);
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      for (size_t i = 0; i < ts.size(); ++i)
        if (std::find(no_grad.begin(), no_grad.end(), std::make_pair(int(i), s)) == no_grad.end())
          slots[i].param.mutable_grad() = grads[s * ts.size() + i].clone();
      opt.step(lrs[s]);
    }
    std::vector<torch::Tensor> flat;
    for (const auto& sl : slots) flat.push_back(sl.param.detach().reshape(-1));
    const torch::Tensor ours = torch::cat(flat);
    const torch::Tensor foreach = read_floats(dir / "foreach.bin"), single = read_floats(dir / "single.bin");
    ASSERT_EQ(ours.numel(), foreach.numel());
    const std::string what = "case " + std::to_string(k);
    std::vector<torch::Tensor> init_flat;
    for (const auto& t : init) init_flat.push_back(t.reshape(-1));
    EXPECT_FALSE(ours.equal(torch::cat(init_flat))) << what << ": the parameters moved";
    EXPECT_TRUE(ours.equal(foreach)) << what << ": max |ours - timm foreach| "
                                     << (ours - foreach).abs().max().item<double>();
    EXPECT_LE((ours - single).abs().max().item<double>(), 2e-6) << what << ": against timm's single-tensor path";
  }
}

namespace {

std::vector<Tensor> oom_tensors() {
  torch::manual_seed(2);
  // 64 x 64 float32: 16 KiB, so that a temporary the size of a tensor shows in the allocator's peak.
  return {{"w", torch::randn({64, 64}) * 0.1, true}, {"b", torch::randn({64}) * 0.1, false}};
}

void set_grads(std::vector<trainer::ParamSlot>& slots, int seed) {
  torch::manual_seed(seed);
  for (auto& s : slots) s.param.mutable_grad() = torch::randn(s.param.sizes());
}

}  // namespace

// (c) The state (exp_avg, exp_avg_sq, the workspace) does not fit under a real cap: the step throws before
// any parameter or gradient changed, then runs once the cap is gone, exactly as a first attempt would.
// Once the state is allocated, the step itself allocates nothing the size of a tensor.
TEST(Lamb, OomInStepLeavesParametersUntouched) {
  trainer::cpu_allocator::install();
  const auto ts = oom_tensors();
  const OptimConfig c = lamb(0.01, 1.0, false, false);
  auto slots = slots_of(ts), fresh = slots_of(ts);
  set_grads(slots, 7);
  set_grads(fresh, 7);
  trainer::Optimizer opt(slots, c), reference(fresh, c);
  {
    trainer::ScopedCpuCap cap(trainer::cpu_allocator::live_bytes() + 64);
    EXPECT_THROW(opt.step(0.01), c10::OutOfMemoryError);
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    EXPECT_TRUE(slots[i].param.equal(ts[i].value)) << ts[i].name << " changed";
    EXPECT_TRUE(slots[i].param.grad().equal(fresh[i].param.grad())) << ts[i].name << "'s gradient changed";
  }
  EXPECT_EQ(opt.steps(), 0);
  opt.allocate_state();
  trainer::cpu_allocator::reset_peak();
  const int64_t live = trainer::cpu_allocator::live_bytes();
  opt.step(0.01);
  EXPECT_LT(trainer::cpu_allocator::peak_bytes() - live, 1024) << "the step allocated a tensor's worth";
  reference.step(0.01);
  for (size_t i = 0; i < slots.size(); ++i) EXPECT_TRUE(slots[i].param.equal(fresh[i].param)) << ts[i].name;
}

// (d) Three steps, the state through a map (as a checkpoint holds it), three more: bitwise the six steps
// of one optimizer. The names are AdamW's.
TEST(Lamb, StateRoundTripContinuesBitwise) {
  const auto ts = oom_tensors();
  const OptimConfig c = lamb(0.05, 1.0, true, true);
  auto a = slots_of(ts);
  trainer::Optimizer whole(a, c);
  std::map<std::string, torch::Tensor> saved;
  std::vector<torch::Tensor> at_three;
  for (int s = 0; s < 6; ++s) {
    if (s == 3) {
      for (auto& [k, v] : whole.state()) saved[k] = v.clone();
      for (auto& sl : a) at_three.push_back(sl.param.detach().clone());
    }
    set_grads(a, 100 + s);
    whole.step(0.01);
  }
  std::vector<std::string> names;
  for (auto& [k, v] : saved) names.push_back(k);
  EXPECT_EQ(names, (std::vector<std::string>{"exp_avg.b", "exp_avg.w", "exp_avg_sq.b", "exp_avg_sq.w", "step"}));
  std::vector<Tensor> resumed_ts = ts;
  for (size_t i = 0; i < ts.size(); ++i) resumed_ts[i].value = at_three[i];
  auto b = slots_of(resumed_ts);
  trainer::Optimizer resumed(b, c);
  resumed.load_state(saved);
  EXPECT_EQ(resumed.steps(), 3);
  for (int s = 3; s < 6; ++s) {
    set_grads(b, 100 + s);
    resumed.step(0.01);
  }
  for (size_t i = 0; i < ts.size(); ++i) EXPECT_TRUE(a[i].param.equal(b[i].param)) << ts[i].name;
  const auto sa = whole.state(), sb = resumed.state();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_TRUE(sa[i].second.equal(sb[i].second)) << sa[i].first;
  saved.erase("exp_avg_sq.w");
  const std::string err = testutil::error_text([&] { resumed.load_state(saved); });
  EXPECT_NE(err.find("exp_avg_sq.w"), std::string::npos) << err;
}

// Through the executable: six steps, against three, a checkpoint, and three more from it.
TEST(Lamb, ResumedRunEndsBitwiseWhereTheWholeRunEnds) {
  TempDir dir;
  const std::string job =
      "--set model.name=plain_cnn --set data.kind=synthetic --set data.shape=[1,16,16] --set data.synthetic_size=48"
      " --set data.test= --set train.global_batch=8 --set train.epochs=0 --set train.steps=6"
      " --set train.deterministic=true --set train.threads=1 --set data.workers=0 --set seed=3"
      " --set optim.name=lamb --set optim.lr=0.01 --set optim.eps=1e-6 --set optim.weight_decay=0.01"
      " --set checkpoint.every_steps=3 --set checkpoint.every_seconds=0 --set checkpoint.keep_last=10";
  const auto whole = (dir / "whole").string(), resumed = (dir / "resumed").string();
  auto r = testutil::run(testutil::trainer_cmd(whole, job));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testutil::run(testutil::trainer_cmd(resumed, job + " --resume " + whole + "/checkpoints/step-00000003"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(testutil::events(resumed, "resume").size(), 1u) << r.output;
  EXPECT_TRUE(testutil::bitwise_equal(testutil::final_weights(whole), testutil::final_weights(resumed)));
}

// (e) Each bad value: one line naming the key.
TEST(Lamb, BadValuesNameTheKey) {
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> bad = {
      {{"optim.implementation=fused"}, {"optim.implementation", "fused has no lamb version", "auto or plain"}},
      {{"optim.implementation=foreach"}, {"optim.implementation", "foreach has no lamb version"}},
      {{"optim.lamb_max_grad_norm=-1"}, {"optim.lamb_max_grad_norm", ">= 0"}},
      {{"optim.lamb_max_grad_norm=.nan"}, {"optim.lamb_max_grad_norm", "finite"}},
      {{"optim.lamb_max_grad_norm=1e39"}, {"optim.lamb_max_grad_norm", "float32"}},
      {{"optim.trust_clip=maybe"}, {"optim.trust_clip"}},
      {{"optim.always_adapt=2"}, {"optim.always_adapt"}},
      {{"train.cuda_graph=on"}, {"train.cuda_graph", "lamb", "auto or off"}}};
  for (const auto& [sets, fragments] : bad) {
    std::vector<std::string> all = {"train.steps=10", "optim.name=lamb"};
    all.insert(all.end(), sets.begin(), sets.end());
    const std::string msg = testutil::error_text([&] { testutil::config_from_sets(all); });
    for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << sets[0] << ": " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  EXPECT_NO_THROW(testutil::config_from_sets({"train.steps=10", "optim.name=lamb", "optim.lamb_max_grad_norm=0", "optim.trust_clip=true",
                             "optim.always_adapt=true", "optim.implementation=plain", "train.cuda_graph=off"}));
  // Through the executable: exit 2 and the one line.
  TempDir dir;
  const auto r = testutil::run(testutil::trainer_cmd(dir.str() + "/run", "--set train.steps=1 --set optim.name=lamb "
                                                                            "--set optim.implementation=fused"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("optim.implementation"), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
}

}  // namespace test_lamb
