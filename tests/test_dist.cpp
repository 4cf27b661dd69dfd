// Data-parallel training on c10d/Gloo, through the executable, launched as users launch it: Debian's
// torchrun (python3 -m torch.distributed.run, torch 1.13) with two ranks on loopback, or by hand with the
// environment a Kubernetes PyTorchJob sets. References: the same job in one process.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <fstream>

#include "http_client.h"
#include "train_util.h"
#include "trainer/dist/dist.h"
#include "trainer/memory/resources.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_dist {

using testutil::TempDir;

namespace {

// plain_cnn (no batch statistics: replicas and the single process compute the same thing) on synthetic
// 1x28x28 data, global batch 32.
std::string dist_job(const std::string& extra) {
  return "--set model.name=plain_cnn --set data.kind=synthetic --set data.shape=[1,28,28]"
         " --set data.synthetic_size=640 --set data.test= --set data.crop_padding=0 --set data.hflip=false"
         " --set data.workers=1 --set train.global_batch=32 --set train.epochs=0 --set optim.lr=0.05"
         " --set schedule.warmup_steps=0 --set schedule.name=constant"
         " --set checkpoint.every_seconds=0 --set log.every=1000 --set seed=5"
         " --set train.threads=1 --set dist.timeout_s=60 " +
         extra;
}

using testutil::free_port;

// The rank's entry point under torchrun: records its pid (so a test can kill one rank), and gives rank 1
// extra arguments (a lower memory cap) when RANK1_ARGS is set.
std::string write_wrapper(const TempDir& dir) {
  const std::string path = (dir / "rank.sh").string();
  testutil::write_file(path,
                       "#!/bin/sh\n"
                       "echo $$ > \"$PID_DIR/pid.$RANK\"\n"
                       "if [ \"$RANK\" = 1 ]; then exec " + testutil::trainer_bin() + " \"$@\" $RANK1_ARGS; fi\n"
                       "exec " + testutil::trainer_bin() + " \"$@\"\n");
  ::chmod(path.c_str(), 0755);
  return path;
}

// torchrun with two ranks. Debian 12's torchrun (torch 1.13 on Python 3.11) fails on its own default
// --redirects/--tee values ("0" parses to None there); "2" (stderr to a log and to the console) works.
std::string torchrun(const TempDir& dir, const std::string& run_dir, const std::string& args,
                     const std::string& env = "", const std::string& extra_flags = "") {
  const std::string pids = (dir / "pids").string();
  std::filesystem::create_directories(pids);
  return "env PID_DIR=" + pids + " " + env + " " + testutil::python() +
         " -m torch.distributed.run --nproc_per_node 2 --master_port " + std::to_string(free_port()) +
         " --redirects 2 --tee 2 " + extra_flags + " --no_python " + write_wrapper(dir) + " --run-dir " + run_dir + " " +
         args;
}

bool torchrun_available() {
  return testutil::run(testutil::python() + " -c 'import torch.distributed.run'").exit_code == 0;
}

}  // namespace

// ---- the environment ----------------------------------------------------------------------------------

TEST(DistEnv, ReadsTorchrunsVariables) {
  std::map<std::string, std::string> env = {{"RANK", "3"},          {"WORLD_SIZE", "4"},        {"LOCAL_RANK", "1"},
                                            {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29400"},
                                            {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                            {"TORCHELASTIC_RESTART_COUNT", "2"}};
  auto get = [&](const char* n) -> const char* {
    auto it = env.find(n);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  trainer::DistEnv e = trainer::dist_env_from(get);
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_addr, "node0");
  EXPECT_EQ(e.master_port, 29400);
  EXPECT_TRUE(e.agent_store);
  EXPECT_EQ(e.restart_count, 2);
  EXPECT_TRUE(e.distributed());

  // A PyTorchJob sets no LOCAL_* and no agent store: one process per pod, rank 0 hosts the store.
  env = {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "job-master-0"}, {"MASTER_PORT", "23456"}};
  e = trainer::dist_env_from(get);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_FALSE(e.agent_store);

  env.clear();
  e = trainer::dist_env_from(get);
  EXPECT_FALSE(e.distributed());
  EXPECT_EQ(e.rank, 0);
}

TEST(DistEnv, BadVariablesAreOneLineErrors) {
  std::map<std::string, std::string> env;
  auto get = [&](const char* n) -> const char* {
    auto it = env.find(n);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  auto error_of = [&] {
    try {
      trainer::dist_env_from(get);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  env = {{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}};
  EXPECT_NE(error_of().find("RANK='2' is not an integer in [0, 1]"), std::string::npos) << error_of();
  env = {{"RANK", "0"}, {"WORLD_SIZE", "two"}};
  EXPECT_NE(error_of().find("WORLD_SIZE='two'"), std::string::npos) << error_of();
  env = {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}};
  EXPECT_NE(error_of().find("MASTER_ADDR is not set"), std::string::npos) << error_of();
  env = {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}};
  EXPECT_NE(error_of().find("MASTER_PORT='70000'"), std::string::npos) << error_of();
  env = {{"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}};
  EXPECT_NE(error_of().find("RANK is not set"), std::string::npos) << error_of();
}

TEST(DistEnv, BackendFollowsTheDevice) {
  EXPECT_EQ(trainer::resolve_backend(std::nullopt, torch::Device(torch::kCPU)), trainer::CommBackend::kGloo) << "auto";
  EXPECT_EQ(trainer::resolve_backend(trainer::CommBackend::kGloo, torch::Device(torch::kCPU)), trainer::CommBackend::kGloo);
  EXPECT_STREQ(trainer::to_string(trainer::CommBackend::kNccl), "nccl");
  try {
    trainer::resolve_backend(trainer::CommBackend::kNccl, torch::Device(torch::kCPU));
    ADD_FAILURE() << "nccl on the CPU must be refused";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("nccl needs a CUDA device"), std::string::npos) << e.what();
  }
}

// ---- two ranks against one process --------------------------------------------------------------------

TEST(DistTorchrun, TwoRanksEqualOneProcess) {
  if (!torchrun_available()) GTEST_SKIP() << "python3-torch (torchrun) is not installed";
  TempDir dir;
  const std::string single = (dir / "single").string(), two = (dir / "two").string();
  auto r1 = testutil::run(testutil::trainer_cmd(single, dist_job("--set train.steps=6")));
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  // Small buckets (0.1 MiB for plain_cnn's 0.39 MB of gradients): several, most sent during backward.
  auto r2 = testutil::run(torchrun(dir, two, dist_job("--set train.steps=6 --set dist.bucket_mb=0.1")));
  ASSERT_EQ(r2.exit_code, 0) << r2.output;

  // Rank 0 writes the run folder's files; rank 1 its own log and metrics under rank1/.
  EXPECT_TRUE(std::filesystem::exists(two + "/rank1/metrics.jsonl"));
  EXPECT_TRUE(std::filesystem::exists(two + "/rank1/train.log"));
  EXPECT_FALSE(std::filesystem::exists(two + "/rank1/checkpoints"));
  auto one_steps = testutil::step_lines(single), two_steps = testutil::step_lines(two);
  auto rank1_steps = testutil::read_jsonl(two + "/rank1/metrics.jsonl");
  ASSERT_EQ(two_steps.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(two_steps[i]["samples_seen"], one_steps[i]["samples_seen"]);
    EXPECT_EQ(two_steps[i]["micro_batch"].get<int64_t>(), 16) << "each rank takes half the global batch";
    // The loss is the global batch's mean, summed over ranks: the one process's loss.
    EXPECT_NEAR(two_steps[i]["loss"].get<double>(), one_steps[i]["loss"].get<double>(), 1e-5) << "step " << i + 1;
    // The two ranks saw different halves of the step.
    EXPECT_NE(two_steps[i]["batch_hash"], one_steps[i]["batch_hash"]);
    EXPECT_GE(two_steps[i]["grad_buckets"].get<int64_t>(), 3);
    // Overlap: buckets left while backward still ran (all but the one holding the first layers at least).
    EXPECT_GE(two_steps[i]["grad_buckets_in_backward"].get<int64_t>(), two_steps[i]["grad_buckets"].get<int64_t>() - 1);
  }
  EXPECT_LT(testutil::max_abs_diff(testutil::final_weights(single), testutil::final_weights(two)), 1e-6);
}

namespace {

// A llama_tiny job trained on two ranks and in one process: the same losses, the same final weights.
void two_ranks_equal_one_process(const std::string& lora) {
  if (!torchrun_available()) GTEST_SKIP() << "python3-torch (torchrun) is not installed";
  TempDir dir;
  const std::string job = lora + " --set model.name=llama_tiny --set data.kind=synthetic --set model.context=16"
                          " --set data.synthetic_size=64 --set data.test= --set train.global_batch=8 --set train.epochs=0"
                          " --set train.steps=3 --set optim.lr=0.1 --set schedule.warmup_steps=0 --set schedule.name=constant"
                          " --set checkpoint.every_seconds=0 --set log.every=1000 --set seed=5 --set train.threads=1"
                          " --set dist.timeout_s=60";
  const std::string single = (dir / "single").string(), two = (dir / "two").string();
  auto r = testutil::run(testutil::trainer_cmd(single, job));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testutil::run(torchrun(dir, two, job));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto one_steps = testutil::step_lines(single), two_steps = testutil::step_lines(two);
  ASSERT_EQ(two_steps.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(two_steps[i]["micro_batch"].get<int64_t>(), 4) << "each rank takes half the global batch";
    EXPECT_NEAR(two_steps[i]["loss"].get<double>(), one_steps[i]["loss"].get<double>(), 1e-5) << "step " << i + 1;
  }
  EXPECT_LT(testutil::max_abs_diff(testutil::final_weights(single), testutil::final_weights(two)), 1e-6);
}

}  // namespace

// A Llama-family model (tied embeddings, grouped-query attention) in data parallel: two ranks compute the
// one process's losses and end with its weights. Also with LoRA (models/lora.h): the frozen base has no
// gradient to all-reduce, the adapters' are averaged.
TEST(DistTorchrun, ALlamaOnTwoRanksEqualsOneProcess) {
  for (const std::string lora : {"", " --set model.lora.rank=4"}) {
    SCOPED_TRACE(lora);
    two_ranks_equal_one_process(lora);
  }
}

TEST(DistTorchrun, RanksOfANodeKeepTheirShareOfTheCpus) {
  if (!torchrun_available()) GTEST_SKIP() << "python3-torch (torchrun) is not installed";
  const int usable = trainer::usable_cpus();
  if (usable < 2) GTEST_SKIP() << "one usable CPU: two ranks get one thread each either way, nothing to tell apart";
  TempDir dir;
  const std::string two = (dir / "two").string();
  // train.threads 0: each of the node's two ranks takes half the CPUs, at setup and at every later poll
  // of the CPUs (the loop polls at step 0, then every 50 steps). The poll used to give each rank all
  // of them.
  auto r = testutil::run(torchrun(dir, two, dist_job("--set train.steps=2 --set train.threads=0")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string share = "cpu: " + std::to_string(usable / 2) + " threads";
  for (const std::string log : {two + "/train.log", two + "/rank1/train.log"}) {
    const std::string text = testutil::read_file(log);
    EXPECT_NE(text.find(share), std::string::npos) << log << ":\n" << text;
    EXPECT_EQ(text.find("threads (affinity / quota changed)"), std::string::npos) << log << ":\n" << text;
  }
}

TEST(DistTorchrun, TwoNodesOfOneProcessEach) {
  if (!torchrun_available()) GTEST_SKIP() << "python3-torch (torchrun) is not installed";
  TempDir dir;
  const std::string single = (dir / "single").string(), two = (dir / "two").string();
  auto r1 = testutil::run(testutil::trainer_cmd(single, dist_job("--set train.steps=4")));
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  // A multi-node launch, both "nodes" on this host: one torchrun agent per node, node 0's hosts the store.
  const int port = free_port();
  auto node = [&](int n) {
    return testutil::python() + " -m torch.distributed.run --nnodes 2 --node_rank " + std::to_string(n) +
           " --master_addr 127.0.0.1 --master_port " + std::to_string(port) +
           " --nproc_per_node 1 --redirects 2 --tee 2 --no_python " + testutil::trainer_bin() + " --run-dir " + two +
           " " + dist_job("--set train.steps=4");
  };
  pid_t n0 = testutil::spawn(node(0), (dir / "node0.log").string());
  pid_t n1 = testutil::spawn(node(1), (dir / "node1.log").string());
  EXPECT_EQ(testutil::wait_exit(n0), 0) << testutil::read_file(dir / "node0.log");
  EXPECT_EQ(testutil::wait_exit(n1), 0) << testutil::read_file(dir / "node1.log");
  EXPECT_NE(testutil::read_file(dir / "node1.log").find("rank 1 of 2 (local 0 of 1)"), std::string::npos);
  EXPECT_LT(testutil::max_abs_diff(testutil::final_weights(single), testutil::final_weights(two)), 1e-6);
}

TEST(DistTorchrun, OutOfMemoryOnOneRankBacksOffBoth) {
  if (!torchrun_available()) GTEST_SKIP() << "python3-torch (torchrun) is not installed";
  TempDir dir;
  const std::string single = (dir / "single").string(), two = (dir / "two").string();
  auto r1 = testutil::run(testutil::trainer_cmd(single, dist_job("--set train.steps=4")));
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  // Rank 1's cap: between the peaks of micro-batch 8 and 16 of a 16-sample slice (measured in one process
  // with global batch 16 and the same model: 2.95 MiB and 4.37 MiB on 1.13; the cap is checked below).
  auto r2 = testutil::run(torchrun(dir, two, dist_job("--set train.steps=4"), "RANK1_ARGS='--set memory.limit=3800000'"));
  ASSERT_EQ(r2.exit_code, 0) << r2.output;

  auto own = testutil::events(two + "/rank1", "oom");
  auto peer = testutil::events(two, "oom");
  ASSERT_GE(own.size(), 1u) << "rank 1's cap must have been hit";
  ASSERT_EQ(peer.size(), own.size()) << "rank 0 backs off with rank 1, once per rank-1 OOM";
  EXPECT_TRUE(peer[0].value("peer", false));
  EXPECT_NE(peer[0]["error"].get<std::string>().find("rank 1 ran out of memory"), std::string::npos);
  auto steps0 = testutil::step_lines(two);
  std::vector<nlohmann::json> steps1;
  for (auto& l : testutil::read_jsonl(two + "/rank1/metrics.jsonl"))
    if (!l.contains("event")) steps1.push_back(l);
  ASSERT_EQ(steps0.size(), 4u);
  ASSERT_EQ(steps1.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(steps0[i]["micro_batch"], steps1[i]["micro_batch"]) << "the ranks must split alike";
    EXPECT_LT(steps0[i]["micro_batch"].get<int64_t>(), 16);
    EXPECT_LE(steps1[i]["mem_peak_bytes"].get<int64_t>(), 3800000);
  }
  EXPECT_GE(steps0[0]["oom_retries"].get<int64_t>(), 1);
  EXPECT_LT(testutil::max_abs_diff(testutil::final_weights(single), testutil::final_weights(two)), 1e-6);
}

TEST(DistTorchrun, CheckpointingRungIsTakenByAllRanks) {
  if (!torchrun_available()) GTEST_SKIP() << "python3-torch (torchrun) is not installed";
  TempDir dir;
  const std::string plain = (dir / "plain").string(), capped = (dir / "capped").string();
  // ResNet-20 at the floor (16 per rank): rank 1's cap (17 MB) lies between the peak of a 16-sample
  // step with checkpointing (13.0 MB) and without (21.4 MB), measured in one process on LibTorch 1.13.
  const std::string args = dist_job("--set model.name=resnet20 --set train.steps=3 --set memory.min_micro_batch=16");
  auto r1 = testutil::run(torchrun(dir, plain, args));
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  auto r2 = testutil::run(torchrun(dir, capped, args, "RANK1_ARGS='--set memory.limit=17000000'"));
  ASSERT_EQ(r2.exit_code, 0) << r2.output;
  auto own = testutil::events(capped + "/rank1", "oom"), peer = testutil::events(capped, "oom");
  ASSERT_EQ(own.size(), 1u) << r2.output;
  ASSERT_EQ(peer.size(), 1u) << r2.output;
  EXPECT_EQ(own[0]["kind"], "checkpointing_on");
  EXPECT_EQ(peer[0]["kind"], "checkpointing_on");
  EXPECT_TRUE(peer[0].value("new_checkpointing", false));
  auto steps = testutil::step_lines(capped);
  ASSERT_EQ(steps.size(), 3u);
  for (const auto& s : steps) EXPECT_EQ(s["micro_batch"].get<int64_t>(), 16);
  // Recomputation does not change the arithmetic: the weights are those of the uncapped two-rank run.
  EXPECT_LT(testutil::max_abs_diff(testutil::final_weights(plain), testutil::final_weights(capped)), 1e-5);
}

TEST(DistTorchrun, KilledRankIsRestartedAndTheJobResumes) {
  if (!torchrun_available()) GTEST_SKIP() << "python3-torch (torchrun) is not installed";
  TempDir dir;
  const std::string plain = (dir / "plain").string(), two = (dir / "two").string();
  const std::string args = dist_job("--set train.steps=200 --set checkpoint.every_steps=20 --set checkpoint.async=false");
  auto r1 = testutil::run(torchrun(dir, plain, args));  // the same job, never interrupted
  ASSERT_EQ(r1.exit_code, 0) << r1.output;

  pid_t agent = testutil::spawn(torchrun(dir, two, args, "", "--max_restarts 1"), (dir / "torchrun.log").string());
  bool past = testutil::wait_for_metrics(two, [](const auto& lines) {
    bool ckpt = false;
    for (const auto& l : lines) ckpt |= l.value("event", "") == "checkpoint";
    return ckpt && testutil::last_step(lines) >= 50;
  });
  ASSERT_TRUE(past) << testutil::read_file(dir / "torchrun.log");
  const std::string pid1 = testutil::read_file(dir / "pids" / "pid.1");
  ASSERT_EQ(::kill(std::stoi(pid1), SIGKILL), 0);
  EXPECT_EQ(testutil::wait_exit(agent), 0) << testutil::read_file(dir / "torchrun.log");

  auto resumes = testutil::events(two, "resume");
  ASSERT_EQ(resumes.size(), 1u) << testutil::read_file(dir / "torchrun.log");
  EXPECT_GE(resumes[0]["step"].get<int64_t>(), 20);
  EXPECT_EQ(resumes[0]["step"].get<int64_t>() % 20, 0);
  EXPECT_EQ(testutil::last_step(testutil::read_jsonl(two + "/metrics.jsonl")), 200);
  // Resumed exactly: bit for bit the weights of the uninterrupted two-rank run (a two-rank sum does not
  // depend on the order of its terms, and the resume restores every rank's RNG and the data position).
  EXPECT_TRUE(testutil::bitwise_equal(testutil::final_weights(plain), testutil::final_weights(two)));
}

TEST(DistTorchrun, SigtermStopsEveryRankAtTheSameStep) {
  if (!torchrun_available()) GTEST_SKIP() << "python3-torch (torchrun) is not installed";
  TempDir dir;
  const std::string two = (dir / "two").string();
  // torchrun forwards SIGTERM to each rank, not at the same instant; the ranks agree on the step.
  pid_t agent = testutil::spawn(torchrun(dir, two, dist_job("--set train.steps=100000")), (dir / "torchrun.log").string());
  ASSERT_TRUE(testutil::wait_for_metrics(two, [](const auto& l) { return testutil::last_step(l) >= 20; }, 60))
      << testutil::read_file(dir / "torchrun.log");
  ::kill(agent, SIGTERM);
  testutil::wait_exit(agent);
  auto stop0 = testutil::events(two, "stop"), stop1 = testutil::events(two + "/rank1", "stop");
  ASSERT_EQ(stop0.size(), 1u) << testutil::read_file(dir / "torchrun.log");
  ASSERT_EQ(stop1.size(), 1u) << testutil::read_file(dir / "torchrun.log");
  EXPECT_EQ(stop0[0]["step"], stop1[0]["step"]);
  auto ckpts = testutil::events(two, "checkpoint");
  ASSERT_FALSE(ckpts.empty());
  EXPECT_EQ(ckpts.back()["reason"], "SIGTERM");
  EXPECT_EQ(ckpts.back()["step"], stop0[0]["step"]);
  // The same command resumes there.
  const int64_t at = stop0[0]["step"].get<int64_t>();
  auto r = testutil::run(torchrun(dir, two, dist_job("--set train.steps=" + std::to_string(at + 5))));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto resumes = testutil::events(two, "resume");
  ASSERT_EQ(resumes.size(), 1u);
  EXPECT_EQ(resumes[0]["step"].get<int64_t>(), at);
}

TEST(DistTorchrun, ResumesWithAnotherNumberOfRanks) {
  if (!torchrun_available()) GTEST_SKIP() << "python3-torch (torchrun) is not installed";
  TempDir dir;
  const std::string single = (dir / "single").string(), mixed = (dir / "mixed").string();
  auto r1 = testutil::run(testutil::trainer_cmd(single, dist_job("--set train.steps=8")));
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  // 4 steps on two ranks, then 4 more in one process from the two-rank checkpoint.
  auto r2 = testutil::run(torchrun(dir, mixed, dist_job("--set train.steps=4")));
  ASSERT_EQ(r2.exit_code, 0) << r2.output;
  auto r3 = testutil::run(testutil::trainer_cmd(mixed, dist_job("--set train.steps=8")));
  ASSERT_EQ(r3.exit_code, 0) << r3.output;
  EXPECT_NE(r3.output.find("written by 2 processes, this job has 1"), std::string::npos) << r3.output;
  auto one_steps = testutil::step_lines(single), mixed_steps = testutil::step_lines(mixed);
  ASSERT_EQ(mixed_steps.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(mixed_steps[i]["samples_seen"], one_steps[i]["samples_seen"]);
    EXPECT_NEAR(mixed_steps[i]["loss"].get<double>(), one_steps[i]["loss"].get<double>(), 1e-5) << "step " << i + 1;
  }
  // The global sample order does not depend on the number of ranks: steps 5-8 saw the same samples.
  for (size_t i = 4; i < 8; ++i) EXPECT_EQ(mixed_steps[i]["batch_hash"], one_steps[i]["batch_hash"]);
  EXPECT_LT(testutil::max_abs_diff(testutil::final_weights(single), testutil::final_weights(mixed)), 1e-6);
}

// ---- launched by hand (the PyTorchJob way), and a stuck peer --------------------------------------------

TEST(DistManual, StuckRankBecomesATimeoutError) {
  TempDir dir;
  const std::string run_dir = (dir / "run").string();
  const int port = free_port();
  auto env = [&](int rank) {
    return "env RANK=" + std::to_string(rank) + " WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " ";
  };
  const std::string args = dist_job("--set train.steps=100000 --set dist.timeout_s=5");
  pid_t r0 = testutil::spawn(env(0) + testutil::trainer_cmd(run_dir, args), (dir / "rank0.log").string());
  pid_t r1 = testutil::spawn(env(1) + testutil::trainer_cmd(run_dir, args), (dir / "rank1.log").string());
  ASSERT_TRUE(testutil::wait_for_metrics(run_dir, [](const auto& l) { return testutil::last_step(l) >= 5; }, 60))
      << testutil::read_file(dir / "rank0.log");
  ::kill(r1, SIGSTOP);  // alive but silent: the worst case, no connection is ever reset
  auto t0 = std::chrono::steady_clock::now();
  int code0 = testutil::wait_exit(r0);
  double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::kill(r1, SIGKILL);
  testutil::wait_exit(r1);
  const std::string log0 = testutil::read_file(dir / "rank0.log");
  EXPECT_EQ(code0, 1) << log0;
  EXPECT_NE(log0.find("failed on rank 0 of 2 (timeout 5 s)"), std::string::npos) << log0;
  EXPECT_LT(waited, 40) << "the timeout is 5 s";
  auto errors = testutil::events(run_dir, "error");
  ASSERT_EQ(errors.size(), 1u);
}

TEST(DistManual, GlobalBatchMustSplitEvenly) {
  TempDir dir;
  const int port = free_port();
  auto r = testutil::run("RANK=0 WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " " +
                         testutil::trainer_cmd((dir / "run").string(), dist_job("--set train.steps=1")));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("train.global_batch: 32 is not divisible by the world size 3"), std::string::npos) << r.output;
}

// ---- the overhead benchmark (bench/ddp_overhead.py): its output is complete and consistent ----------------

TEST(DistBench, OverheadScriptWritesConsistentJson) {
  if (!torchrun_available()) GTEST_SKIP() << "python3-torch (torchrun) is not installed";
  TempDir dir;
  const std::string out = (dir / "ddp.json").string();
  auto r = testutil::run(testutil::python() + " " + testutil::source_dir() + "/bench/ddp_overhead.py --config " +
                         testutil::source_dir() + "/configs/bench_resnet18_cpu.yaml --trainer " + testutil::trainer_bin() +
                         " --python " + testutil::python() +
                         " --ranks 2 --rounds 1 --steps 6 --warmup 2 --set model.name=plain_cnn --set data.shape=[1,28,28]"
                         " --set data.synthetic_size=640 --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(out);
  auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["schema"], "trainer-ddp-overhead/1");
  EXPECT_EQ(j["global_batch"], 32);
  ASSERT_EQ(j["rounds"].size(), 1u);
  const auto& round = j["rounds"][0];
  for (const char* k : {"threads", "ranks", "one_rank_alone"}) EXPECT_GT(round[k]["step_time_s_p50"].get<double>(), 0) << k;
  EXPECT_DOUBLE_EQ(round["ratio_ranks_over_one_rank_alone"].get<double>(),
                   round["ranks"]["step_time_s_p50"].get<double>() / round["one_rank_alone"]["step_time_s_p50"].get<double>());
  EXPECT_DOUBLE_EQ(j["median_ratio_ranks_over_threads"].get<double>(), round["ratio_ranks_over_threads"].get<double>());
  EXPECT_EQ(round["ranks"]["grad_buckets"], 1);
  // The same global batch with and without ranks: the same losses (no batch statistics in plain_cnn).
  EXPECT_NEAR(round["ranks"]["loss_last"].get<double>(), round["threads"]["loss_last"].get<double>(), 1e-5);
  std::filesystem::remove_all(j["work_dir"].get<std::string>());
}

// A second job on a held run folder: refused on every rank, each with its line; with --wait-for-run-dir
// the job waits (its ranks kept in step by the wait's small all-reduces) and resumes from what the
// holder saved on SIGTERM.
TEST(DistTorchrun, HeldRunFolderIsRefusedOnEveryRankOrWaitedFor) {
  if (!torchrun_available()) GTEST_SKIP() << "python3-torch (torchrun) is not installed";
  TempDir dir;
  const std::string run_dir = (dir / "run").string();
  pid_t holder = testutil::spawn(testutil::trainer_cmd(run_dir, dist_job("--set train.steps=100000 --set checkpoint.every_steps=5")),
                                 (dir / "holder.log").string());
  ASSERT_TRUE(testutil::wait_for_metrics(run_dir, [](const auto& l) { return testutil::last_step(l) >= 1; }, 60))
      << testutil::read_file(dir / "holder.log");
  const std::string line = run_dir + ": the run folder is in use by pid " + std::to_string(holder);
  auto r = testutil::run(torchrun(dir, run_dir, dist_job("--set train.steps=10")));
  EXPECT_NE(r.exit_code, 0) << r.output;
  size_t refusals = 0;
  for (size_t at = r.output.find(line); at != std::string::npos; at = r.output.find(line, at + 1)) ++refusals;
  EXPECT_GE(refusals, 2u) << "one line from each rank:\n" << r.output;
  EXPECT_FALSE(std::filesystem::exists(run_dir + "/rank1")) << "rank 1 wrote nothing";

  pid_t agent = testutil::spawn(torchrun(dir, run_dir, dist_job("--set train.steps=100000") + " --wait-for-run-dir 120"),
                                (dir / "torchrun.log").string());
  // The job is up and rank 0 says whom it waits for.
  bool waiting = false;
  for (int i = 0; i < 1200 && !waiting; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    waiting = testutil::read_file(dir / "torchrun.log").find("waiting for pid " + std::to_string(holder)) != std::string::npos;
  }
  ASSERT_TRUE(waiting) << testutil::read_file(dir / "torchrun.log");
  ::kill(holder, SIGTERM);
  EXPECT_EQ(testutil::wait_exit(holder), 143) << testutil::read_file(dir / "holder.log");
  ASSERT_TRUE(testutil::wait_for_metrics(run_dir, [](const auto& l) {
    for (const auto& x : l)
      if (x.value("event", "") == "resume") return true;
    return false;
  }, 120)) << testutil::read_file(dir / "torchrun.log");
  ::kill(agent, SIGTERM);
  testutil::wait_exit(agent);
  const auto stops = testutil::events(run_dir, "stop");
  const auto resumes = testutil::events(run_dir, "resume");
  ASSERT_GE(stops.size(), 1u);
  ASSERT_EQ(resumes.size(), 1u);
  EXPECT_EQ(resumes[0]["step"], stops[0]["step"]) << testutil::read_file(dir / "torchrun.log");
}

}  // namespace test_dist

namespace test_dist {

// bfloat16 weights train in one process: under torchrun every rank refuses them as it connects, with the
// one line, before anything is broadcast (Gloo's collectives take no bfloat16 in LibTorch 1.13).
TEST(DistTorchrun, BFloat16WeightsAreRefusedOnEveryRank) {
  if (!torchrun_available()) GTEST_SKIP() << "python3-torch (torchrun) is not installed";
  TempDir dir;
  const auto r = testutil::run(torchrun(dir, (dir / "run").string(),
                                        dist_job("--set train.steps=1 --set optim.name=adamw --set model.param_dtype=bfloat16")));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[default0]:error: config: key 'model.param_dtype': bfloat16 weights train in one process"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[default1]:error: config: key 'model.param_dtype'"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("broadcast of the initial model failed"), std::string::npos) << r.output;
}

}  // namespace test_dist
