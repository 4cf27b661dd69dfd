// Optimizer state in fewer bytes (optim.state_dtype: trainer/numerics/moments.h, quant8.h): the dynamic
// maps and the codes against torchao 0.18 and against a brute-force nearest-entry search; AdamW with int8
// and bfloat16 moments against torchao (tests/ref/optim8_ref.py, the 2.11 leg); LAMB with them against
// its float32 self; the bytes held; the state through a checkpoint's map, bitwise, and converted between
// dtypes; an OOM while the state is allocated changes nothing; bad config values.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>

#include <signal.h>

#include "optim_ref.h"
#include "train_util.h"
#include "trainer/config/config.h"
#include "trainer/memory/backend.h"
#include "trainer/numerics/optim.h"
#include "trainer/numerics/quant8.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_optim_state {

using testutil::TempDir;
using testutil::read_raw;
using testutil::write_raw;
using trainer::OptimConfig;
using trainer::StateDtype;
namespace quant8 = trainer::quant8;

namespace {

using optimref::ref_script;

// The nearest entry of `map` to each value / its block's scale, searched over all 256 in double; of two
// equally near, the larger (quant8.h).
torch::Tensor brute_force_codes(const torch::Tensor& x, const torch::Tensor& map) {
  const auto xs = x.contiguous();
  const float* v = xs.data_ptr<float>();
  const float* q = map.data_ptr<float>();
  torch::Tensor codes = torch::empty({x.numel()}, torch::kUInt8);
  for (int64_t b = 0; b < x.numel() / quant8::kBlock; ++b) {
    float amax = 0;
    for (int64_t j = 0; j < quant8::kBlock; ++j) amax = std::max(amax, std::fabs(v[b * quant8::kBlock + j]));
    const float scale = std::max(amax, 1e-12f);
    for (int64_t j = 0; j < quant8::kBlock; ++j) {
      const double y = v[b * quant8::kBlock + j] / scale;  // the float32 quotient, as the kernel divides
      int best = 0;
      for (int k = 1; k < 256; ++k)
        if (std::fabs(y - q[k]) <= std::fabs(y - q[best])) best = k;
      codes[b * quant8::kBlock + j] = best;
    }
  }
  return codes.view(x.sizes());
}

// Blocks that probe the map: normal values over 16 decades of scale, a zero block, blocks of entries
// times a scale, and midpoints between neighbouring entries (the ties).
torch::Tensor probe_values(bool is_signed) {
  torch::manual_seed(11);
  std::vector<torch::Tensor> blocks;
  for (double scale : {1e-12, 1e-8, 1e-4, 1e-2, 1.0, 3.0, 1e3})
    for (int k = 0; k < 4; ++k) blocks.push_back(torch::randn({quant8::kBlock}) * scale);
  blocks.push_back(torch::zeros({quant8::kBlock}));
  const torch::Tensor map = quant8::dynamic_map(is_signed);
  blocks.push_back(map * 0.37f);
  torch::Tensor mid = (map.slice(0, 0, 255) + map.slice(0, 1, 256)) / 2;
  blocks.push_back(torch::cat({mid, torch::ones({1})}));
  torch::Tensor x = torch::cat(blocks);
  if (!is_signed) x = x.abs();
  // Pad to a whole number of quantized blocks of at least 4096 values.
  const int64_t n = std::max<int64_t>(quant8::kMinNumel, x.numel());
  return torch::cat({x, torch::rand({n - x.numel()})}).contiguous();
}

}  // namespace

// The maps hold 256 ascending entries: 0 and 1, seven decades of 2^i (signed: and their negatives) or
// 2^(i+1) (unsigned) midpoints each; and they are torchao's, bit for bit.
TEST(OptimState, MapsAreTheDynamicTypes) {
  for (bool is_signed : {true, false}) {
    const torch::Tensor map = quant8::dynamic_map(is_signed);
    ASSERT_EQ(map.numel(), 256);
    EXPECT_TRUE((map.slice(0, 1, 256) > map.slice(0, 0, 255)).all().item<bool>()) << "strictly ascending";
    EXPECT_EQ(map[255].item<float>(), 1.0f);
    EXPECT_EQ((map == 0).sum().item<int64_t>(), 1);
    // The smallest magnitude is 10^-6 times the first midpoint of linspace(0.1, 1, 2) (signed: 0.55e-6) or
    // of linspace(0.1, 1, 3) (unsigned: 0.325e-6).
    EXPECT_NEAR(map.abs().masked_fill(map == 0, 1).min().item<double>(), is_signed ? 0.55e-6 : 0.325e-6, 1e-13);
    if (is_signed) EXPECT_NEAR(map[0].item<double>(), -(1 - 0.9 / 64 / 2), 1e-6);
    else EXPECT_EQ(map[0].item<float>(), 0.0f);
    // Decade 10^-1 .. 1 holds 64 entries a sign (signed), 128 (unsigned).
    const int64_t top = ((map.abs() >= 0.1) & (map.abs() < 1)).sum().item<int64_t>();
    EXPECT_EQ(top, 128);
  }
  SKIP_WITHOUT_TORCHAO();
  TempDir dir;
  const auto r = testutil::run(testutil::python() + " " + ref_script() + " maps " + dir.str());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(read_raw(dir / "signed.bin", torch::kFloat).equal(quant8::dynamic_map(true)));
  EXPECT_TRUE(read_raw(dir / "unsigned.bin", torch::kFloat).equal(quant8::dynamic_map(false)));
}

// Every code is the nearest entry (ties to the larger), up to float32's rounding of the decision on a
// midpoint; it decodes to that entry times the block's scale.
TEST(OptimState, CodesAreTheNearestEntries) {
  for (bool is_signed : {true, false}) {
    const torch::Tensor x = probe_values(is_signed), map = quant8::dynamic_map(is_signed);
    torch::Tensor codes, absmax;
    quant8::quantize(x, is_signed, codes, absmax);
    const torch::Tensor expected = brute_force_codes(x, map);
    // Where the two differ, the value must lie on a midpoint between the two entries, within float32's
    // rounding of the decision (v - lo >= (hi - lo) / 2, computed in float32 as torchao computes it).
    int64_t ties = 0;
    const torch::Tensor off = (codes != expected).nonzero().view(-1);
    for (int64_t j = 0; j < off.numel(); ++j) {
      const int64_t k = off[j].item<int64_t>();
      const float scale = std::max(x.view({-1, quant8::kBlock})[k / quant8::kBlock].abs().max().item<float>(), 1e-12f);
      const double y = x[k].item<float>() / scale;
      const double a = map[codes[k].item<int>()].item<float>(), b = map[expected[k].item<int>()].item<float>();
      EXPECT_LE(std::fabs(y - (a + b) / 2), 4 * std::ldexp(std::max(std::fabs(a), std::fabs(b)), -24))
          << "value " << y << " coded " << a << ", nearest " << b;
      ++ties;
    }
    EXPECT_LE(ties, 4) << "codes off the nearest entry, all on midpoints";    const torch::Tensor blocks = x.view({-1, quant8::kBlock});
    EXPECT_TRUE(absmax.equal(blocks.abs().amax(1).clamp_min(1e-12)));
    const torch::Tensor back = quant8::dequantize(codes, absmax, is_signed);
    EXPECT_TRUE(back.equal((map.index({codes.to(torch::kLong)}).view({-1, quant8::kBlock}) * absmax.unsqueeze(1)).view(-1)));
    // The error is at most half the gap between the two entries around each value (times the scale).
    const torch::Tensor err = ((back - x).view({-1, quant8::kBlock}) / absmax.unsqueeze(1)).abs().view(-1);
    EXPECT_LE(err.max().item<double>(), 0.5 * 0.9 / 64 * 1.0001);
  }
}

TEST(OptimState, CodesAndScalesAreTorchaos) {
  SKIP_WITHOUT_TORCHAO();
  for (bool is_signed : {true, false}) {
    TempDir dir;
    const torch::Tensor x = probe_values(is_signed);
    write_raw(dir / "x.bin", {x});
    testutil::write_file(dir / "spec.json", nlohmann::json{{"signed", is_signed}}.dump());
    const auto r = testutil::run(testutil::python() + " " + ref_script() + " quantize " + dir.str());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    torch::Tensor codes, absmax;
    quant8::quantize(x, is_signed, codes, absmax);
    const torch::Tensor theirs = read_raw(dir / "codes.bin", torch::kUInt8);
    EXPECT_TRUE(codes.equal(theirs)) << (codes != theirs).sum().item<int64_t>() << " codes differ";
    EXPECT_TRUE(absmax.equal(read_raw(dir / "scale.bin", torch::kFloat)));
  }
}

namespace {

using optimref::Param;

// Two quantized tensors (one without decay), two that stay float32 (under 4,096 values; not whole blocks).
std::vector<Param> model_params() {
  torch::manual_seed(3);
  return {{"w1", torch::randn({64, 128}) * 0.05, true},
          {"ln", 1 + 0.1 * torch::randn({4096}), false},
          {"w2", torch::randn({32, 8}) * 0.2, true},
          {"odd", torch::randn({4100}) * 0.1, true}};
}

std::vector<trainer::ParamSlot> slots_of(const std::vector<Param>& ps) {
  std::vector<trainer::ParamSlot> out;
  for (const auto& p : ps) out.push_back({p.name, p.value.clone().requires_grad_(true), p.decay});
  return out;
}

OptimConfig adamw(StateDtype dtype) {
  OptimConfig c;
  c.name = trainer::OptimKind::kAdamW;
  c.weight_decay = 0.1;
  c.beta2 = 0.99;
  c.state_dtype = dtype;
  return c;
}

using optimref::gradients;

std::vector<double> rates(int steps) {
  std::vector<double> lr;
  for (int s = 0; s < steps; ++s) lr.push_back(1e-3 * (s + 1) / steps);
  return lr;
}

torch::Tensor flat(const std::vector<trainer::ParamSlot>& slots) {
  std::vector<torch::Tensor> f;
  for (const auto& s : slots) f.push_back(s.param.detach().reshape(-1));
  return torch::cat(f);
}

torch::Tensor run_ours(const std::vector<Param>& ps, const OptimConfig& c, const std::vector<torch::Tensor>& grads, int steps) {
  auto slots = slots_of(ps);
  trainer::Optimizer opt(slots, c);
  const auto lr = rates(steps);
  for (int s = 0; s < steps; ++s) {
    for (size_t i = 0; i < ps.size(); ++i) slots[i].param.mutable_grad() = grads[s * ps.size() + i].clone();
    opt.step(lr[s]);
  }
  return flat(slots);
}

torch::Tensor run_torchao(const std::vector<Param>& ps, const OptimConfig& c, const std::vector<torch::Tensor>& grads,
                          int steps) {
  return optimref::run_torchao(ps, c, grads, rates(steps));
}

}  // namespace

// Twenty AdamW steps with int8 and with bfloat16 moments against torchao's (AdamW8bit; single_param_adam
// on bfloat16 moments), run eagerly on the same parameters and gradients: bit for bit. The maps and the
// codes are torchao's bit for bit (above), and so is every op of the update, once the reference takes the
// IEEE square root as the block loop does (tests/ref/optim8_ref.py: LibTorch's CPU torch.sqrt runs through
// MKL's vector math, whose last bit depends on the CPU: 56 of 8,192 random values differ from IEEE's on
// one x86 machine, 1,285 on another). Compiled (torchao's default, torch.compile on the CPU), it fuses and
// reorders the ops: measured once, 920 of the 16,644 differed, by at most 1.2e-7.
TEST(OptimState, AdamWMatchesTorchao) {
  SKIP_WITHOUT_TORCHAO();
  const auto ps = model_params();
  const int steps = 20;
  const auto grads = gradients(ps, steps);
  for (StateDtype dtype : {StateDtype::kInt8, StateDtype::kBfloat16}) {
    const OptimConfig c = adamw(dtype);
    const torch::Tensor ours = run_ours(ps, c, grads, steps), theirs = run_torchao(ps, c, grads, steps);
    ASSERT_TRUE(theirs.defined());
    ASSERT_EQ(ours.numel(), theirs.numel());
    const int64_t differ = (ours != theirs).sum().item<int64_t>();
    EXPECT_EQ(differ, 0) << trainer::mode_name(dtype) << ": " << differ << " of " << ours.numel() << " differ, by up to "
                         << ((ours - theirs).abs() / theirs.abs().clamp_min(1e-30)).max().item<double>() << " of a weight";
    std::vector<torch::Tensor> init;
    for (const auto& p : ps) init.push_back(p.value.reshape(-1));
    EXPECT_GT((ours - torch::cat(init)).abs().max().item<double>(), 1e-4) << "the parameters moved";
  }
}

// LAMB has no 8-bit reference to compare with: with int8 and bfloat16 moments, twenty steps stay within
// a few quantization steps of its float32 self (the trust ratio rescales each tensor's update to the
// weight's norm, so the parameters' drift is bounded by the rate, not by the moments' precision).
TEST(OptimState, LambFollowsItsFloat32Self) {
  const auto ps = model_params();
  const int steps = 20;
  const auto grads = gradients(ps, steps);
  OptimConfig c = adamw(StateDtype::kFloat32);
  c.name = trainer::OptimKind::kLamb;
  c.eps = 1e-6;
  const torch::Tensor reference = run_ours(ps, c, grads, steps);
  std::vector<torch::Tensor> init;
  for (const auto& p : ps) init.push_back(p.value.reshape(-1));
  const double moved = (reference - torch::cat(init)).abs().max().item<double>();
  for (StateDtype dtype : {StateDtype::kInt8, StateDtype::kBfloat16}) {
    c.state_dtype = dtype;
    const torch::Tensor ours = run_ours(ps, c, grads, steps);
    const double diff = (ours - reference).abs().max().item<double>();
    EXPECT_LT(diff, 0.05 * moved) << trainer::mode_name(dtype) << ": max |ours - float32| " << diff
                                  << " against a largest move of " << moved;
    EXPECT_FALSE(ours.equal(reference)) << trainer::mode_name(dtype) << " computed in float32 after all";
  }
}

// The bytes held: float32 8 a parameter, bfloat16 4, int8 2 plus 8 per 256 (the two scales), and 8 for a
// tensor that stays float32.
TEST(OptimState, StateTakesItsBytes) {
  const auto ps = model_params();
  const int64_t quantized = 64 * 128 + 4096, plain = 32 * 8 + 4100;
  const std::vector<std::pair<StateDtype, int64_t>> cases = {
      {StateDtype::kFloat32, 8 * (quantized + plain)},
      {StateDtype::kBfloat16, 4 * (quantized + plain)},
      {StateDtype::kInt8, 2 * quantized + 8 * quantized / 256 + 8 * plain}};
  for (const auto& [dtype, bytes] : cases) {
    auto slots = slots_of(ps);
    trainer::Optimizer opt(slots, adamw(dtype));
    opt.allocate_state();
    EXPECT_EQ(opt.state_bytes(), bytes) << trainer::mode_name(dtype);
  }
}

// Three steps, the state through a map as a checkpoint holds it, three more: bitwise the six steps of one
// optimizer, for each dtype. The scales are entries of their own.
TEST(OptimState, StateRoundTripContinuesBitwise) {
  const auto ps = model_params();
  const auto grads = gradients(ps, 6);
  for (StateDtype dtype : {StateDtype::kInt8, StateDtype::kBfloat16}) {
    const OptimConfig c = adamw(dtype);
    auto a = slots_of(ps);
    trainer::Optimizer whole(a, c);
    std::map<std::string, torch::Tensor> saved;
    std::vector<Param> at_three = ps;
    for (int s = 0; s < 6; ++s) {
      if (s == 3) {
        for (auto& [k, v] : whole.state()) saved[k] = v.clone();
        for (size_t i = 0; i < ps.size(); ++i) at_three[i].value = a[i].param.detach().clone();
      }
      for (size_t i = 0; i < ps.size(); ++i) a[i].param.mutable_grad() = grads[s * ps.size() + i].clone();
      whole.step(1e-3);
    }
    if (dtype == StateDtype::kInt8) {
      EXPECT_EQ(saved.count("exp_avg_absmax.w1"), 1u);
      EXPECT_EQ(saved.count("exp_avg_sq_absmax.ln"), 1u);
      EXPECT_EQ(saved.count("exp_avg_absmax.w2"), 0u) << "w2 stays float32";
      EXPECT_EQ(saved.at("exp_avg.w1").scalar_type(), torch::kUInt8);
      EXPECT_EQ(saved.at("exp_avg.w2").scalar_type(), torch::kFloat);
    } else {
      EXPECT_EQ(saved.at("exp_avg_sq.w2").scalar_type(), torch::kBFloat16);
    }
    auto b = slots_of(at_three);
    trainer::Optimizer resumed(b, c);
    EXPECT_EQ(resumed.load_state(saved), "");
    for (int s = 3; s < 6; ++s) {
      for (size_t i = 0; i < ps.size(); ++i) b[i].param.mutable_grad() = grads[s * ps.size() + i].clone();
      resumed.step(1e-3);
    }
    EXPECT_TRUE(flat(a).equal(flat(b))) << trainer::mode_name(dtype);
    if (dtype == StateDtype::kInt8) {
      saved.erase("exp_avg_sq_absmax.w1");
      const std::string err = testutil::error_text([&] { resumed.load_state(saved); });
      EXPECT_NE(err.find("exp_avg_sq_absmax.w1"), std::string::npos) << err;
    }
  }
}

// A checkpoint of another state_dtype converts: float32 moments quantize to the codes quantize() gives,
// int8 moments dequantize to the values their codes stand for; load_state() says what it converted.
TEST(OptimState, AnotherDtypeConverts) {
  const auto ps = model_params();
  const auto grads = gradients(ps, 2);
  auto state_after_two = [&](StateDtype dtype) {
    auto slots = slots_of(ps);
    trainer::Optimizer opt(slots, adamw(dtype));
    for (int s = 0; s < 2; ++s) {
      for (size_t i = 0; i < ps.size(); ++i) slots[i].param.mutable_grad() = grads[s * ps.size() + i].clone();
      opt.step(1e-3);
    }
    std::map<std::string, torch::Tensor> m;
    for (auto& [k, v] : opt.state()) m[k] = v.clone();
    return m;
  };
  const auto f32 = state_after_two(StateDtype::kFloat32), q8 = state_after_two(StateDtype::kInt8);
  {
    auto slots = slots_of(ps);
    trainer::Optimizer opt(slots, adamw(StateDtype::kInt8));
    EXPECT_EQ(opt.load_state(f32), "float32 to int8");
    std::map<std::string, torch::Tensor> now;
    for (auto& [k, v] : opt.state()) now[k] = v;
    torch::Tensor codes, absmax;
    quant8::quantize(f32.at("exp_avg.w1"), true, codes, absmax);
    EXPECT_TRUE(now.at("exp_avg.w1").equal(codes));
    EXPECT_TRUE(now.at("exp_avg_absmax.w1").equal(absmax));
    EXPECT_TRUE(now.at("exp_avg.w2").equal(f32.at("exp_avg.w2"))) << "a tensor that stays float32 is copied";
  }
  {
    auto slots = slots_of(ps);
    trainer::Optimizer opt(slots, adamw(StateDtype::kFloat32));
    EXPECT_EQ(opt.load_state(q8), "int8 to float32");
    std::map<std::string, torch::Tensor> now;
    for (auto& [k, v] : opt.state()) now[k] = v;
    const torch::Tensor expected = quant8::dequantize(q8.at("exp_avg_sq.ln"), q8.at("exp_avg_sq_absmax.ln"), false);
    EXPECT_TRUE(now.at("exp_avg_sq.ln").equal(expected.view({4096})));
    EXPECT_EQ(now.count("exp_avg_absmax.w1"), 0u);
  }
}

// A live optimizer stores its moments in fewer bytes (memory.state auto after a give-up): tensor by tensor,
// to what loading the same float32 state into an int8 optimizer gives, and its next step is that one's.
TEST(OptimState, ConvertInPlaceIsWhatLoadingGives) {
  const auto ps = model_params();
  const auto grads = gradients(ps, 3);
  auto slots = slots_of(ps);
  trainer::Optimizer live(slots, adamw(StateDtype::kFloat32));
  for (int s = 0; s < 2; ++s) {
    for (size_t i = 0; i < ps.size(); ++i) slots[i].param.mutable_grad() = grads[s * ps.size() + i].clone();
    live.step(1e-3);
  }
  std::map<std::string, torch::Tensor> f32;
  for (auto& [k, v] : live.state()) f32[k] = v.clone();
  const int64_t before = live.state_bytes();
  auto loaded_slots = slots_of(ps);
  for (size_t i = 0; i < ps.size(); ++i) loaded_slots[i].param.data().copy_(slots[i].param.detach());
  trainer::Optimizer loaded(loaded_slots, adamw(StateDtype::kInt8));
  ASSERT_EQ(loaded.load_state(f32), "float32 to int8");
  EXPECT_EQ(live.convert_state(adamw(StateDtype::kBfloat16)), "float32 to bfloat16");
  EXPECT_EQ(live.convert_state(adamw(StateDtype::kInt8)), "bfloat16 to int8");
  EXPECT_LT(live.state_bytes(), before / 2);
  // From bfloat16 the codes are those of the bfloat16 values: compare with loading those.
  trainer::Optimizer via_bf16(slots_of(ps), adamw(StateDtype::kBfloat16));
  via_bf16.load_state(f32);
  std::map<std::string, torch::Tensor> bf16;
  for (auto& [k, v] : via_bf16.state()) bf16[k] = v.clone();
  ASSERT_EQ(loaded.load_state(bf16), "bfloat16 to int8");
  std::map<std::string, torch::Tensor> a, b;
  for (auto& [k, v] : live.state()) a[k] = v;
  for (auto& [k, v] : loaded.state()) b[k] = v;
  ASSERT_EQ(a.size(), b.size());
  for (auto& [k, v] : a) EXPECT_TRUE(v.equal(b.at(k))) << k;
  EXPECT_EQ(live.state_bytes(), loaded.state_bytes());
  for (size_t i = 0; i < ps.size(); ++i) {
    slots[i].param.mutable_grad() = grads[2 * ps.size() + i].clone();
    loaded_slots[i].param.mutable_grad() = grads[2 * ps.size() + i].clone();
  }
  live.step(1e-3);
  loaded.step(1e-3);
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_TRUE(slots[i].param.equal(loaded_slots[i].param)) << slots[i].name;
  EXPECT_THROW(live.convert_state(trainer::OptimConfig{}), std::invalid_argument);  // SGD has no moments to store so
}

// The state does not fit under a real cap: the step throws before any parameter or gradient changed.
// Once the state is there, the step allocates nothing the size of a tensor.
TEST(OptimState, OomWhileAllocatingChangesNothing) {
  trainer::cpu_allocator::install();
  const auto ps = model_params();
  const auto grads = gradients(ps, 1);
  for (StateDtype dtype : {StateDtype::kInt8, StateDtype::kBfloat16}) {
    auto slots = slots_of(ps);
    for (size_t i = 0; i < ps.size(); ++i) slots[i].param.mutable_grad() = grads[i].clone();
    trainer::Optimizer opt(slots, adamw(dtype));
    {
      trainer::ScopedCpuCap cap(trainer::cpu_allocator::live_bytes() + 4096);
      EXPECT_THROW(opt.step(1e-3), c10::OutOfMemoryError) << trainer::mode_name(dtype);
    }
    for (size_t i = 0; i < ps.size(); ++i) {
      EXPECT_TRUE(slots[i].param.equal(ps[i].value)) << ps[i].name << " changed";
      EXPECT_TRUE(slots[i].param.grad().equal(grads[i])) << ps[i].name << "'s gradient changed";
    }
    EXPECT_EQ(opt.steps(), 0);
    opt.allocate_state();
    trainer::cpu_allocator::reset_peak();
    const int64_t live = trainer::cpu_allocator::live_bytes();
    opt.step(1e-3);
    EXPECT_LT(trainer::cpu_allocator::peak_bytes() - live, 1024) << trainer::mode_name(dtype) << ": the step allocated";
  }
}

// Each bad value: one line naming the key, and what applies instead.
TEST(OptimState, BadValuesNameTheKey) {
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> bad = {
      {{"optim.name=sgd", "optim.state_dtype=int8"}, {"optim.state_dtype", "SGD's momentum buffer stays float32"}},
      {{"optim.name=adamw", "optim.state_dtype=int4"}, {"optim.state_dtype", "int4", "float32, bfloat16, int8"}},
      {{"optim.name=adamw", "optim.state_dtype=int8", "optim.implementation=foreach"},
       {"optim.implementation", "foreach keeps float32 moments", "auto or plain"}},
      {{"optim.name=lamb", "optim.state_dtype=bfloat16", "train.cuda_graph=on"}, {"train.cuda_graph", "bfloat16"}}};
  for (const auto& [sets, fragments] : bad) {
    std::vector<std::string> all = {"train.steps=10"};
    all.insert(all.end(), sets.begin(), sets.end());
    const std::string msg = testutil::error_text([&] { testutil::config_from_sets(all); });
    for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << sets.back() << ": " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  EXPECT_NO_THROW(testutil::config_from_sets({"train.steps=10", "optim.name=adamw", "optim.state_dtype=int8", "optim.implementation=plain"}));
  EXPECT_NO_THROW(testutil::config_from_sets({"train.steps=10", "optim.name=lamb", "optim.state_dtype=bfloat16"}));
  // Through the executable: exit 2 and the one line.
  TempDir dir;
  const auto r = testutil::run(testutil::trainer_cmd(dir.str() + "/run", "--set train.steps=1 --set optim.state_dtype=int8"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("optim.state_dtype"), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
}

namespace {

std::string int8_job(int64_t steps, const std::string& dtype = "int8") {
  return "--set model.name=resnet20 --set data.kind=synthetic --set data.shape=[1,16,16] --set data.synthetic_size=96"
         " --set data.test= --set train.global_batch=8 --set train.epochs=0 --set train.steps=" + std::to_string(steps) +
         " --set train.deterministic=true --set checkpoint.every_steps=2 --set checkpoint.every_seconds=0"
         " --set checkpoint.keep_last=20 --set log.every=1000 --set seed=11 --set train.threads=1 --set data.workers=1"
         " --set optim.name=adamw --set optim.lr=0.001 --set optim.weight_decay=0.05 --set optim.state_dtype=" + dtype;
}

}  // namespace

// Through the executable: a run with int8 state killed (SIGKILL) and started again with the same command
// ends bitwise where the uninterrupted run ends; a float32 checkpoint resumed with int8 state converts,
// with one warning.
TEST(OptimState, SigkilledRunResumesBitwiseAndAnotherDtypeConverts) {
  TempDir dir;
  const int64_t steps = 24;
  const auto whole = (dir / "whole").string(), killed = (dir / "killed").string();
  auto r = testutil::run(testutil::trainer_cmd(whole, int8_job(steps)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const pid_t pid = testutil::spawn(testutil::trainer_cmd(killed, int8_job(steps)), (dir / "killed.log").string());
  ASSERT_TRUE(testutil::wait_for_metrics(killed, [](auto& l) { return testutil::last_step(l) >= 8; }));
  kill(pid, SIGKILL);
  ASSERT_EQ(testutil::wait_exit(pid), 128 + SIGKILL) << "the run finished before the kill; make it longer";
  r = testutil::run(testutil::trainer_cmd(killed, int8_job(steps)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(testutil::events(killed, "resume").size(), 1u) << r.output;
  EXPECT_TRUE(testutil::bitwise_equal(testutil::final_weights(whole), testutil::final_weights(killed)));

  const auto f32 = (dir / "f32").string(), converted = (dir / "converted").string();
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(f32, int8_job(4, "float32"))).exit_code, 0);
  r = testutil::run(testutil::trainer_cmd(converted, int8_job(6) + " --resume " + f32 + "/checkpoints/step-00000004"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("converted them, float32 to int8"), std::string::npos) << r.output;
}

// `trainer bench --optimizer`: the update alone on a job's model, with the state's bytes as the optimizer
// holds them (resnet20: every conv weight of 16 x 16 x 3 x 3 = 2,304 values and less stays float32).
TEST(OptimState, BenchTimesTheUpdateAlone) {
  TempDir dir;
  const std::string job = "--set model.name=resnet20 --set data.kind=synthetic --set data.shape=[3,16,16] --set data.test="
                          " --set optim.name=adamw --set train.threads=1";
  std::map<std::string, nlohmann::json> out;
  for (const char* dtype : {"float32", "int8"}) {
    const std::string path = (dir / (std::string(dtype) + ".json")).string();
    const auto r = testutil::run(testutil::trainer_bin() + " bench --optimizer " + job + " --set optim.state_dtype=" + dtype +
                                 " --warmup 1 --steps 2 --out " + path);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    out[dtype] = nlohmann::json::parse(testutil::read_file(path));
  }
  const auto& f = out["float32"];
  const auto& q = out["int8"];
  EXPECT_EQ(f["mode"], "optimizer");
  EXPECT_EQ(f["device"], "cpu");
  EXPECT_EQ(f["parameters"].get<int64_t>(), q["parameters"].get<int64_t>());
  EXPECT_EQ(f["step_s"].size(), 2u);
  EXPECT_GT(f["ns_per_parameter"].get<double>(), 0);
  EXPECT_DOUBLE_EQ(f["state_bytes_per_parameter"].get<double>(), 8.0);
  int64_t quantized = 0, parameters = 0;
  for (const auto& t : q["param_shapes"]) {
    int64_t n = 1;
    for (int64_t d : t["shape"].get<std::vector<int64_t>>()) n *= d;
    parameters += n;
    if (quant8::quantizes(n)) quantized += n;
  }
  EXPECT_EQ(parameters, q["parameters"].get<int64_t>());
  EXPECT_EQ(q["state_bytes"].get<int64_t>(), 2 * quantized + 8 * quantized / 256 + 8 * (parameters - quantized));
  EXPECT_LT(q["state_bytes_per_parameter"].get<double>(), 3.0);
}

}  // namespace test_optim_state
