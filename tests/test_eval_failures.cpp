// The evaluation split through the executable: a test split that cannot match the model is bad input
// found at setup (before anything trains), and an evaluation that fails at the end of a run does not
// cost the trained steps: the final checkpoint is written before the final evaluation.
#include <gtest/gtest.h>

#include <fstream>

#include "data/files/image_h5.h"
#include "train_util.h"

#include <hdf5.h>  // after LibTorch (train_util.h): the chunk of a sample, to damage only that one

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_eval_failures {

namespace fs = std::filesystem;
using testutil::TempDir;

namespace {

// `n` random uint8 images of `shape` with labels 0, 1, ..., max_label, 0, 1, ... and `num_classes` in
// the file's attributes.
void write_split(const std::string& path, int64_t n, std::array<int64_t, 3> shape, int64_t num_classes,
                 int64_t max_label, int gzip = 0) {
  torch::manual_seed(3);
  auto images = torch::randint(0, 256, {n, shape[0], shape[1], shape[2]}, torch::kUInt8);
  auto labels = torch::arange(n, torch::kInt64).remainder(max_label + 1);
  data::ImageMeta meta;
  meta.num_classes = num_classes;
  meta.mean.assign(static_cast<size_t>(shape[0]), 0.5f);
  meta.std.assign(static_cast<size_t>(shape[0]), 0.25f);
  data::H5WriteOptions o;
  o.gzip_level = gzip;
  o.chunk_samples = 16;
  data::write_image_h5(path, images, labels, meta, o);
}

// plain_cnn on the HDF5 splits in `dir`, 4 steps (less than an epoch: only the final evaluation runs),
// no periodic checkpoints.
std::string eval_job(const TempDir& dir, const std::string& extra = "") {
  return "--set model.name=plain_cnn --set model.num_classes=10 --set data.kind=hdf5 --set data.train=" +
         (dir / "train.h5").string() + " --set data.test=" + (dir / "test.h5").string() +
         " --set train.global_batch=8 --set train.epochs=0 --set train.steps=4 --set train.eval_batch=16"
         " --set checkpoint.every_steps=0 --set checkpoint.every_seconds=0 --set log.every=1000"
         " --set train.threads=1 --set data.workers=1 " + extra;
}

// Exit 2 and the output's last line is the only "error: " line, naming every fragment.
void expect_bad_input(const testutil::CommandResult& r, const std::vector<std::string>& fragments) {
  EXPECT_EQ(r.exit_code, 2) << r.output;
  std::string out = r.output;
  while (!out.empty() && out.back() == '\n') out.pop_back();
  const std::string last = out.substr(out.rfind('\n') == std::string::npos ? 0 : out.rfind('\n') + 1);
  EXPECT_EQ(last.rfind("error: ", 0), 0u) << "the last line is the error:\n" << r.output;
  EXPECT_EQ(out.find("error: "), out.rfind("error: ")) << "one error line:\n" << r.output;
  for (const auto& f : fragments) EXPECT_NE(last.find(f), std::string::npos) << "'" << f << "' not in: " << last;
}

}  // namespace

TEST(EvalSplit, MoreClassesThanTheModelIsBadInputBeforeTraining) {
  TempDir dir;
  write_split((dir / "train.h5").string(), 64, {1, 12, 12}, 10, 9);
  write_split((dir / "test.h5").string(), 32, {1, 12, 12}, 12, 11);  // labels 10 and 11: no such outputs
  const std::string run = (dir / "run").string();
  auto r = testutil::run(testutil::trainer_cmd(run, eval_job(dir)));
  expect_bad_input(r, {"model.num_classes: 10", (dir / "test.h5").string(), "12 classes"});
  EXPECT_TRUE(testutil::step_lines(run).empty()) << "found before the first step";
}

TEST(EvalSplit, AnotherSampleShapeIsBadInputBeforeTraining) {
  TempDir dir;
  write_split((dir / "train.h5").string(), 64, {1, 12, 12}, 10, 9);
  write_split((dir / "test.h5").string(), 32, {3, 12, 12}, 10, 9);
  const std::string run = (dir / "run").string();
  auto r = testutil::run(testutil::trainer_cmd(run, eval_job(dir)));
  expect_bad_input(r, {"data.test", (dir / "test.h5").string(), "[3, 12, 12]", "[1, 12, 12]"});
  EXPECT_TRUE(testutil::step_lines(run).empty());
}

namespace {
// Where the chunk of /images that holds sample `sample` lies in the file: (offset, bytes).
std::pair<int64_t, int64_t> chunk_of_sample(const std::string& path, hsize_t sample) {
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  const hid_t d = H5Dopen2(f, "images", H5P_DEFAULT);
  const hsize_t at[4] = {sample, 0, 0, 0};
  unsigned filter_mask = 0;
  haddr_t offset = 0;
  hsize_t bytes = 0;
  const herr_t status = H5Dget_chunk_info_by_coord(d, at, &filter_mask, &offset, &bytes);
  H5Dclose(d);
  H5Fclose(f);
  EXPECT_GE(status, 0) << path;
  return {static_cast<int64_t>(offset), static_cast<int64_t>(bytes)};
}

// A compressed test split with one damaged image chunk in the middle (samples 128..143): opening it
// reads the metadata, the labels and the first and last samples (so does the trainer's check of the
// file in a child process, data/files/h5_check.h), all intact; an evaluation then fails to inflate the pixels
// when it reaches that chunk (data.in_memory=false reads them late).
void write_damaged_test_split(const TempDir& dir) {
  write_split((dir / "train.h5").string(), 64, {1, 12, 12}, 10, 9);
  const std::string test = (dir / "test.h5").string();
  write_split(test, 256, {1, 12, 12}, 10, 9, 1);
  const auto [offset, bytes] = chunk_of_sample(test, 128);
  ASSERT_GT(bytes, 0);
  std::fstream f(test, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(offset));
  const std::string junk(static_cast<size_t>(bytes), '\x5a');
  f.write(junk.data(), static_cast<std::streamsize>(junk.size()));
}
}  // namespace

TEST(EvalSplit, FailedFinalEvaluationKeepsTheTrainedSteps) {
  TempDir dir;
  write_damaged_test_split(dir);
  const std::string run = (dir / "run").string();
  auto r = testutil::run(testutil::trainer_cmd(run, eval_job(dir, "--set data.in_memory=false")));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("final evaluation at step 4 failed"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
  EXPECT_EQ(testutil::read_file(fs::path(run) / "checkpoints" / "latest"), "step-00000004\n") << r.output;
  // The run is complete: the same command does not train again.
  auto again = testutil::run(testutil::trainer_cmd(run, eval_job(dir, "--set data.in_memory=false")));
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("the run is complete"), std::string::npos) << again.output;
}

TEST(EvalSplit, FailedEvaluationBetweenStepsDoesNotStopTraining) {
  TempDir dir;
  write_damaged_test_split(dir);
  const std::string run = (dir / "run").string();
  auto r = testutil::run(testutil::trainer_cmd(run, eval_job(dir, "--set data.in_memory=false --set train.eval_every=2")));
  EXPECT_EQ(r.exit_code, 1) << r.output;  // the final evaluation fails too
  auto failed = testutil::events(run, "eval_failed");
  ASSERT_EQ(failed.size(), 1u) << r.output;
  EXPECT_EQ(failed[0]["step"], 2);
  EXPECT_NE(failed[0]["message"].get<std::string>().find("inflate"), std::string::npos) << failed[0];
  EXPECT_EQ(testutil::last_step(testutil::read_jsonl(run + "/metrics.jsonl")), 4) << "trained on after step 2";
  EXPECT_EQ(testutil::read_file(fs::path(run) / "checkpoints" / "latest"), "step-00000004\n") << r.output;
}

}  // namespace test_eval_failures
