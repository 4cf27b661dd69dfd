// The README's headline figure belongs to the current code. bench/quickstart.py records the built-in
// job's figures from a fresh clone, with the first 50 steps' losses and gradient norms; those steps are
// in the learning-rate warmup, whose rate does not depend on the job's length, so a 50-step run computes
// them again. On a machine like the recording's (the same CPU, BLAS and LibTorch), any difference in a
// bit means the code now computes other numbers than the figures were measured with: rerun
// bench/quickstart.py, update the README and add a CHANGELOG.md entry.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "test_util.h"
#include "train_util.h"
#include "common/compat.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_quickstart {

namespace {

using nlohmann::json;
using testutil::TempDir;
namespace fs = std::filesystem;

// The newest bench/results/quickstart-*/quickstart.json (the folders are named by date).
fs::path latest_record() {
  std::vector<fs::path> found;
  for (const auto& e : fs::directory_iterator(fs::path(testutil::source_dir()) / "bench/results"))
    if (e.path().filename().string().rfind("quickstart-", 0) == 0 && fs::exists(e.path() / "quickstart.json"))
      found.push_back(e.path() / "quickstart.json");
  std::sort(found.begin(), found.end());
  return found.empty() ? fs::path() : found.back();
}

std::string first_match(const std::string& text, const std::string& pattern) {
  std::smatch m;
  return std::regex_search(text, m, std::regex(pattern)) ? m[1].str() : "";
}

// What differs between this machine and the one `machine` (the record's) describes, "" when nothing does.
std::string machine_difference(const json& machine) {
  const std::string cpuinfo = testutil::read_file("/proc/cpuinfo");
  const std::string cpu = first_match(cpuinfo, R"(model name\s*:\s*([^\n]*))");
  if (cpu != machine.at("cpu").get<std::string>()) return "the CPU is " + cpu + ", not " + machine.at("cpu").get<std::string>();
  // The vector extensions among those the record looked at: the same set, none more, none less.
  const std::string flags = " " + first_match(cpuinfo, R"(flags\s*:\s*([^\n]*))") + " ";
  json here = json::array();
  for (const auto& isa : machine.at("isa_checked"))
    if (flags.find(" " + isa.get<std::string>() + " ") != std::string::npos) here.push_back(isa);
  if (here != machine.at("isa")) return "the CPU has " + here.dump() + ", not " + machine.at("isa").dump();
  const std::string ldd = testutil::run("ldd " + testutil::trainer_bin()).output;
  const std::string blas_link = first_match(ldd, R"(libblas\.so\.3 => (\S+))");
  std::error_code ec;
  const std::string blas = blas_link.empty() ? "none" : fs::canonical(blas_link, ec).string();
  if (blas != machine.at("blas").get<std::string>()) return "the BLAS is " + blas + ", not " + machine.at("blas").get<std::string>();
  return "";
}

}  // namespace

TEST(BuiltInJob, TheFirstStepsAreTheRecordedQuickstartsBitForBit) {
  const fs::path record_path = latest_record();
  ASSERT_FALSE(record_path.empty()) << "no bench/results/quickstart-*/quickstart.json: run bench/quickstart.py";
  const json record = json::parse(testutil::read_file(record_path));
  const auto& losses = record.at("first_steps").at("loss");
  const auto& norms = record.at("first_steps").at("grad_norm");
  ASSERT_EQ(losses.size(), norms.size());
  ASSERT_GE(losses.size(), 10u) << record_path;
  if (!fs::exists(testutil::kFashionDir)) GTEST_SKIP() << testutil::kFashionDir << " has no Fashion-MNIST (apt-get install dataset-fashion-mnist)";
  if (record.at("torch").get<std::string>() != trainer::compat::torch_version())
    GTEST_SKIP() << record_path << " was recorded with LibTorch " << record.at("torch").get<std::string>()
                 << ", this build has " << trainer::compat::torch_version();
  if (const auto why = machine_difference(record.at("machine")); !why.empty())
    GTEST_SKIP() << record_path << " was recorded on another machine: " << why << " (the kernels, and so the last bits, differ)";

  TempDir dir;
  auto converted = testutil::run(testutil::trainer_bin() + " convert-idx --src " + testutil::kFashionDir + " --out " + dir.str());
  ASSERT_EQ(converted.exit_code, 0) << converted.output;
  const std::string steps = std::to_string(losses.size());
  const std::string cmd = testutil::trainer_cmd(
      (dir / "run").string(), "--config " + testutil::source_dir() + "/configs/resnet20_fmnist.yaml --set data.train=" +
                                  (dir / "train.h5").string() + " --set data.test= --set train.epochs=0 --set train.steps=" +
                                  steps + " --set train.threads=" + std::to_string(record.at("machine").at("threads").get<int>()));
  auto r = testutil::run(cmd);
  ASSERT_EQ(r.exit_code, 0) << cmd << "\n" << r.output;

  std::vector<json> lines;
  std::ifstream in(dir / "run" / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) lines.push_back(json::parse(line));
  size_t k = 0;
  for (const auto& j : lines) {
    if (j.contains("event")) continue;
    ASSERT_LT(k, losses.size());
    // Exact: metrics.jsonl and the record both hold the shortest text that reads back as the same double.
    ASSERT_EQ(j.at("loss").get<double>(), losses[k].get<double>())
        << "step " << j.at("step") << " computes the loss " << j.at("loss").dump() << ", not " << losses[k].dump()
        << " as " << record_path << " (commit "
        << record.at("commit").get<std::string>() << ") recorded: the figures there are stale. Rerun bench/quickstart.py "
        << "and say in CHANGELOG.md what changed the numbers";
    ASSERT_EQ(j.at("grad_norm").get<double>(), norms[k].get<double>())
        << "step " << j.at("step") << " computes the gradient norm " << j.at("grad_norm").dump() << ", not " << norms[k].dump();
    ++k;
  }
  EXPECT_EQ(k, losses.size());
}

}  // namespace test_quickstart
