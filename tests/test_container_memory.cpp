// `memory.limit: auto` under a container's memory limit: the whole process (its resident set, not only
// its tensors) must stay under the limit, or the kernel's OOM killer ends the run before the backoff
// can. The container is a fake cgroup v2 tree (TRAINER_CGROUP_ROOT, trainer/memory/resources.h): it
// gives the trainer a limit and enforces nothing, so the test measures the process itself: its peak
// resident set as the kernel kept it (wait4's ru_maxrss), against the limit it wrote.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sys/resource.h>
#include <sys/wait.h>

#include <algorithm>

#include "test_util.h"
#include "train_util.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_container_memory {

using nlohmann::json;
using testutil::TempDir;

namespace {

// ResNet-20 on synthetic Fashion-MNIST-shaped images at the built-in job's global batch, grow-back
// after 3 clean steps so the ladder probes back up to the cap within the run.
const std::string kJob =
    "--set model.name=resnet20 --set model.num_classes=10 --set data.kind=synthetic --set data.shape=[1,28,28] "
    "--set data.synthetic_size=2048 --set data.test= --set train.epochs=0 --set train.global_batch=128 --set train.device=cpu "
    "--set train.threads=1 --set data.workers=1 --set memory.grow_after=3 --set memory.headroom=0.1 "
    "--set checkpoint.every_steps=0 --set checkpoint.every_seconds=0 --set log.level=warn";

struct Measured {
  int rc = -1;
  int64_t rss_peak_bytes = 0;  // the kernel's high-water mark of the process
  std::vector<json> lines;
  std::string log;
};

// Runs the trainer with `args` as a child (the container: TRAINER_CGROUP_ROOT=`cgroup_root`, or none)
// and takes its peak resident set from wait4.
Measured run_measured(const std::string& run_dir, const std::string& args, const std::string& cgroup_root) {
  const std::string log = run_dir + ".log";
  const std::string env = cgroup_root.empty() ? "" : "env TRAINER_CGROUP_ROOT=" + cgroup_root + " ";
  const pid_t pid = testutil::spawn(env + testutil::trainer_cmd(run_dir, args), log);
  int status = 0;
  rusage ru{};
  Measured m;
  if (wait4(pid, &status, 0, &ru) != pid) return m;
  m.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  m.rss_peak_bytes = static_cast<int64_t>(ru.ru_maxrss) * 1024;  // Linux reports kilobytes
  m.lines = testutil::read_jsonl(run_dir + "/metrics.jsonl");
  m.log = testutil::read_file(log);
  return m;
}

// A cgroup v2 tree whose memory.max is `limit`.
std::string fake_container(const TempDir& dir, int64_t limit) {
  const auto root = dir / "container";
  testutil::fs::create_directories(root / "proc/self");
  testutil::fs::create_directories(root / "sys/fs/cgroup");
  testutil::write_file(root / "proc/self/cgroup", "0::/\n");
  testutil::write_file(root / "sys/fs/cgroup/cgroup.controllers", "memory\n");
  testutil::write_file(root / "sys/fs/cgroup/memory.max", std::to_string(limit) + "\n");
  return root.string();
}

int64_t max_of(const std::vector<json>& lines, const std::string& key) {
  int64_t v = 0;
  for (const auto& l : lines)
    if (!l.contains("event")) v = std::max(v, l.value(key, int64_t{0}));
  return v;
}

}  // namespace

TEST(ContainerMemory, AutoKeepsTheWholeProcessUnderTheContainerLimit) {
  TempDir dir;
  // What the job takes uncapped: its peak RSS and its peak tensor memory.
  const Measured full = run_measured((dir / "uncapped").string(), kJob + " --set train.steps=3", "");
  ASSERT_EQ(full.rc, 0) << full.log;
  const int64_t tensors = max_of(full.lines, "mem_peak_bytes");
  ASSERT_GT(tensors, 0);
  // A container that cannot hold that: the RSS of the uncapped run less half its tensors.
  const int64_t limit = full.rss_peak_bytes - tensors / 2;
  const std::string root = fake_container(dir, limit);

  const Measured run = run_measured((dir / "auto").string(), kJob + " --set train.steps=24 --set memory.limit=auto", root);
  ASSERT_EQ(run.rc, 0) << run.log;
  const json start = [&] {
    for (const auto& l : run.lines)
      if (l.value("event", "") == "start") return l;
    return json();
  }();
  ASSERT_FALSE(start.is_null());
  EXPECT_EQ(start["container_limit"].get<int64_t>(), limit) << "the limit came from the fake container";
  const int64_t cap = start["limit"].get<int64_t>();
  EXPECT_GT(cap, 0);

  EXPECT_LE(run.rss_peak_bytes, limit) << "peak RSS " << run.rss_peak_bytes << " bytes over the container's "
                                       << limit << " (tensor cap " << cap << ")";
  // The trainer's own per-step figures agree with the kernel's.
  EXPECT_LE(max_of(run.lines, "rss_bytes"), run.rss_peak_bytes);
  EXPECT_LE(max_of(run.lines, "rss_peak_bytes"), run.rss_peak_bytes);
  EXPECT_GT(max_of(run.lines, "rss_peak_bytes"), run.rss_peak_bytes / 2);
  // Memory that is not tensors grows after the cap is first resolved (libraries page in, the heap keeps
  // pages: 17 MB in this job's first steps with 1.13, 26 MB with 2.11, against a threshold of 2% of the
  // container), so the cap is resolved again, lower.
  int64_t last_limit = 0;
  for (const auto& l : run.lines)
    if (!l.contains("event")) last_limit = l.value("mem_limit_bytes", int64_t{0});
  EXPECT_GT(last_limit, 0);
  EXPECT_LT(last_limit, cap) << "the cap was not resolved again after memory that is not tensors grew";

  // Whether the cap had to bind, which is what makes the bound above mean something. With Debian's
  // LibTorch 1.13 it does. With the 2.11 wheel the cap stays above the uncapped run's tensor peak (250 MB
  // against 154 MB): that run's peak RSS, which sizes the container, is inflated by the heap it keeps
  // and by a jump at exit, so the container is roomier than the job needs. Known gap, docs/MEMORY.md
  // ("RSS against the container's limit").
  if (cap >= tensors) {
    GTEST_SKIP() << "the cap " << cap << " did not bind (uncapped tensor peak " << tensors
                 << "): the RSS bound was checked, the backoff under it was not";
  }
  // The cap bound: the run backed off from the global batch.
  int64_t smallest = 128;
  for (const auto& l : run.lines)
    if (!l.contains("event")) smallest = std::min(smallest, l["micro_batch"].get<int64_t>());
  EXPECT_LT(smallest, 128);
}

// The measurement above can fail: a run whose tensor cap is the container's whole limit (what setting
// memory.limit to the container's size by hand does) goes over it, and the same check sees it. The
// container lies halfway between the uncapped run's tensor peak and its peak RSS: the cap does not bind,
// and the run goes over by about half its memory that is not tensors. (At the uncapped RSS less half the
// tensor peak, as above, the margin was small enough that one CI run's peak RSS came in 2.8 MB under.)
TEST(ContainerMemory, ACapOfTheWholeContainerGoesOverIt) {
  TempDir dir;
  const Measured full = run_measured((dir / "uncapped").string(), kJob + " --set train.steps=3", "");
  ASSERT_EQ(full.rc, 0) << full.log;
  const int64_t tensors = max_of(full.lines, "mem_peak_bytes");
  const int64_t limit = tensors + (full.rss_peak_bytes - tensors) / 2;
  const std::string root = fake_container(dir, limit);
  const Measured run = run_measured((dir / "whole").string(),
                                    kJob + " --set train.steps=3 --set memory.limit=" + std::to_string(limit), root);
  ASSERT_EQ(run.rc, 0) << run.log;
  std::printf("[ info ] uncapped: peak RSS %lld, tensor peak %lld; container %lld; capped run peak RSS %lld\n",
              static_cast<long long>(full.rss_peak_bytes), static_cast<long long>(tensors),
              static_cast<long long>(limit), static_cast<long long>(run.rss_peak_bytes));
  EXPECT_GT(run.rss_peak_bytes, limit);
}

// ---- the machine's own memory (issue 24) -------------------------------------------------------------
// A bare host, a VM, `docker run` without --memory: no cgroup limit, and still finite memory. `auto` binds
// on what /proc/meminfo says is available plus what the process holds. The machine is a fake tree with
// only proc/meminfo (no cgroup): MemAvailable is what the test writes, the resident set the real one.

namespace {

// Writes `root`/proc/meminfo with MemAvailable = `available` bytes, atomically (a rename), so that a
// trainer reading it between steps never sees half a file.
void write_meminfo(const std::string& root, int64_t available) {
  const auto dir = testutil::fs::path(root) / "proc";
  testutil::fs::create_directories(dir);
  testutil::write_file(dir / "meminfo.tmp", "MemTotal:       25165824 kB\nMemFree:          1048576 kB\nMemAvailable:   " +
                                                 std::to_string(available / 1024) + " kB\nSwapTotal:      0 kB\n");
  testutil::fs::rename(dir / "meminfo.tmp", dir / "meminfo");
}

// kJob with the info lines in the log (the cap, the bounds, the probes).
std::string info_job() {
  std::string j = kJob;
  j.replace(j.find("log.level=warn"), 14, "log.level=info");
  return j;
}

json first_event(const std::vector<json>& lines, const std::string& kind) {
  for (const auto& l : lines)
    if (l.value("event", "") == kind) return l;
  return json();
}

}  // namespace

TEST(HostMemory, AutoBindsOnTheMachinesMemoryWithoutAContainer) {
  TempDir dir;
  const Measured full = run_measured((dir / "uncapped").string(), kJob + " --set train.steps=3 --set memory.limit=none", "");
  ASSERT_EQ(full.rc, 0) << full.log;
  const int64_t tensors = max_of(full.lines, "mem_peak_bytes");
  ASSERT_GT(tensors, 0);
  // The cap is (MemAvailable + live tensors - reserve) * (1 - 0.3): 0.6 of the tensor peak available
  // gives a cap near 0.42 of it (plus 0.7 of the weights), which the whole batch cannot fit under.
  const int64_t available = tensors * 6 / 10;
  const std::string root = (dir / "machine").string();
  write_meminfo(root, available);

  const int64_t steps = 8;
  const Measured run = run_measured((dir / "auto").string(),
                                    info_job() + " --set train.steps=" + std::to_string(steps) + " --set memory.limit=auto", root);
  ASSERT_EQ(run.rc, 0) << run.log;
  const json start = first_event(run.lines, "start");
  ASSERT_FALSE(start.is_null());
  EXPECT_EQ(start["limit_source"].get<std::string>(), "host");
  EXPECT_EQ(start["container_limit"].get<int64_t>(), 0);
  // The machine's bound is MemAvailable plus the process's own anonymous resident set at that moment.
  EXPECT_GT(start["host_limit"].get<int64_t>(), available);
  EXPECT_LT(start["host_limit"].get<int64_t>(), available + full.rss_peak_bytes);
  const int64_t cap = start["limit"].get<int64_t>();
  EXPECT_GT(cap, 0);
  EXPECT_LT(cap, tensors) << "the cap from the machine's memory does not bind";
  EXPECT_NE(run.log.find("the host binds"), std::string::npos) << run.log;

  // It backed off instead of being killed, and no step was lost.
  const auto s = testutil::step_lines((dir / "auto").string());
  ASSERT_EQ(static_cast<int64_t>(s.size()), steps);
  int64_t smallest = 128;
  for (int64_t i = 0; i < steps; ++i) {
    EXPECT_EQ(s[i]["samples_seen"].get<int64_t>(), 128 * (i + 1));
    smallest = std::min(smallest, s[i]["micro_batch"].get<int64_t>());
  }
  EXPECT_LT(smallest, 128);
}

TEST(HostMemory, FallingAvailableMemoryLowersTheCapBetweenStepsAndItsReturnRaisesIt) {
  TempDir dir;
  const Measured full = run_measured((dir / "uncapped").string(), kJob + " --set train.steps=3 --set memory.limit=none", "");
  ASSERT_EQ(full.rc, 0) << full.log;
  const int64_t tensors = max_of(full.lines, "mem_peak_bytes");
  const int64_t plenty = int64_t(64) << 30, scarce = tensors * 6 / 10;
  const std::string root = (dir / "machine").string();
  write_meminfo(root, plenty);

  const std::string run_dir = (dir / "run").string();
  // The cap falls after step 3 and memory returns at the first smaller micro-batch (a step or two
  // later); growing back to the whole batch takes one grow-back per halving, each after 3 clean steps.
  const int64_t steps = 24;
  const pid_t pid = testutil::spawn("env TRAINER_CGROUP_ROOT=" + root + " " +
                                        testutil::trainer_cmd(run_dir, info_job() + " --set train.steps=" + std::to_string(steps) +
                                                                           " --set memory.limit=auto"),
                                    (dir / "log.txt").string());
  ASSERT_TRUE(testutil::wait_for_metrics(run_dir, [](auto& l) { return testutil::last_step(l) >= 3; }));
  // Another process on the machine takes memory: the cap must fall before the next step runs into it.
  write_meminfo(root, scarce);
  const bool backed_off = testutil::wait_for_metrics(run_dir, [](auto& lines) {
    for (auto& l : lines)
      if (!l.contains("event") && l["micro_batch"].template get<int64_t>() < 128) return true;
    return false;
  });
  const int64_t step_at_return = testutil::last_step(testutil::read_jsonl(run_dir + "/metrics.jsonl"));
  // ... and gives it back: the cap rises and the micro-batch grows back.
  write_meminfo(root, plenty);
  ASSERT_EQ(testutil::wait_exit(pid), 0) << testutil::read_file(dir / "log.txt");
  const std::string log = testutil::read_file(dir / "log.txt");
  ASSERT_TRUE(backed_off) << "no smaller micro-batch after MemAvailable fell\n" << log;
  ASSERT_LT(step_at_return, steps - 5) << "the run ended before memory returned; make it longer";
  EXPECT_NE(log.find("the machine's memory for this process fell from"), std::string::npos) << log;
  // The rise is seen between two steps, by whichever check reads /proc/meminfo first after the test rewrites
  // it: the machine's bound, or (when the rewrite lands between that read and the cap's) the growth of what
  // is not tensors. Either way the cap is resolved again from the new MemAvailable and rises.
  const bool rise_seen = log.find("the machine's memory for this process rose from") != std::string::npos ||
                         log.find("memory that is not tensors grew from") != std::string::npos;
  EXPECT_TRUE(rise_seen) << log;
  EXPECT_NE(log.find("memory: memory limit rose from"), std::string::npos) << log;

  const auto s = testutil::step_lines(run_dir);
  ASSERT_EQ(static_cast<int64_t>(s.size()), steps);  // no step lost
  for (int64_t i = 0; i < steps; ++i) EXPECT_EQ(s[i]["samples_seen"].get<int64_t>(), 128 * (i + 1));
  // The cap in force fell below the tensor peak of the whole batch, then rose above it again.
  int64_t lowest = INT64_MAX;
  for (const auto& l : s) lowest = std::min(lowest, l["mem_limit_bytes"].get<int64_t>());
  EXPECT_LT(lowest, tensors);
  EXPECT_GT(s.back()["mem_limit_bytes"].get<int64_t>(), tensors);
  EXPECT_EQ(s.back()["micro_batch"].get<int64_t>(), 128) << "grew back after memory returned";
}

// Without any limit, `micro_batch: auto` cannot protect the run, and says so in one line.
TEST(HostMemory, AutoMicroBatchWithoutALimitWarnsOnce) {
  TempDir dir;
  const Measured run = run_measured((dir / "none").string(),
                                    info_job() + " --set train.steps=1 --set memory.limit=none --set train.micro_batch=auto",
                                    "");
  ASSERT_EQ(run.rc, 0) << run.log;
  size_t n = 0;
  for (size_t at = run.log.find("with no memory limit"); at != std::string::npos;
       at = run.log.find("with no memory limit", at + 1))
    ++n;
  EXPECT_EQ(n, 1u) << run.log;
  EXPECT_NE(run.log.find("the kernel may kill the run"), std::string::npos) << run.log;
  // Each probe of the search is one line: the size, whether it fit, and its seconds.
  EXPECT_NE(run.log.find("micro_batch auto: probe 1: micro-batch"), std::string::npos) << run.log;
}

// Every shipped config dry-runs with `memory.limit: auto` and names what it resolved to on this machine:
// on the CPU the machine's memory at least (no container here, or a container and the machine), the
// GPU's free memory for the CUDA jobs.
TEST(HostMemory, EveryShippedConfigNamesWhatAutoResolvesTo) {
  int checked = 0;
  for (const auto& entry : testutil::fs::directory_iterator(testutil::source_dir() + "/configs")) {
    if (entry.path().extension() != ".yaml") continue;
    ++checked;
    const auto r = testutil::run(testutil::trainer_bin() + " --dry-run --config " + entry.path().string() +
                                 " --set memory.limit=auto");
    ASSERT_EQ(r.exit_code, 0) << entry.path() << "\n" << r.output;
    const auto at = r.output.find("# memory\nmemory.limit auto on ");
    ASSERT_NE(at, std::string::npos) << entry.path() << "\n" << r.output;
    const std::string line = r.output.substr(at + 9, r.output.find('\n', at + 9) - at - 9);
    if (line.find("auto on cuda") != std::string::npos) {
      EXPECT_NE(line.find("the GPU's free memory"), std::string::npos) << line;
    } else {
      EXPECT_NE(line.find("tensor cap "), std::string::npos) << entry.path() << ": " << line;
      EXPECT_NE(line.find("binds"), std::string::npos) << line;
    }
  }
  EXPECT_GE(checked, 10);
}

}  // namespace test_container_memory
