// The memory plan (trainer/memory/plan.h, trainer/run/memory_plan.h) and the model footprints it counts
// from (models/footprint.h): parameters against the built models and the published sizes, the plan's rung
// by hand, its peak against the peak a real run measures, and `trainer plan` on the command line.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>

#include <signal.h>

#include "models/attention.h"
#include "models/footprint.h"
#include "models/registry.h"
#include "models/summary.h"
#include "test_util.h"
#include "train_util.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/plan.h"
#include "trainer/numerics/moments.h"
#include "trainer/numerics/optim.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_memory_plan {

using namespace trainer;
using namespace testutil;

namespace {

std::vector<int64_t> sorted_numels(torch::nn::Module& m) {
  std::vector<int64_t> n;
  for (const auto& p : m.parameters()) n.push_back(p.numel());
  std::sort(n.begin(), n.end());
  return n;
}

int64_t buffer_values(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& b : m.buffers()) n += b.numel();
  return n;
}

}  // namespace

TEST(Footprint, ParametersAreTheBuiltModels) {
  struct Case {
    std::string name;
    models::ModelOptions options;
    std::vector<int64_t> shape;
  };
  const std::vector<Case> cases = {
      {"resnet20", models::ModelOptions().num_classes(10).in_channels(1), {1, 28, 28}},
      {"resnet18", models::ModelOptions().num_classes(100), {3, 64, 64}},
      {"resnet50", models::ModelOptions(), {3, 224, 224}},
      {"plain_cnn", models::ModelOptions().in_channels(3), {3, 32, 32}},
      {"gpt_tiny", models::ModelOptions().vocab_multiple(64).vocab_size(300), {128}},
      {"llama_tiny", models::ModelOptions(), {128}},
      {"llama_tiny", models::ModelOptions().llama(models::llama_tiny().qkv_bias(true).tie_embeddings(false)), {64}},
      {"vit_tiny", models::ModelOptions().num_classes(10).in_channels(1), {1, 28, 28}},
      {"smollm2_135m", models::ModelOptions().context(256), {256}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    auto model = models::create_model(c.name, c.options);
    const auto f = models::model_footprint(c.name, c.options, c.shape, models::fused_attention_available());
    auto counted = f.parameters;
    std::sort(counted.begin(), counted.end());
    EXPECT_EQ(counted, sorted_numels(*model));
    EXPECT_EQ(f.buffers, buffer_values(*model));
    EXPECT_EQ(f.parameter_count(), models::count_parameters(*model));
  }
}

TEST(Footprint, PublishedSizesWithoutBuildingThem) {
  // The model cards' parameter counts (tied embeddings; GPT-2 with its 50257-token vocabulary).
  const auto count = [](const std::string& name, std::vector<int64_t> shape) {
    return models::model_footprint(name, models::ModelOptions(), shape, false).parameter_count();
  };
  EXPECT_EQ(count("gpt2", {1024}), 124439808);
  EXPECT_EQ(count("smollm2_135m", {2048}), 134515008);
  EXPECT_EQ(count("qwen2_5_0_5b", {2048}), 494032768);
  EXPECT_EQ(count("llama3_2_1b", {2048}), 1235814400);
  EXPECT_EQ(count("resnet50", {3, 224, 224}), 25557032);  // torchvision's resnet50
}

TEST(Footprint, ActivationsHandCounted) {
  // ResNet-20 on 1x28x28: the stem keeps its convolution's and ReLU's outputs (2 x 16 x 784); each basic
  // block keeps four maps of its output's size; the head its pooled features and two rows of classes.
  const auto f = models::model_footprint("resnet20", models::ModelOptions().num_classes(10).in_channels(1), {1, 28, 28}, false);
  const double stem = 2 * 16 * 784, blocks = 3 * 4 * (16 * 784 + 32 * 196 + 64 * 49), head = 64 + 2 * 10;
  EXPECT_DOUBLE_EQ(f.saved, stem + blocks + head);
  EXPECT_DOUBLE_EQ(f.transient, 2.0 * 32 * 196 > 2.0 * 16 * 784 ? 2.0 * 32 * 196 : 2.0 * 16 * 784);
  // Recomputed: the stem, each block's output, the largest block's own maps, the head.
  EXPECT_DOUBLE_EQ(f.saved_checkpointed, stem + 3 * (16 * 784 + 32 * 196 + 64 * 49) + 4 * 16 * 784 + head);
  // A language model's log-probabilities stay float32: V per token.
  const auto g = models::model_footprint("gpt_tiny", models::ModelOptions(), {128}, false);
  EXPECT_DOUBLE_EQ(g.saved_float32, 128.0 * 256);
  EXPECT_LT(g.saved_checkpointed, g.saved / 2);
}

TEST(MemoryPlan, StateBytesAreWhatTheMomentsHold) {
  for (StateDtype d : {StateDtype::kFloat32, StateDtype::kBfloat16, StateDtype::kInt8}) {
    std::vector<ParamSlot> params;
    int64_t counted = 0;
    for (int64_t n : {100, 4096, 4100, 65536}) {
      params.push_back({"p" + std::to_string(n), torch::zeros({n}), true});
      counted += AdamMoments::bytes_for(n, d);
    }
    AdamMoments moments(d);
    moments.allocate(params);
    EXPECT_EQ(moments.bytes(), counted) << mode_name(d);
  }
  EXPECT_EQ(AdamMoments::bytes_for(65536, StateDtype::kInt8), 2 * (65536 + 256 * 4));
  EXPECT_EQ(AdamMoments::bytes_for(4100, StateDtype::kInt8), 2 * 4100 * 4);  // not whole blocks: float32
}

TEST(MemoryPlan, RungByHand) {
  PlanJob job;
  job.fixed = {{"weights", 100, ""}, {"state", 200, ""}};
  job.gradient_bytes = 100;
  job.largest_gradient_bytes = 10;
  job.per_sample_bytes = 50;
  job.per_sample_checkpointed_bytes = 20;
  job.rank_batch = 16;
  job.micro_batch = 16;
  // One micro-batch: fixed 300 + largest 10 + max(gradients 100, 16 x 50) = 1110.
  EXPECT_EQ(planned_peak(job, 50, 16), 1110);
  // Several: the gradients are held beside the activations: 300 + 10 + 100 + 8 x 50 = 810.
  EXPECT_EQ(planned_peak(job, 50, 8), 810);
  job.cap = 0;
  auto p = plan_memory(job);
  EXPECT_TRUE(p.fits);
  EXPECT_EQ(p.micro_batch, 16);
  EXPECT_EQ(p.peak_bytes, 1110);
  // Under 700 bytes the ladder halves 16 -> 8 (810) -> 4 (610): the first that fits.
  job.cap = 700;
  p = plan_memory(job);
  EXPECT_TRUE(p.fits);
  EXPECT_EQ(p.micro_batch, 4);
  EXPECT_EQ(p.accum_steps, 4);
  EXPECT_FALSE(p.checkpointing);
  EXPECT_EQ(p.start_peak_bytes, 1110);
  // Under 450: 1 sample kept is 460; recomputed, 8 is 570, 4 is 490, 2 is 450.
  job.cap = 450;
  p = plan_memory(job);
  EXPECT_TRUE(p.fits);
  EXPECT_EQ(p.micro_batch, 2);
  EXPECT_TRUE(p.checkpointing);
  // Without the ladder's recomputation it does not fit, by 10 bytes at micro-batch 1.
  job.ladder_checkpointing = false;
  p = plan_memory(job);
  EXPECT_FALSE(p.fits);
  EXPECT_EQ(p.micro_batch, 1);
  EXPECT_EQ(p.short_bytes, 10);
  EXPECT_NE(render_plan(job, p).find("does not fit: micro-batch 1 (x16), activations kept needs 460 B, 10 B over the cap of 450 B"),
            std::string::npos)
      << render_plan(job, p);
  // auto: the largest size whose peak fits (not only halvings): 300 + 10 + 100 + 50 m <= 700 -> 5.
  job.micro_batch = 0;
  job.cap = 700;
  p = plan_memory(job);
  EXPECT_EQ(p.micro_batch, 5);
  // The whole batch in one micro-batch holds no gradients beside its activations: 310 + 16 x 50 = 1110, and
  // under 1110 it fits while 15 (x2: 410 + 750 = 1160) does not.
  job.cap = 1110;
  EXPECT_EQ(plan_memory(job).micro_batch, 16);
  job.min_micro_batch = 0;
  EXPECT_THROW(plan_memory(job), std::invalid_argument);
}

TEST(MemoryPlan, WithinTenPercentOfTheMeasuredPeak) {
  // The plan of a job under no cap at a fixed micro-batch, against the largest step peak the trainer's
  // allocator counts in a short run of it (after the first step, which allocates the optimizer's state).
  struct Case {
    std::string config;
    std::vector<std::string> sets;
  };
  // The attention runs the plain formula on LibTorch 1.13 and the fused kernel on 2.x: each is counted.
  const std::vector<Case> cases = {
      {"configs/resnet20_fmnist.yaml", {"data.kind=synthetic", "data.test=", "data.shape=[1,28,28]", "train.global_batch=64", "train.micro_batch=64"}},
      {"configs/gpt_tiny_fortunes.yaml", {"data.kind=synthetic", "data.test=", "train.global_batch=16", "train.micro_batch=8"}},
      {"configs/llama_tiny_fortunes.yaml", {"data.kind=synthetic", "data.test=", "train.global_batch=16", "train.micro_batch=16"}},
      {"configs/vit_fmnist.yaml", {"data.kind=synthetic", "data.test=", "data.shape=[1,28,28]", "train.global_batch=32", "train.micro_batch=32"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.config);
    TempDir dir("plan_peak");
    std::string sets = " --set memory.limit=none --set data.synthetic_size=64";
    for (const auto& s : c.sets) sets += " --set '" + s + "'";
    const auto plan = run(trainer_bin() + " plan --config " + source_dir() + "/" + c.config + sets + " --json " +
                          (dir / "plan.json").string());
    ASSERT_EQ(plan.exit_code, 0) << plan.output;
    const auto trained = run(trainer_bin() + " --run-dir " + (dir / "run").string() + " --config " + source_dir() + "/" +
                             c.config + sets + " --set train.steps=3 --set train.epochs=0 --set log.every=1" +
                             " --set checkpoint.final=false --set train.eval_every=1000000");
    ASSERT_EQ(trained.exit_code, 0) << trained.output;
    int64_t measured = 0, steps = 0;
    std::ifstream metrics(dir / "run" / "metrics.jsonl");
    for (std::string line; std::getline(metrics, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("event") || !j.contains("mem_peak_bytes")) continue;
      if (steps++ > 0) measured = std::max(measured, j["mem_peak_bytes"].get<int64_t>());
    }
    const auto planned = nlohmann::json::parse(read_file(dir / "plan.json"))["peak_bytes"].get<int64_t>();
    ASSERT_GT(measured, 0);
    const double error = static_cast<double>(planned - measured) / static_cast<double>(measured);
    EXPECT_LT(std::abs(error), 0.10) << "planned " << planned << ", measured " << measured;
  }
}

TEST(PlanCommand, DoesNotFitNamesWhatWould) {
  // Llama 3.2 1B (256 tokens, AdamW) under 16 GiB: weights, gradients and float32 moments alone are over;
  // int8 moments fit. Nothing is allocated: the plan answers at once.
  const std::string cmd = trainer_bin() + " plan --config " + source_dir() + "/configs/bench_llama3_2_1b_cap_cpu.yaml" +
                          " --set memory.limit=16GiB";
  const auto r = run(cmd);
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("does not fit: micro-batch 1 (x8), every block recomputed needs"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("optim.state_dtype: int8: fits"), std::string::npos) << r.output;
  const auto int8 = run(cmd + " --set optim.state_dtype=int8");
  EXPECT_EQ(int8.exit_code, 0) << int8.output;
  EXPECT_NE(int8.output.find("adamw's two moments, int8"), std::string::npos) << int8.output;
  // Bad input: one line, exit 2.
  const auto bad = run(trainer_bin() + " plan --config " + source_dir() + "/configs/gpt_tiny_fortunes.yaml --set optim.nope=1");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_EQ(std::count(bad.output.begin(), bad.output.end(), '\n'), 1) << bad.output;
  // --dry-run prints the same plan.
  const auto dry = run(trainer_bin() + " --dry-run --config " + source_dir() + "/configs/gpt_tiny_fortunes.yaml --set data.train=/nonexistent");
  EXPECT_EQ(dry.exit_code, 0) << dry.output;
  EXPECT_NE(dry.output.find("# memory plan (trainer plan)"), std::string::npos) << dry.output;
  EXPECT_NE(dry.output.find("fits: micro-batch"), std::string::npos) << dry.output;
}

// dist.shard: the plan of a rank counts its 1/N of the optimizer state (Llama 3.2 1B's AdamW moments: 9.21
// GiB whole, 4.60 GiB a rank on 2 ranks); in one process the key changes nothing.
TEST(PlanCommand, ShardedStateIsTheRanksShare) {
  const std::string cmd = trainer_bin() + " plan --config " + source_dir() + "/configs/bench_llama3_2_1b_cap_cpu.yaml" +
                          " --set memory.limit=16GiB --set dist.shard=optimizer";
  const std::string rank0 = "env WORLD_SIZE=2 RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29999 ";
  const auto one = run(cmd), two = run(rank0 + cmd), plain = run(rank0 + cmd + " --set dist.shard=none");
  EXPECT_NE(one.output.find("9.21 GiB    adamw's two moments, float32\n"), std::string::npos) << one.output;
  EXPECT_NE(plain.output.find("9.21 GiB    adamw's two moments, float32\n"), std::string::npos) << plain.output;
  EXPECT_NE(two.output.find("4.60 GiB    adamw's two moments, float32; this rank's 1/2 (dist.shard optimizer)"),
            std::string::npos) << two.output;
}

}  // namespace test_memory_plan

namespace test_memory_plan {

TEST(MemoryState, AutoStoresTheMomentsInFewerBytesToFit) {
  // llama_tiny on 16 tokens with AdamW: float32 moments plan 12.07 MiB, bfloat16 9.12 MiB, int8 7.68 MiB.
  // Under 8.3 MiB only int8 fits.
  TempDir dir("memory_state");
  const std::string job = trainer_bin() + " --config " + source_dir() + "/configs/llama_tiny_fortunes.yaml" +
                          " --set data.kind=synthetic --set data.test= --set model.context=16 --set train.global_batch=1" +
                          " --set optim.name=adamw --set train.steps=3 --set train.epochs=0 --set checkpoint.final=false" +
                          " --set memory.limit=8.3MiB";
  // fixed: the run gives up, and says which setting the plan finds would fit.
  const auto fixed = run(job + " --run-dir " + (dir / "fixed").string());
  EXPECT_EQ(fixed.exit_code, 3) << fixed.output;
  EXPECT_NE(fixed.output.find("the memory plan under 8.30 MiB finds that optim.state_dtype: int8 (peak 7.68 MiB) would "
                              "fit (memory.state: auto moves to it by itself)"),
            std::string::npos)
      << fixed.output;
  // auto: the moments are stored in int8 from the start; the run trains, under the cap, and records it.
  const auto autom = run(job + " --set memory.state=auto --run-dir " + (dir / "auto").string());
  ASSERT_EQ(autom.exit_code, 0) << autom.output;
  EXPECT_NE(autom.output.find("memory.state auto: the job does not fit under 8.30 MiB with float32 moments"),
            std::string::npos)
      << autom.output;
  EXPECT_NE(read_file(dir / "auto" / "resolved_config.yaml").find("state_dtype: \"int8\""), std::string::npos);
  bool event = false;
  int64_t steps = 0;
  std::ifstream metrics(dir / "auto" / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("event", "") == "memory_state") {
      event = true;
      EXPECT_EQ(j["from"], "float32");
      EXPECT_EQ(j["to"], "int8");
      EXPECT_EQ(j["setting"], "optim.state_dtype");
    }
    if (!j.contains("event") && j.contains("mem_peak_bytes")) {
      ++steps;
      EXPECT_LE(j["mem_peak_bytes"].get<int64_t>(), parse_bytes("8.3MiB"));
    }
  }
  EXPECT_TRUE(event);
  EXPECT_EQ(steps, 3);
  // With enough memory, auto changes nothing.
  const auto roomy = run(job + " --set memory.state=auto --set memory.limit=64MiB --run-dir " + (dir / "roomy").string());
  ASSERT_EQ(roomy.exit_code, 0) << roomy.output;
  EXPECT_NE(read_file(dir / "roomy" / "resolved_config.yaml").find("state_dtype: \"float32\""), std::string::npos);
  // SGD has no moments to store in fewer bytes: one line, exit 2.
  const auto sgd = run(trainer_bin() + " --dry-run --set memory.state=auto --set optim.name=sgd");
  EXPECT_EQ(sgd.exit_code, 2) << sgd.output;
  EXPECT_NE(sgd.output.find("memory.state"), std::string::npos) << sgd.output;
}

}  // namespace test_memory_plan

namespace test_memory_plan {

TEST(MemoryState, AutoAfterAGiveUpTheStartDidNotForesee) {
  // The run starts with room (float32 moments fit), then its cap is cut through control.yaml to where only
  // int8 moments fit: the ladder gives up at its floor, and memory.state auto stores the moments in fewer
  // bytes (bfloat16, then int8 if that fails too) and runs the same step again. No step is lost.
  TempDir dir("memory_state_cut");
  const std::string run_dir = (dir / "run").string();
  const std::string job = "--config " + source_dir() + "/configs/llama_tiny_fortunes.yaml" +
                          " --set data.kind=synthetic --set data.test= --set model.context=16 --set train.global_batch=1" +
                          " --set optim.name=adamw --set train.steps=100000 --set train.epochs=0 --set log.every=1" +
                          " --set checkpoint.every_steps=0 --set memory.limit=64MiB --set memory.state=auto";
  const pid_t pid = spawn(trainer_cmd(run_dir, job), (dir / "log.txt").string());
  ASSERT_TRUE(wait_for_metrics(run_dir, [](auto& l) { return last_step(l) >= 5; })) << read_file(dir / "log.txt");
  write_file(dir / "run" / "control.yaml", "memory:\n  limit: 8.3MiB\n");
  int64_t converted_at = 0;
  const bool converted = wait_for_metrics(run_dir, [&](auto& lines) {
    for (auto& l : lines)
      if (l.value("event", "") == "memory_state" && l.value("to", "") == "int8") converted_at = l["step"].template get<int64_t>();
    return converted_at > 0 && last_step(lines) >= converted_at + 5;
  });
  kill(pid, SIGTERM);
  const int code = wait_exit(pid);
  ASSERT_TRUE(converted) << read_file(dir / "log.txt");
  EXPECT_EQ(code, 143) << read_file(dir / "log.txt");
  const auto changes = events(run_dir, "memory_state");
  ASSERT_GE(changes.size(), 1u);
  EXPECT_EQ(changes.front()["from"], "float32");
  EXPECT_EQ(changes.front()["reason"], "gave_up");
  EXPECT_TRUE(events(run_dir, "oom_gave_up").empty());
  const auto steps = step_lines(run_dir);
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(steps[i]["samples_seen"].get<int64_t>(), static_cast<int64_t>(i + 1));  // no step lost or repeated
    if (steps[i]["step"].get<int64_t>() >= converted_at)
      EXPECT_LE(steps[i]["mem_peak_bytes"].get<int64_t>(), parse_bytes("8.3MiB"));
  }
  EXPECT_NE(read_file(dir / "run" / "resolved_config.yaml").find("state_dtype: \"int8\""), std::string::npos);
}

}  // namespace test_memory_plan

namespace test_memory_plan {

TEST(MemoryState, AutoAfterAGiveUpWithInt8MomentsStoresTheWeightsInBfloat16) {
  // int8 moments from the start, float32 weights; the cap is cut to where only bfloat16 weights fit (about
  // 4.5 MiB of weights, gradients and moments against 7.4 MiB with float32 weights). The ladder gives up at
  // its floor, memory.state auto rounds the weights to bfloat16 in place, and the same step runs again.
  TempDir dir("memory_state_weights");
  const std::string run_dir = (dir / "run").string();
  const std::string job = "--config " + source_dir() + "/configs/llama_tiny_fortunes.yaml" +
                          " --set data.kind=synthetic --set data.test= --set model.context=16 --set train.global_batch=1" +
                          " --set optim.name=adamw --set optim.state_dtype=int8 --set train.steps=100000" +
                          " --set train.epochs=0 --set log.every=1 --set checkpoint.every_steps=0" +
                          " --set memory.limit=64MiB --set memory.state=auto";
  const pid_t pid = spawn(trainer_cmd(run_dir, job), (dir / "log.txt").string());
  ASSERT_TRUE(wait_for_metrics(run_dir, [](auto& l) { return last_step(l) >= 5; })) << read_file(dir / "log.txt");
  write_file(dir / "run" / "control.yaml", "memory:\n  limit: 6MiB\n");
  int64_t converted_at = 0;
  const bool converted = wait_for_metrics(run_dir, [&](auto& lines) {
    for (auto& l : lines)
      if (l.value("event", "") == "memory_state" && l.value("setting", "") == "model.param_dtype")
        converted_at = l["step"].template get<int64_t>();
    return converted_at > 0 && last_step(lines) >= converted_at + 5;
  });
  kill(pid, SIGTERM);
  const int code = wait_exit(pid);
  const std::string log = read_file(dir / "log.txt");
  ASSERT_TRUE(converted) << log;
  EXPECT_EQ(code, 143) << log;
  const auto changes = events(run_dir, "memory_state");
  ASSERT_EQ(changes.size(), 2u) << log;
  EXPECT_EQ(changes[0]["setting"], "model.param_dtype");
  EXPECT_EQ(changes[0]["from"], "float32");
  EXPECT_EQ(changes[0]["to"], "bfloat16");
  EXPECT_EQ(changes[0]["reason"], "gave_up");
  EXPECT_EQ(changes[1]["setting"], "optim.stochastic_rounding");
  EXPECT_TRUE(events(run_dir, "oom_gave_up").empty());
  const auto steps = step_lines(run_dir);
  double before = 0, after = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(steps[i]["samples_seen"].get<int64_t>(), static_cast<int64_t>(i + 1));  // no step lost or repeated
    const int64_t step = steps[i]["step"].get<int64_t>();
    EXPECT_TRUE(std::isfinite(steps[i]["loss"].get<double>())) << "step " << step;
    if (step >= converted_at) EXPECT_LE(steps[i]["mem_peak_bytes"].get<int64_t>(), parse_bytes("6MiB")) << "step " << step;
    if (step == converted_at - 1) before = steps[i]["loss"].get<double>();
    if (step == converted_at) after = steps[i]["loss"].get<double>();
  }
  // The step after the move starts from the weights rounded to nearest: its loss is the float32 weights'
  // within bfloat16's resolution, not a restart.
  EXPECT_GT(before, 0);
  EXPECT_NEAR(after, before, 0.5) << "the loss around the move";
  const std::string resolved = read_file(dir / "run" / "resolved_config.yaml");
  EXPECT_NE(resolved.find("param_dtype: \"bfloat16\""), std::string::npos) << resolved;
  EXPECT_NE(resolved.find("stochastic_rounding: true"), std::string::npos) << resolved;
  EXPECT_NE(log.find("the weights are stored in bfloat16 from now on"), std::string::npos) << log;
}

}  // namespace test_memory_plan
