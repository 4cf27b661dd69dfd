// Checkpoints through the executable: a run killed (SIGKILL at a random moment, or SIGTERM) and
// restarted with the same command ends bitwise where the uninterrupted run ends; resume with another
// micro-batch; refused config changes; a corrupt latest checkpoint falls back to the previous one.
#include <gtest/gtest.h>

#include <functional>
#include <random>

#include "train_util.h"
#include "trainer/checkpoint/store.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_resume {

using testutil::TempDir;

namespace {

// ResNet-20 with augmentation (the loader's RNG) on synthetic 1x16x16, checkpoints every 2 steps.
std::string resume_job(int64_t steps, const std::string& extra = "") {
  return "--set model.name=resnet20 --set data.kind=synthetic --set data.shape=[1,16,16]"
         " --set data.synthetic_size=96 --set data.test= --set data.crop_padding=2 --set data.hflip=true"
         " --set train.global_batch=8 --set train.epochs=0 --set train.steps=" +
         std::to_string(steps) +
         " --set train.deterministic=true --set checkpoint.every_steps=2 --set checkpoint.every_seconds=0"
         " --set log.every=1000 --set seed=11 --set train.threads=1 --set data.workers=1 " +
         extra;
}

// Starts `args`, waits until step >= `after`, then sends `sig` after a random few milliseconds.
int interrupt(const TempDir& dir, const std::string& run_dir, const std::string& args, int64_t after, int sig) {
  pid_t pid = testutil::spawn(testutil::trainer_cmd(run_dir, args), (dir / "interrupted.log").string());
  bool reached = testutil::wait_for_metrics(run_dir, [&](auto& l) { return testutil::last_step(l) >= after; });
  std::mt19937 rng(std::random_device{}());
  std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 40));
  kill(pid, sig);
  int code = testutil::wait_exit(pid);
  EXPECT_TRUE(reached) << testutil::read_file(dir / "interrupted.log");
  return code;
}

void expect_same_losses(const std::string& a_dir, const std::string& b_dir) {
  auto a = testutil::step_lines(a_dir), b = testutil::step_lines(b_dir);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << "step " << i + 1;
    EXPECT_EQ(a[i]["batch_hash"], b[i]["batch_hash"]) << "step " << i + 1;
  }
}

// Rewrites the checkpoint of `step` in `run_dir` with its files changed by `edit`, through the store: the
// result is CRC-valid (a consistent manifest), only its contents are wrong.
void rewrite_checkpoint(const std::string& run_dir, int64_t step,
                        const std::function<void(trainer::CheckpointFiles&)>& edit) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  auto ck = trainer::CheckpointStore::load(run_dir + "/checkpoints/" + name);
  edit(ck.files);
  trainer::CheckpointStore(run_dir, 0).save(step, ck.files, ck.manifest.value("extra", nlohmann::json::object()));
}

// Checkpoints at 2, 4 and 6, the one at 6 rewritten by `edit`: the same command with 8 steps must
// resume from 4, name the checkpoint it skipped and why, and end bitwise where an uninterrupted run ends.
void expect_fallback_to_step_4(const std::function<void(trainer::CheckpointFiles&)>& edit, const std::string& why) {
  TempDir dir;
  auto run_dir = (dir / "run").string(), whole = (dir / "whole").string();
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(whole, resume_job(8))).exit_code, 0);
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(run_dir, resume_job(6))).exit_code, 0);
  rewrite_checkpoint(run_dir, 6, edit);
  auto r = testutil::run(testutil::trainer_cmd(run_dir, resume_job(8)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("step-00000006 is unusable: " + why), std::string::npos) << r.output;
  auto resumes = testutil::events(run_dir, "resume");
  ASSERT_EQ(resumes.size(), 1u);
  EXPECT_EQ(resumes[0]["step"].get<int64_t>(), 4);
  EXPECT_TRUE(testutil::bitwise_equal(testutil::final_weights(whole), testutil::final_weights(run_dir)));
}

}  // namespace

TEST(Resume, SigkillThenRestartIsBitwiseTheUninterruptedRun) {
  TempDir dir;
  const int64_t steps = 30;
  auto whole = (dir / "whole").string(), killed = (dir / "killed").string();
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(whole, resume_job(steps))).exit_code, 0);
  int code = interrupt(dir, killed, resume_job(steps), 10, SIGKILL);
  ASSERT_EQ(code, 128 + SIGKILL) << "the run finished before the kill; make it longer";
  auto r = testutil::run(testutil::trainer_cmd(killed, resume_job(steps)));  // the same command
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto resumes = testutil::events(killed, "resume");
  ASSERT_EQ(resumes.size(), 1u);
  // Some checkpoint at or before the kill: under load the background writes of the last ones may not
  // have committed yet (they are not counted until renamed), so any even step from 2 on is right.
  EXPECT_GE(resumes[0]["step"].get<int64_t>(), 2);
  EXPECT_EQ(resumes[0]["step"].get<int64_t>() % 2, 0);
  EXPECT_TRUE(testutil::bitwise_equal(testutil::final_weights(whole), testutil::final_weights(killed)));
  expect_same_losses(whole, killed);
}

TEST(Resume, SigtermSavesExitsAndResumesExactly) {
  TempDir dir;
  const int64_t steps = 30;
  auto whole = (dir / "whole").string(), stopped = (dir / "stopped").string();
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(whole, resume_job(steps))).exit_code, 0);
  int code = interrupt(dir, stopped, resume_job(steps), 6, SIGTERM);
  ASSERT_EQ(code, 143) << testutil::read_file(dir / "interrupted.log");
  auto stops = testutil::events(stopped, "stop");
  ASSERT_EQ(stops.size(), 1u);
  const int64_t stop_step = stops[0]["step"].get<int64_t>();
  auto r = testutil::run(testutil::trainer_cmd(stopped, resume_job(steps)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto resumes = testutil::events(stopped, "resume");
  ASSERT_EQ(resumes.size(), 1u);
  EXPECT_EQ(resumes[0]["step"].get<int64_t>(), stop_step) << "SIGTERM saves the step it finished";
  EXPECT_TRUE(testutil::bitwise_equal(testutil::final_weights(whole), testutil::final_weights(stopped)));
  expect_same_losses(whole, stopped);
}

// data.fetch_ahead: on, the order a CUDA job runs in by default, here on the CPU: each step fetches the next
// step's batch before it reads its own values. The same samples, losses and weights as the run that fetches
// each batch at its step; and a checkpoint written while the next batch is already fetched records where that
// batch starts, so a SIGTERM and a restart without fetch-ahead end bitwise where the uninterrupted run ends.
TEST(Resume, FetchAheadIsTheSameRunAndItsCheckpointsResumeExactly) {
  TempDir dir;
  const int64_t steps = 30;  // 12 steps an epoch: the fetch ahead crosses two epoch boundaries
  const std::string ahead = " --set data.fetch_ahead=on";
  auto whole = (dir / "whole").string(), fetched = (dir / "ahead").string(), stopped = (dir / "stopped").string();
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(whole, resume_job(steps))).exit_code, 0);
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(fetched, resume_job(steps, ahead))).exit_code, 0);
  expect_same_losses(whole, fetched);
  EXPECT_TRUE(testutil::bitwise_equal(testutil::final_weights(whole), testutil::final_weights(fetched)));
  int code = interrupt(dir, stopped, resume_job(steps, ahead), 6, SIGTERM);
  ASSERT_EQ(code, 143) << testutil::read_file(dir / "interrupted.log");
  auto r = testutil::run(testutil::trainer_cmd(stopped, resume_job(steps)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto resumes = testutil::events(stopped, "resume");
  ASSERT_EQ(resumes.size(), 1u);
  EXPECT_EQ(resumes[0]["step"].get<int64_t>(), testutil::events(stopped, "stop")[0]["step"].get<int64_t>());
  EXPECT_TRUE(testutil::bitwise_equal(testutil::final_weights(whole), testutil::final_weights(stopped)));
  expect_same_losses(whole, stopped);
}

TEST(Resume, WithAnotherMicroBatch) {
  TempDir dir;
  // plain_cnn: no batch statistics, so a different micro-batch gives the same steps up to rounding.
  const std::string plain = " --set model.name=plain_cnn";
  const int64_t steps = 30;
  auto whole = (dir / "whole").string(), resized = (dir / "resized").string();
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(whole, resume_job(steps, plain))).exit_code, 0);
  interrupt(dir, resized, resume_job(steps, plain), 8, SIGKILL);
  auto r = testutil::run(testutil::trainer_cmd(resized, resume_job(steps, plain + " --set train.micro_batch=3")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto s = testutil::step_lines(resized);
  EXPECT_EQ(s.back()["micro_batch"].get<int64_t>(), 3);
  EXPECT_EQ(s.back()["accum_steps"].get<int64_t>(), 3);
  EXPECT_LT(testutil::max_abs_diff(testutil::final_weights(whole), testutil::final_weights(resized)), 1e-5);
}

TEST(Resume, ChangedModelIsRefusedNamingTheKey) {
  TempDir dir;
  auto run_dir = (dir / "run").string();
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(run_dir, resume_job(4))).exit_code, 0);
  auto r = testutil::run(testutil::trainer_cmd(run_dir, resume_job(6, "--set model.name=resnet32")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("model.name"), std::string::npos) << r.output;
  // The augmentation is part of the experiment, as the flip is.
  r = testutil::run(testutil::trainer_cmd(run_dir, resume_job(6, "--set data.auto_augment=trivialaugment")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("data.auto_augment differs"), std::string::npos) << r.output;
  // A longer run (more steps) is allowed: that is what a resumed, resized job does.
  auto r2 = testutil::run(testutil::trainer_cmd(run_dir, resume_job(6)));
  EXPECT_EQ(r2.exit_code, 0) << r2.output;
  EXPECT_EQ(testutil::step_lines(run_dir).back()["step"].get<int64_t>(), 6);
  // --no-resume refuses a non-empty folder, and starts fresh in a new one.
  auto r3 = testutil::run(testutil::trainer_cmd(run_dir, resume_job(8, "--no-resume")));
  EXPECT_EQ(r3.exit_code, 2) << r3.output;
  EXPECT_NE(r3.output.find("--no-resume"), std::string::npos) << r3.output;
  auto fresh = (dir / "fresh").string();
  auto r4 = testutil::run(testutil::trainer_cmd(fresh, resume_job(2, "--no-resume")));
  EXPECT_EQ(r4.exit_code, 0) << r4.output;
  EXPECT_TRUE(testutil::events(fresh, "resume").empty());
}

TEST(Resume, CorruptLatestFallsBackToThePreviousCheckpoint) {
  TempDir dir;
  auto run_dir = (dir / "run").string();
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(run_dir, resume_job(6))).exit_code, 0);  // checkpoints at 2, 4, 6
  const std::string latest = run_dir + "/checkpoints/step-00000006/model.pt";
  ASSERT_TRUE(std::filesystem::exists(latest));
  {
    std::fstream f(latest, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    char c;
    f.read(&c, 1);
    f.seekp(200);
    c ^= 0x5a;
    f.write(&c, 1);
  }
  auto r = testutil::run(testutil::trainer_cmd(run_dir, resume_job(8)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("step-00000006"), std::string::npos) << "the corrupt checkpoint is named:\n" << r.output;
  auto resumes = testutil::events(run_dir, "resume");
  ASSERT_EQ(resumes.size(), 1u);
  EXPECT_EQ(resumes[0]["step"].get<int64_t>(), 4);
}

TEST(Resume, CheckpointWithoutItsConfigFallsBackToThePreviousOne) {
  // A CRC-valid manifest that lists no config.yaml used to end the run with "error: map::at".
  expect_fallback_to_step_4([](trainer::CheckpointFiles& f) { f.erase("config.yaml"); },
                            "config.yaml is missing (an incomplete checkpoint)");
}

TEST(Resume, CheckpointWhoseDataPositionIsOutsideTheDataFallsBack) {
  // A data position beyond the 96 samples used to fail at the loader's seek, with no fallback.
  auto move_out = [](trainer::CheckpointFiles& f) {
    auto st = nlohmann::json::parse(f.at("state.json"));
    st["position"] = 1000;
    f["state.json"] = st.dump(2);
  };
  expect_fallback_to_step_4(move_out, "state.json's data position (epoch 0, position 1000) is outside the training "
                                      "data (positions 0 to 96)");
  // --resume of exactly that checkpoint does not fall back: one line naming it and the reason.
  TempDir dir;
  auto run_dir = (dir / "run").string();
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(run_dir, resume_job(2))).exit_code, 0);
  rewrite_checkpoint(run_dir, 2, move_out);
  auto other = (dir / "other").string();
  auto r = testutil::run(testutil::trainer_cmd(other, resume_job(4, "--resume " + run_dir + "/checkpoints/step-00000002")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("cannot resume from checkpoint " + run_dir + "/checkpoints/step-00000002: state.json's "
                          "data position"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("seek"), std::string::npos) << r.output;
}

TEST(Resume, CheckpointWithAStateThatDoesNotParseFallsBack) {
  expect_fallback_to_step_4([](trainer::CheckpointFiles& f) { f["state.json"] = "{\"step\": 6}"; },
                            "state.json or config.yaml: ");
}

TEST(Resume, RunFolderWhoseNameIsNotUtf8) {
  // JSON strings must be UTF-8: the resume event (and every other record naming a path) used to throw
  // nlohmann's type_error 316 for such a folder, so the run could never be resumed.
  TempDir dir;
  const std::string run_dir = (dir / "run-\xff\xfe\xc3").string();
  const std::string quoted = "'" + run_dir + "'";
  auto r = testutil::run(testutil::trainer_cmd(quoted, resume_job(2)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testutil::run(testutil::trainer_cmd(quoted, resume_job(4)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto resumes = testutil::events(run_dir, "resume");
  ASSERT_EQ(resumes.size(), 1u);
  EXPECT_EQ(resumes[0]["step"].get<int64_t>(), 2);
  // The bytes that are not UTF-8 read as U+FFFD; the rest of the path is kept.
  const std::string path = resumes[0]["path"].get<std::string>();
  EXPECT_EQ(path.rfind(dir.str() + "/run-\xef\xbf\xbd", 0), 0u) << path;
  EXPECT_EQ(path.substr(path.size() - 26), "/checkpoints/step-00000002") << path;
  auto steps = testutil::step_lines(run_dir);
  ASSERT_EQ(steps.size(), 4u);
  // The resumed run ends where an uninterrupted one does.
  auto whole = (dir / "whole").string();
  ASSERT_EQ(testutil::run(testutil::trainer_cmd(whole, resume_job(4))).exit_code, 0);
  auto out = (dir / "w.pt").string();
  r = testutil::run(testutil::trainer_bin() + " export --run-dir " + quoted + " --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::map<std::string, torch::Tensor> resumed;
  for (auto& [k, v] : trainer::read_tensors(out)) resumed[k] = v;
  EXPECT_TRUE(testutil::bitwise_equal(testutil::final_weights(whole), resumed));
}

}  // namespace test_resume
