// Profiling a step on both sides (docs/BENCHMARKS.md, "Profiling a step"): `trainer bench --profile` and
// `bench/reference.py --profile` on tiny jobs, whose real CPU traces bench/profile_table.py must read into
// a table that agrees with what is known of the models (ResNet-18 runs 20 convolutions and 20 BatchNorms a
// step on either side; the tiny GPT 17 linear layers and 9 LayerNorms); the GPU-only parts of the table
// (idle gaps, syncs, kernel classes, kernels on one side only) on a small hand-made CUDA trace whose every
// figure is computed by hand below; and bad input. scripts/gpu-check.sh's profile phase in CPU mode is
// tested with its other phases (test_bench.cpp, GpuCheck).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <set>

#include "common/compat.h"
#include "test_util.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_profile {

using nlohmann::json;
using testutil::TempDir;

namespace {

std::string bench_cmd(const std::string& args) { return testutil::trainer_bin() + " bench " + args; }
std::string reference_py() { return testutil::python() + " " + testutil::source_dir() + "/bench/reference.py"; }
std::string table_py() { return testutil::python() + " " + testutil::source_dir() + "/bench/profile_table.py"; }
json read_json(const std::string& path) { return json::parse(testutil::read_file(path)); }

std::string last_line(std::string out) {
  while (!out.empty() && out.back() == '\n') out.pop_back();
  auto nl = out.rfind('\n');
  return nl == std::string::npos ? out : out.substr(nl + 1);
}

// Profiles `sets` on both sides (warmup 1, 2 profiled steps) and returns the table's JSON; the trainer's
// and Python's bench results go to dir/trainer.json and dir/python.json.
json profile_both(const TempDir& dir, const std::string& sets) {
  const std::string t = (dir / "trainer.trace.json").string(), p = (dir / "python.trace.json").string();
  auto r = testutil::run(bench_cmd(sets + " --warmup 1 --steps 2 --profile " + t + " --out " +
                                   (dir / "trainer.json").string()));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  r = testutil::run(reference_py() + " " + sets + " --warmup 1 --steps 2 --profile " + p + " --out " +
                    (dir / "python.json").string());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const std::string out = (dir / "table.json").string(), md = (dir / "table.md").string();
  r = testutil::run(table_py() + " --trainer " + t + " --python " + p + " --out-json " + out + " --out-md " + md);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return read_json(out);
}

double count(const json& side, const std::string& op) { return side["op_counts_per_step"].value(op, 0.0); }

bool listed(const json& list, const std::string& name) {
  return std::any_of(list.begin(), list.end(), [&](const json& e) { return e["name"] == name; });
}

}  // namespace

TEST(BenchProfile, ResNet18TracesOfBothSidesRunTheSameConvolutions) {
  TempDir dir;
  const json t = profile_both(dir, "--set model.name=resnet18 --set model.num_classes=10 --set data.kind=synthetic "
                                   "--set data.shape=[3,32,32] --set data.synthetic_size=64 --set data.test= "
                                   "--set train.global_batch=4 --set train.device=cpu --set train.threads=1");
  // The bench results say what was profiled: the two timed steps, after one warmup step.
  const json tr = read_json((dir / "trainer.json").string()), py = read_json((dir / "python.json").string());
  for (const json& r : {tr, py}) {
    EXPECT_EQ(r["profiled"], true);
    EXPECT_EQ(r["profile"]["first_step"], 2);
    EXPECT_EQ(r["profile"]["last_step"], 3);
    EXPECT_EQ(r["profile"]["activities"], json({"cpu"}));
  }
  // Kineto's own trace where LibTorch has Kineto; the collected events (Debian's 1.13) otherwise.
  EXPECT_TRUE(tr["profile"]["writer"] == "kineto" || tr["profile"]["writer"] == "events") << tr["profile"];

  ASSERT_EQ(t["schema"], "trainer-profile-table/1");
  EXPECT_EQ(t["kind"], "cpu") << "no GPU activity on a CPU run";
  const json& a = t["sides"]["trainer"];
  const json& b = t["sides"]["python"];
  for (const json* s : {&a, &b}) {
    EXPECT_EQ((*s)["steps"], 2);
    EXPECT_EQ((*s)["step_names"], json({"ProfilerStep#2", "ProfilerStep#3"}));
    // ResNet-18: conv1, 8 basic blocks of 2 convs, 3 projection shortcuts; a BatchNorm after each; one fc.
    EXPECT_EQ(count(*s, "aten::convolution"), 20) << (*s)["trace"];
    EXPECT_EQ(count(*s, "aten::batch_norm"), 20) << (*s)["trace"];
    EXPECT_EQ(count(*s, "aten::addmm"), 1) << "fc: " << (*s)["trace"];
    EXPECT_EQ(count(*s, "aten::max_pool2d"), 1) << (*s)["trace"];
    // The classes: every op's self time once (their sum cannot exceed the steps' time on one thread).
    const json& ms = (*s)["time_ms_per_step"];
    EXPECT_GT(ms["convolution"].get<double>(), 0) << (*s)["trace"];
    EXPECT_GT(ms["normalization"].get<double>(), 0) << (*s)["trace"];
    EXPECT_GT(ms["optimizer"].get<double>(), 0) << "the optimizer's scope: " << (*s)["trace"];
    EXPECT_GT(ms["loss"].get<double>(), 0) << (*s)["trace"];
    EXPECT_LE((*s)["total_class_ms_per_step"].get<double>(), 1.001 * (*s)["step_ms"].get<double>()) << (*s)["trace"];
    EXPECT_GT((*s)["host_outside_ops_ms_per_step"].get<double>(), 0);
  }
  for (const char* op : {"aten::convolution", "aten::batch_norm", "aten::addmm"}) {
    EXPECT_FALSE(listed(t["only_trainer"], op)) << op;
    EXPECT_FALSE(listed(t["only_python"], op)) << op;
  }
  // The trainer's loop stages, once a step each, the step's own stage holding the whole step; Python's
  // loop has none. The agreement runs between two steps, so the last profiled step's is not in the trace.
  const json& stages = t["sides"]["trainer"]["stages_per_step"];
  const double step_ms = t["sides"]["trainer"]["step_ms"].get<double>();
  for (const char* stage : {"trainer.fetch", "trainer.poll", "trainer.step", "trainer.snapshot", "trainer.record"}) {
    ASSERT_TRUE(stages.contains(stage)) << stage << ": " << stages;
    EXPECT_EQ(stages[stage]["calls_per_step"], 1) << stage;
    EXPECT_GE(stages[stage]["ms_per_step"].get<double>(), stages[stage]["outside_ops_ms_per_step"].get<double>());
    EXPECT_LE(stages[stage]["ms_per_step"].get<double>(), step_ms) << stage;
  }
  EXPECT_GT(stages["trainer.step"]["ms_per_step"].get<double>(), 0.5 * step_ms) << stages;
  EXPECT_EQ(stages["trainer.agree"]["calls_per_step"], 0.5) << stages;
  EXPECT_TRUE(t["sides"]["python"]["stages_per_step"].empty());
  const std::string md = testutil::read_file(dir / "table.md");
  EXPECT_NE(md.find("| `aten::convolution` calls | 20 | 20 | +0 |"), std::string::npos) << md;
  EXPECT_NE(md.find("CPU ops by their self time"), std::string::npos) << md;
  EXPECT_NE(md.find("Host stages of trainer (per step: calls, ms, of which outside any op):\n\n- `trainer.fetch`: 1, "),
            std::string::npos) << md;
  EXPECT_EQ(md.find("Host stages of python"), std::string::npos) << md;
}

TEST(BenchProfile, TinyGptTracesOfBothSidesRunTheSameLayers) {
  TempDir dir;
  // With the vocabulary padded on both sides (300 -> 320): the same layers, and the cut-off logits.
  const json t = profile_both(dir, "--set model.name=gpt_tiny --set model.context=32 --set data.kind=synthetic "
                                   "--set data.synthetic_size=8 --set data.test= --set model.vocab_size=300 "
                                   "--set model.vocab_multiple=64 --set optim.name=adamw --set train.global_batch=2 "
                                   "--set train.device=cpu --set train.threads=1");
  const json& a = t["sides"]["trainer"];
  const json& b = t["sides"]["python"];
  for (const json* s : {&a, &b}) {
    // 4 blocks x (c_attn, attn.c_proj, c_fc, mlp.c_proj) and the tied output projection, the 16 with
    // their bias inside one addmm (model.fused_bias); 2 LayerNorms a block and ln_f; one cross entropy.
    EXPECT_EQ(count(*s, "aten::linear"), 17) << (*s)["trace"];
    EXPECT_EQ(count(*s, "aten::addmm"), 16) << (*s)["trace"];
    EXPECT_EQ(count(*s, "aten::layer_norm"), 9) << (*s)["trace"];
    EXPECT_EQ(count(*s, "aten::cross_entropy_loss"), 1) << (*s)["trace"];
    EXPECT_EQ(count(*s, "aten::convolution"), 0) << (*s)["trace"];
    EXPECT_GT((*s)["time_ms_per_step"]["GEMM"].get<double>(), 0) << (*s)["trace"];
  }
  // Fused attention on both sides where torch has it (2.x), the plain path on both otherwise.
  EXPECT_EQ(count(a, "aten::scaled_dot_product_attention"), count(b, "aten::scaled_dot_product_attention"));
  EXPECT_EQ(count(a, "aten::scaled_dot_product_attention"), trainer::compat::kHasFusedAttention ? 4 : 0);
}

// The CUDA-only figures, on two hand-made traces in Kineto's format (tests/fixtures/profile_cuda_*.json):
// two steps each. Per step of the trainer's (1000 us): kernels conv 100-280 (launched by aten::convolution),
// nchwToNhwc 280-300 (also by aten::convolution: a layout conversion, "copies and casts"), bn 300-400
// (aten::batch_norm), add 450-500 (aten::add_), a multi-tensor kernel 700-760 and a mul 760-800 (both
// inside Optimizer.step#SGD.step: "optimizer", though mul_ alone is elementwise), a D2H copy 810-815;
// one cudaStreamSynchronize of 130 us inside aten::_local_scalar_dense. Busy 180 + 20 + 100 + 50 + 60 +
// 40 + 5 = 455 us, idle 1000 - 455 = 545 us. Gaps over both steps (0-2000 us): 0-100, 400-450, 500-700,
// 800-810, 815-1100 (285: across the step boundary), 1400-1450, 1500-1700, 1800-1810, 1815-2000 (185).
// Python's (900 us): conv 100-300, bn 300-400, another add kernel 420-450, a fused SGD kernel 600-650
// (aten::_fused_sgd_ in the optimizer's scope), D2H 710-715; syncs: cudaStreamSynchronize 80 us in
// aten::_local_scalar_dense and cudaDeviceSynchronize 20 us in aten::copy_. Busy 200 + 100 + 30 + 50 + 5
// = 385 us, idle 515 us.
TEST(ProfileTable, GpuFiguresOfAHandMadeCudaTrace) {
  TempDir dir;
  const std::string fx = testutil::source_dir() + "/tests/fixtures/";
  const std::string out = (dir / "t.json").string(), md = (dir / "t.md").string();
  auto r = testutil::run(table_py() + " --trainer " + fx + "profile_cuda_trainer.json --python " + fx +
                         "profile_cuda_python.json --title 'fixture' --out-json " + out + " --out-md " + md);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json t = read_json(out);
  EXPECT_EQ(t["kind"], "gpu");
  const json& a = t["sides"]["trainer"];
  const json& b = t["sides"]["python"];
  EXPECT_EQ(a["steps"], 2) << "Kineto's gpu_user_annotation copy of a step is not a step";
  EXPECT_DOUBLE_EQ(a["step_ms"].get<double>(), 1.0);
  EXPECT_NEAR(a["gpu_busy_ms_per_step"].get<double>(), 0.455, 1e-12);
  EXPECT_NEAR(a["gpu_idle_ms_per_step"].get<double>(), 0.545, 1e-12);
  EXPECT_NEAR(a["gpu_utilization"].get<double>(), 0.455, 1e-12);
  const json& ac = a["time_ms_per_step"];
  EXPECT_NEAR(ac["convolution"].get<double>(), 0.180, 1e-12);
  EXPECT_NEAR(ac["normalization"].get<double>(), 0.100, 1e-12);
  EXPECT_NEAR(ac["elementwise"].get<double>(), 0.050, 1e-12);
  EXPECT_NEAR(ac["optimizer"].get<double>(), 0.100, 1e-12);
  EXPECT_NEAR(ac["copies and casts"].get<double>(), 0.025, 1e-12);
  EXPECT_EQ(ac["GEMM"].get<double>(), 0.0);
  EXPECT_EQ(a["layout_conversions_per_step"].get<double>(), 1.0);
  EXPECT_EQ(a["syncs_per_step"].get<double>(), 1.0);
  EXPECT_NEAR(a["sync_wait_ms_per_step"].get<double>(), 0.130, 1e-12);
  EXPECT_EQ(a["sync_callers_per_step"], json({{"aten::_local_scalar_dense", 1.0}}));
  EXPECT_EQ(a["d2h_copies_per_step"].get<double>(), 1.0);
  ASSERT_EQ(a["largest_gaps"].size(), 5u);
  EXPECT_NEAR(a["largest_gaps"][0]["ms"].get<double>(), 0.285, 1e-12);
  EXPECT_EQ(a["largest_gaps"][0]["after_kernel"], "Memcpy DtoH (Device -> Pinned)");
  EXPECT_EQ(a["largest_gaps"][0]["before_kernel"], "cudnn::foo_fprop_kernel<float>");
  EXPECT_EQ(a["largest_gaps"][0]["next_launched_by"], "aten::convolution");
  EXPECT_NEAR(a["largest_gaps"][1]["ms"].get<double>(), 0.200, 1e-12);
  EXPECT_EQ(a["largest_gaps"][1]["next_launched_by"], "aten::_foreach_add_");

  EXPECT_DOUBLE_EQ(b["step_ms"].get<double>(), 0.9);
  EXPECT_NEAR(b["gpu_busy_ms_per_step"].get<double>(), 0.385, 1e-12);
  EXPECT_NEAR(b["gpu_idle_ms_per_step"].get<double>(), 0.515, 1e-12);
  EXPECT_NEAR(b["time_ms_per_step"]["convolution"].get<double>(), 0.200, 1e-12);
  EXPECT_NEAR(b["time_ms_per_step"]["optimizer"].get<double>(), 0.050, 1e-12);
  EXPECT_EQ(b["layout_conversions_per_step"].get<double>(), 0.0);
  EXPECT_EQ(b["syncs_per_step"].get<double>(), 2.0);
  EXPECT_NEAR(b["sync_wait_ms_per_step"].get<double>(), 0.100, 1e-12);
  EXPECT_EQ(b["sync_callers_per_step"], json({{"aten::_local_scalar_dense", 1.0}, {"aten::copy_", 1.0}}));

  std::set<std::string> only_a, only_b;
  for (const auto& k : t["only_trainer"]) only_a.insert(k["name"].get<std::string>());
  for (const auto& k : t["only_python"]) only_b.insert(k["name"].get<std::string>());
  EXPECT_EQ(only_a, (std::set<std::string>{"at::native::vectorized_elementwise_kernel<4, add>",
                                           "at::native::vectorized_elementwise_kernel<4, mul>",
                                           "multi_tensor_apply_kernel<TensorListMetadata<3>, add>",
                                           "nchwToNhwcKernel<float>"}));
  EXPECT_EQ(only_b, (std::set<std::string>{"at::native::fused_sgd_kernel<float>",
                                           "at::native::unrolled_elementwise_kernel<add>"}));
  EXPECT_TRUE(t["count_differs"].empty()) << t["count_differs"];
  const std::string text = testutil::read_file(md);
  EXPECT_NE(text.find("### fixture"), std::string::npos) << text;
  EXPECT_NE(text.find("| GPU idle between kernels (ms) | 0.545 | 0.515 | +0.030 |"), std::string::npos) << text;
  EXPECT_NE(text.find("| host-device syncs | 1 | 2 | -1 |"), std::string::npos) << text;
}

TEST(ProfileTable, BadInputIsOneLine) {
  TempDir dir;
  const std::string fx = testutil::source_dir() + "/tests/fixtures/profile_cuda_python.json";
  auto r = testutil::run(table_py() + " --trainer " + (dir / "missing.json").string() + " --python " + fx);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(last_line(r.output), "error: " + (dir / "missing.json").string() +
                                     ": cannot read the trace (No such file or directory)");
  testutil::write_file(dir / "nosteps.json", R"({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::add",
      "ts": 1, "dur": 2, "pid": 1, "tid": 1}]})");
  r = testutil::run(table_py() + " --trainer " + (dir / "nosteps.json").string() + " --python " + fx);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(last_line(r.output), "error: " + (dir / "nosteps.json").string() +
                                     ": no \"ProfilerStep#<n>\" scopes; profile with `trainer bench --profile` or "
                                     "`bench/reference.py --profile`");
  testutil::write_file(dir / "text.json", "not json");
  r = testutil::run(table_py() + " --trainer " + fx + " --python " + (dir / "text.json").string());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(last_line(r.output).rfind("error: " + (dir / "text.json").string() + ": not a JSON trace", 0), 0u)
      << r.output;
  // --profile profiles training steps only.
  r = testutil::run(bench_cmd("--loader-only --set data.kind=synthetic --profile " + (dir / "x.json").string()));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(last_line(r.output), "error: command line: --profile profiles training steps; it does not go with "
                                 "--loader-only, --optimizer, --oom or --memory-curve");
}

}  // namespace test_profile
