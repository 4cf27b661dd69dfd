// One run folder, one owner (common/run_lock.h), through real processes: a second trainer on a held
// folder is refused naming the holder; with --wait-for-run-dir it waits for the holder's SIGTERM save and
// resumes to the weights of an uninterrupted run with every step once in metrics.jsonl; SIGKILL releases
// the lock; eval and bench never write into a held folder.
#include <gtest/gtest.h>
#include <unistd.h>

#include "common/run_lock.h"
#include "train_util.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_run_lock {

using testutil::TempDir;

namespace {

// ResNet-20 on synthetic 1x16x16, deterministic, a checkpoint every 2 steps: long enough to be
// interrupted (`steps`), exact enough to compare bitwise.
std::string lock_job(int64_t steps) {
  return "--set model.name=resnet20 --set data.kind=synthetic --set data.shape=[1,16,16]"
         " --set data.synthetic_size=96 --set data.test= --set data.crop_padding=2 --set data.hflip=true"
         " --set train.global_batch=8 --set train.epochs=0 --set train.steps=" +
         std::to_string(steps) +
         " --set train.deterministic=true --set checkpoint.every_steps=2 --set checkpoint.every_seconds=0"
         " --set log.every=1000 --set seed=11 --set train.threads=1 --set data.workers=1";
}

std::string host() {
  char buf[256] = {};
  gethostname(buf, sizeof buf - 1);
  return buf;
}

// A trainer holding `run_dir`: started, and past its first step (so it holds the folder and has written
// metrics). Stopped with SIGTERM (it saves) when the test is done with it, unless stopped already.
struct Holder {
  pid_t pid = -1;
  std::string log;
  Holder(const TempDir& dir, const std::string& run_dir, int64_t steps = 100000) : log((dir / "holder.log").string()) {
    pid = testutil::spawn(testutil::trainer_cmd(run_dir, lock_job(steps)), log);
    started = testutil::wait_for_metrics(run_dir, [](auto& l) { return testutil::last_step(l) >= 1; });
  }
  int stop(int sig = SIGTERM) {
    if (pid < 0) return code;
    kill(pid, sig);
    code = testutil::wait_exit(pid);
    pid = -1;
    return code;
  }
  ~Holder() { stop(); }
  bool started = false;
  int code = -1;
};

// Every step line of metrics.jsonl, in file order (not deduplicated).
std::vector<int64_t> steps_in_file_order(const std::string& run_dir) {
  std::vector<int64_t> out;
  for (const auto& l : testutil::read_jsonl(run_dir + "/metrics.jsonl"))
    if (!l.contains("event")) out.push_back(l["step"].get<int64_t>());
  return out;
}

}  // namespace

TEST(RunLock, TheLockFileNamesTheHolder) {
  TempDir dir;
  const auto run_dir = (dir / "run").string();
  Holder a(dir, run_dir);
  ASSERT_TRUE(a.started) << testutil::read_file(a.log);
  auto held = trainer::RunFolderLock::held_by_other(run_dir);
  ASSERT_TRUE(held.has_value());
  EXPECT_EQ(held->pid, a.pid);
  EXPECT_EQ(held->host, host());
  EXPECT_EQ(held->command, "train");
  EXPECT_EQ(held->config, "built-in");
  EXPECT_EQ(held->started.size(), 20u) << held->started;  // 2026-11-26T10:00:00Z
  EXPECT_EQ(held->describe(), "pid " + std::to_string(a.pid) + " on host " + host() + " since " + held->started +
                                  " (train, config built-in)");
  // This process cannot take it either, at once or after a short wait that reports while it waits.
  trainer::RunLockOptions lo;
  EXPECT_THROW(trainer::RunFolderLock::acquire(run_dir, lo), trainer::RunFolderBusy);
  lo.wait_s = 0.6;
  lo.report_every_s = 0.2;
  int reports = 0;
  lo.on_wait = [&](const trainer::RunFolderHolder& h, double) {
    EXPECT_EQ(h.pid, a.pid);
    ++reports;
  };
  const std::string what = testutil::error_text([&] { trainer::RunFolderLock::acquire(run_dir, lo); });
  EXPECT_NE(what.find("still held after waiting 1 s"), std::string::npos) << what;
  EXPECT_GE(reports, 3);
  EXPECT_EQ(a.stop(), 143);
  // Released with the process: the file stays, its contents no longer mean a holder.
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(run_dir) / trainer::kRunLockFile));
  EXPECT_FALSE(trainer::RunFolderLock::held_by_other(run_dir).has_value());
  auto mine = trainer::RunFolderLock::acquire(run_dir, trainer::RunLockOptions{});
  ASSERT_TRUE(mine->held());
  EXPECT_EQ(trainer::RunFolderLock::read_holder(run_dir)->pid, getpid());
  // Held by this process: the same lock again, also when the path is spelled another way.
  EXPECT_EQ(trainer::RunFolderLock::acquire(run_dir + "/.", trainer::RunLockOptions{}), mine);
  EXPECT_FALSE(trainer::RunFolderLock::held_by_other(run_dir).has_value());
}

TEST(RunLock, SecondTrainerIsRefusedAndWritesNothing) {
  TempDir dir;
  const auto run_dir = (dir / "run").string();
  Holder a(dir, run_dir);
  ASSERT_TRUE(a.started) << testutil::read_file(a.log);
  const auto log_before = testutil::read_file(run_dir + "/train.log");
  auto r = testutil::run(testutil::trainer_cmd(run_dir, lock_job(100000)));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  const std::string expected = "error: " + run_dir + ": the run folder is in use by pid " + std::to_string(a.pid) +
                               " on host " + host() + " since ";
  EXPECT_EQ(r.output.rfind(expected, 0), 0u) << r.output;
  EXPECT_NE(r.output.find("wait for it with --wait-for-run-dir SECONDS, or use another --run-dir"), std::string::npos)
      << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << "one line:\n" << r.output;
  // Nothing of the refused process in the holder's log (it stopped before opening it): the log still
  // starts as the holder wrote it, with one start line.
  const auto log_after = testutil::read_file(run_dir + "/train.log");
  EXPECT_EQ(log_after.substr(0, log_before.size()), log_before);
  EXPECT_EQ(log_after.find("in use by"), std::string::npos);
  EXPECT_EQ(a.stop(), 143);
  const auto steps = steps_in_file_order(run_dir);
  for (size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(steps[i], static_cast<int64_t>(i) + 1);
  // A bad wait is a command-line error.
  r = testutil::run(testutil::trainer_cmd(run_dir, "--wait-for-run-dir -3"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--wait-for-run-dir must be a number of seconds >= 0"), std::string::npos) << r.output;
}

// The Kubernetes replacement pod: the old one is told to stop (SIGTERM) while the new one is already
// started on the same volume with a wait longer than the old one's save.
TEST(RunLock, WaitingTrainerResumesWhereTheStoppedOneSaved) {
  TempDir dir;
  const int64_t steps = 24;
  const auto whole = (dir / "whole").string(), run_dir = (dir / "run").string();
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(whole, lock_job(steps))).exit_code, 0);
  Holder a(dir, run_dir, steps);
  ASSERT_TRUE(a.started) << testutil::read_file(a.log);
  // Frozen mid-run (holding the folder), so that however slow b is to start, a is still there.
  ASSERT_EQ(kill(a.pid, SIGSTOP), 0);
  const auto b_log = (dir / "b.log").string();
  pid_t b = testutil::spawn(testutil::trainer_cmd(run_dir, lock_job(steps) + " --wait-for-run-dir 120"), b_log);
  // b says it waits, and for whom, before a is stopped.
  bool waiting = false;
  for (int i = 0; i < 400 && !waiting; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    waiting = testutil::read_file(b_log).find("waiting for pid " + std::to_string(a.pid)) != std::string::npos;
  }
  if (!waiting) kill(a.pid, SIGCONT);
  ASSERT_TRUE(waiting) << testutil::read_file(b_log);
  // The stop arrives as a wakes up: it finishes its step, saves, exits.
  kill(a.pid, SIGTERM);
  kill(a.pid, SIGCONT);
  ASSERT_EQ(a.stop(), 143) << testutil::read_file(a.log);
  ASSERT_EQ(testutil::wait_exit(b), 0) << testutil::read_file(b_log);
  const auto stops = testutil::events(run_dir, "stop");
  const auto resumes = testutil::events(run_dir, "resume");
  ASSERT_EQ(stops.size(), 1u);
  ASSERT_EQ(resumes.size(), 1u);
  EXPECT_EQ(resumes[0]["step"], stops[0]["step"]) << "the second resumes from the first's SIGTERM checkpoint";
  // Every step once, in order, and the weights of the uninterrupted run.
  const auto order = steps_in_file_order(run_dir);
  ASSERT_EQ(order.size(), static_cast<size_t>(steps));
  for (int64_t i = 0; i < steps; ++i) EXPECT_EQ(order[static_cast<size_t>(i)], i + 1);
  EXPECT_TRUE(testutil::bitwise_equal(testutil::final_weights(whole), testutil::final_weights(run_dir)));
}

TEST(RunLock, WaitThatRunsOutIsRefused) {
  TempDir dir;
  const auto run_dir = (dir / "run").string();
  Holder a(dir, run_dir);
  ASSERT_TRUE(a.started) << testutil::read_file(a.log);
  auto r = testutil::run(testutil::trainer_cmd(run_dir, lock_job(100000) + " --wait-for-run-dir 1"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("waiting for pid " + std::to_string(a.pid)), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("error: " + run_dir + ": the run folder is in use by pid " + std::to_string(a.pid)),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("still held after waiting 1 s (raise --wait-for-run-dir, or use another --run-dir)"),
            std::string::npos)
      << r.output;
}

TEST(RunLock, SigkillReleasesTheLock) {
  TempDir dir;
  const auto run_dir = (dir / "run").string();
  Holder a(dir, run_dir);
  // Past a checkpoint that is on disk (its event comes once the background save has finished; a loaded
  // machine may still be writing step 2's when step 4 runs), so that the next run has one to resume.
  ASSERT_TRUE(testutil::wait_for_metrics(run_dir, [](auto& lines) {
    for (const auto& l : lines)
      if (l.value("event", "") == "checkpoint") return true;
    return false;
  })) << testutil::read_file(a.log);
  ASSERT_EQ(a.stop(SIGKILL), 128 + SIGKILL);
  // No cleanup, no wait: the kernel let go with the process.
  EXPECT_FALSE(trainer::RunFolderLock::held_by_other(run_dir).has_value());
  auto r = testutil::run(testutil::trainer_cmd(run_dir, lock_job(6)));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(testutil::events(run_dir, "resume").size(), 1u) << r.output;
}

TEST(RunLock, EvalReadsAHeldFolderButNeverWritesIntoIt) {
  TempDir dir;
  const auto run_dir = (dir / "run").string();
  Holder a(dir, run_dir);
  ASSERT_TRUE(testutil::wait_for_metrics(run_dir, [](auto& l) { return testutil::last_step(l) >= 3; }))
      << testutil::read_file(a.log);
  // Its default output is inside the held folder: refused before any scoring, naming the holder.
  auto r = testutil::run(testutil::trainer_bin() + " eval --run-dir " + run_dir + " --split train");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("the run folder is in use by pid " + std::to_string(a.pid)), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("eval reads its checkpoints but writes nothing into it: give --out FILE elsewhere"),
            std::string::npos)
      << r.output;
  // An --out anywhere inside it too.
  r = testutil::run(testutil::trainer_bin() + " eval --run-dir " + run_dir + " --out " + run_dir +
                    "/checkpoints/x.json");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_FALSE(std::filesystem::exists(run_dir + "/eval.json"));
  EXPECT_FALSE(std::filesystem::exists(run_dir + "/checkpoints/x.json"));
  EXPECT_FALSE(std::filesystem::exists(run_dir + "/checkpoints/x.json.tmp"));
}

TEST(RunLock, BenchRefusesAHeldRunFolder) {
  TempDir dir;
  const auto run_dir = (dir / "run").string();
  Holder a(dir, run_dir);
  ASSERT_TRUE(a.started) << testutil::read_file(a.log);
  auto r = testutil::run(testutil::trainer_bin() + " bench " + lock_job(4) + " --warmup 0 --steps 1 --run-dir " + run_dir);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("error: " + run_dir + ": the run folder is in use by pid " + std::to_string(a.pid)),
            std::string::npos)
      << r.output;
}

TEST(RunLock, BenchHoldsItsRunFolderWhileItsJobsTrainThere) {
  TempDir dir;
  const auto run_dir = (dir / "bench").string();
  const auto log = (dir / "bench.log").string();
  pid_t bench = testutil::spawn(testutil::trainer_bin() + " bench " + lock_job(400) + " --warmup 0 --steps 300 --rounds 1 --run-dir " +
                                    run_dir + " --out " + (dir / "bench.json").string(),
                                log);
  bool held = false;
  for (int i = 0; i < 600 && !held; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    auto h = trainer::RunFolderLock::held_by_other(run_dir);
    held = h && h->pid == bench;
  }
  EXPECT_TRUE(held) << testutil::read_file(log);
  auto r = testutil::run(testutil::trainer_cmd(run_dir, lock_job(4)));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(testutil::wait_exit(bench), 0) << testutil::read_file(log);
}

}  // namespace test_run_lock
