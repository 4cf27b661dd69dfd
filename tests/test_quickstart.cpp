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

#include <ATen/Version.h>

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

// What picks the kernels, and so the last bits, on a CPU: LibTorch's CPU capability (the level of its
// vectorized kernels, "NO AVX", "AVX2" or "AVX512": the CPU's extensions under LibTorch's own rule, or
// ATEN_CPU_CAPABILITY), the vector extensions among those the record looked at (oneDNN's and OpenBLAS's
// choices), and the BLAS library. The CPU's name is shown but not compared: the same CPU is "AMD EPYC" under
// one hypervisor and "AMD EPYC 9R14 96-Core Processor" under another, with the same kernels.
struct Kernels {
  std::string cpu;         // /proc/cpuinfo's model name
  std::string capability;  // LibTorch's; "" where a record has none (then the extensions decide)
  json isa;                // the extensions present, sorted, among the record's isa_checked
  std::string blas;        // the libblas.so.3 the trainer loads, resolved
};

// What differs between the record's kernels and these, "" when nothing does. Pure: tested below.
std::string kernel_difference(const Kernels& recorded, const Kernels& here) {
  if (!recorded.capability.empty() && recorded.capability != here.capability)
    return "LibTorch's CPU capability is " + here.capability + ", not " + recorded.capability;
  if (here.isa != recorded.isa) return "the CPU has " + here.isa.dump() + ", not " + recorded.isa.dump();
  if (here.blas != recorded.blas) return "the BLAS is " + here.blas + ", not " + recorded.blas;
  return "";
}

// LibTorch's CPU capability, from at::show_config()'s "CPU capability usage: AVX2" (both toolchains).
std::string torch_cpu_capability() { return first_match(at::show_config(), R"(CPU capability usage: ([^\n]*))"); }

Kernels recorded_kernels(const json& machine) {
  const bool capability = machine.contains("cpu_capability") && machine.at("cpu_capability").is_string();
  return {machine.at("cpu").get<std::string>(), capability ? machine.at("cpu_capability").get<std::string>() : "",
          machine.at("isa"), machine.at("blas").get<std::string>()};
}

// This machine's kernels, the extensions looked at being the record's.
Kernels this_machines_kernels(const json& machine) {
  const std::string cpuinfo = testutil::read_file("/proc/cpuinfo");
  const std::string flags = " " + first_match(cpuinfo, R"(flags\s*:\s*([^\n]*))") + " ";
  json isa = json::array();
  for (const auto& name : machine.at("isa_checked"))
    if (flags.find(" " + name.get<std::string>() + " ") != std::string::npos) isa.push_back(name);
  const std::string ldd = testutil::run("ldd " + testutil::trainer_bin()).output;
  const std::string blas_link = first_match(ldd, R"(libblas\.so\.3 => (\S+))");
  std::error_code ec;
  return {first_match(cpuinfo, R"(model name\s*:\s*([^\n]*))"), torch_cpu_capability(), isa,
          blas_link.empty() ? "none" : fs::canonical(blas_link, ec).string()};
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
  const Kernels recorded = recorded_kernels(record.at("machine")), here = this_machines_kernels(record.at("machine"));
  if (const auto why = kernel_difference(recorded, here); !why.empty())
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

// The guard above compares what picks the kernels, not the CPU's name: two names with the same capability,
// extensions and BLAS are the same kernels; another capability level, another extension or another BLAS are not.
TEST(BuiltInJob, TheGuardComparesTheKernelsNotTheCpusName) {
  const json isa = {"avx", "avx2", "avx512_bf16", "avx512_vnni", "avx512bw", "avx512f", "avx512vl", "fma"};
  const std::string blas = "/usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3";
  const Kernels recorded{"AMD EPYC", "AVX2", isa, blas};
  EXPECT_EQ(kernel_difference(recorded, {"AMD EPYC 9R14 96-Core Processor", "AVX2", isa, blas}), "");
  EXPECT_EQ(kernel_difference({"AMD EPYC", "", isa, blas}, {"AMD EPYC 9454 48-Core Processor", "AVX2", isa, blas}), "")
      << "a record without the capability: the extensions decide";
  EXPECT_EQ(kernel_difference(recorded, {"AMD EPYC", "AVX512", isa, blas}), "LibTorch's CPU capability is AVX512, not AVX2");
  EXPECT_EQ(kernel_difference(recorded, {"AMD EPYC", "NO AVX", isa, blas}), "LibTorch's CPU capability is NO AVX, not AVX2");
  json fewer = isa;
  fewer.erase(fewer.begin() + 2);
  EXPECT_NE(kernel_difference(recorded, {"AMD EPYC", "AVX2", fewer, blas}), "");
  EXPECT_EQ(kernel_difference(recorded, {"AMD EPYC", "AVX2", isa, "none"}), "the BLAS is none, not " + blas);
  // This machine's capability is read from LibTorch as one of its levels.
  const std::string capability = torch_cpu_capability();
  EXPECT_TRUE(capability == "NO AVX" || capability == "AVX2" || capability == "AVX512" || capability == "DEFAULT" ||
              capability == "VSX" || capability == "ZVECTOR" || capability == "SVE256")
      << "'" << capability << "' in " << at::show_config();
}

}  // namespace test_quickstart
