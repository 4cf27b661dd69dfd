// The GPU's identity through NVML (trainer/observe/nvml.h) and the DCGM exporter's labels on the trainer's
// series, without a GPU: a stand-in libnvidia-ml.so.1 (tests/fake_nvml.c) answers from environment
// variables. NVML is loaded once per process, so each case runs DISABLED_NvmlChild.Report in a child
// process of this executable with LD_LIBRARY_PATH on the stand-in's folder, and reads what it printed.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <climits>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <tuple>

#include "test_util.h"
#include "trainer/memory/backend.h"
#include "trainer/observe/nvml.h"
#include "trainer/observe/telemetry.h"

namespace nvml_test {  // named: the unity build puts several test files in one unit

// The folder holding the stand-in (fake_nvml, or fake_nvml_minimal); TRAINER_TEST_FAKE_NVML_DIR overrides
// the build folder where it does not exist (the GPU bundle).
std::string fake_dir(const std::string& variant) {
  return testutil::env_or("TRAINER_TEST_FAKE_NVML_DIR", FAKE_NVML_DIR) + "/" + variant;
}

std::string self_exe() {
  char buf[PATH_MAX] = {};
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
}

// Runs the child with `env` (VAR=value ...) and the stand-in `variant`; its output. The visible-devices
// variables of this process are removed first: the child sees only what the case sets.
std::string child(const std::string& env, const std::string& variant = "fake_nvml") {
  const auto r = testutil::run("env -u CUDA_VISIBLE_DEVICES -u NVIDIA_VISIBLE_DEVICES LD_LIBRARY_PATH=" +
                               fake_dir(variant) + " " + env + " " + self_exe() +
                               " --gtest_also_run_disabled_tests --gtest_filter=DISABLED_NvmlChild.Report");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return r.output;
}

bool has_line(const std::string& out, const std::string& line) {
  return ("\n" + out).find("\n" + line + "\n") != std::string::npos;
}

const char* kUuid = "GPU-5fa8c1d2-0000-4e5b-9c7a-1b2c3d4e5f60";
const char* kUuid2 = "GPU-77aa0000-1111-4222-8333-944455566677";
const char* kMig = "MIG-a1b2c3d4-5e6f-5a7b-8c9d-0e1f2a3b4c5d";
const char* kMig2 = "MIG-f0e1d2c3-b4a5-5968-8776-655443322110";

#define SKIP_WITHOUT_FAKE()                                                                    \
  if (!testutil::fs::exists(fake_dir("fake_nvml") + "/libnvidia-ml.so.1"))                    \
  GTEST_SKIP() << "the stand-in NVML library was not built: " << fake_dir("fake_nvml")


// Not run by itself (DISABLED_): the child of the cases below. Prints the identity, the Prometheus text of a
// telemetry holding known device memory, and the resource line.
TEST(DISABLED_NvmlChild, Report) {
  const char* index = std::getenv("CHILD_CUDA_INDEX");
  trainer::ResourceMonitor monitor(index ? std::atoi(index) : 0);
  const trainer::GpuIdentity& g = monitor.gpu();
  std::cout << "identity uuid=" << g.uuid << " gi=" << g.gpu_instance_id << " mig=" << g.mig_uuid
            << " nvml_index=" << g.nvml_index << "\nnote: " << g.note << "\n";
  trainer::Telemetry t;
  trainer::DeviceMemory m;
  m.device = "cuda:0";
  m.allocated = 1000;
  m.reserved = 1024;
  m.peak = 1500;
  m.limit = 4096;
  t.set_memory(m);
  t.set_gpu(g);
  const trainer::ResourceSample s = monitor.sample();
  t.set_gpu_utilization(s.gpu_percent);
  std::cout << t.prometheus_text() << trainer::ResourceMonitor::format(s) << "\n";
}

TEST(NvmlVisibleDevices, TheEntryOfTheCudaIndexAndTheContainersSingleDevice) {
  using trainer::visible_device_entry;
  EXPECT_EQ(visible_device_entry(0, nullptr, nullptr), "");
  EXPECT_EQ(visible_device_entry(1, " 3, GPU-abc ,MIG-x", nullptr), "GPU-abc");
  EXPECT_EQ(visible_device_entry(2, "3,GPU-abc,MIG-x", "GPU-other"), "MIG-x");
  EXPECT_EQ(visible_device_entry(3, "3,GPU-abc", nullptr), "");   // past the list
  EXPECT_EQ(visible_device_entry(0, "", "GPU-abc"), "");          // CUDA's list rules, even empty
  EXPECT_EQ(visible_device_entry(0, nullptr, "MIG-x"), "MIG-x");  // the container's one device
  EXPECT_EQ(visible_device_entry(1, nullptr, "MIG-x"), "");
  EXPECT_EQ(visible_device_entry(0, nullptr, "GPU-a,GPU-b"), "");  // not in CUDA's order: not used
  EXPECT_EQ(visible_device_entry(0, nullptr, "all"), "");
  EXPECT_EQ(visible_device_entry(0, nullptr, "/var/run/nvidia-container-devices"), "");
  EXPECT_EQ(visible_device_entry(-1, "0", nullptr), "");
}

TEST(NvmlTelemetryLabels, UuidAndInstanceOnTheGpuSeriesOnlyWhenKnown) {
  trainer::Telemetry t;
  trainer::DeviceMemory m;
  m.device = "cuda:0";
  m.reserved = 1024;
  t.set_memory(m);
  t.set_gpu_utilization(37);
  std::string text = t.prometheus_text();
  EXPECT_TRUE(has_line(text, "trainer_device_memory_reserved_bytes{device=\"cuda:0\"} 1024")) << text;
  EXPECT_TRUE(has_line(text, "trainer_gpu_utilization_percent 37")) << text;
  EXPECT_EQ(text.find("UUID"), std::string::npos) << text;
  EXPECT_EQ(text.find("trainer_gpu_info"), std::string::npos) << text;

  trainer::GpuIdentity g;
  g.uuid = kUuid;
  t.set_gpu(g);
  text = t.prometheus_text();
  EXPECT_TRUE(has_line(text, std::string("trainer_device_memory_reserved_bytes{device=\"cuda:0\",UUID=\"") + kUuid + "\"} 1024")) << text;
  EXPECT_TRUE(has_line(text, std::string("trainer_gpu_utilization_percent{UUID=\"") + kUuid + "\"} 37")) << text;
  EXPECT_TRUE(has_line(text, std::string("trainer_gpu_info{device=\"cuda:0\",UUID=\"") + kUuid + "\"} 1")) << text;
  EXPECT_EQ(text.find("GPU_I_ID"), std::string::npos) << "a whole GPU has none, as in the exporter's series\n" << text;

  g.gpu_instance_id = 3;
  g.mig_uuid = kMig;
  t.set_gpu(g);
  text = t.prometheus_text();
  EXPECT_TRUE(has_line(text, std::string("trainer_device_memory_limit_bytes{device=\"cuda:0\",UUID=\"") + kUuid +
                                 "\",GPU_I_ID=\"3\"} 0")) << text;
  EXPECT_TRUE(has_line(text, std::string("trainer_gpu_info{device=\"cuda:0\",UUID=\"") + kUuid +
                                 "\",GPU_I_ID=\"3\",mig_uuid=\"" + kMig + "\"} 1")) << text;
}

TEST(NvmlIdentity, AWholeGpuByIndexGetsItsUuidOnEveryGpuSeries) {
  SKIP_WITHOUT_FAKE();
  const std::string out = child(std::string("FAKE_NVML_UUIDS=") + kUuid + " FAKE_NVML_UTIL=37");
  EXPECT_TRUE(has_line(out, std::string("identity uuid=") + kUuid + " gi=-1 mig= nvml_index=0")) << out;
  const std::string ids = std::string("UUID=\"") + kUuid + "\"";
  for (const char* family : {"allocated", "reserved", "peak", "limit"})
    EXPECT_NE(out.find(std::string("trainer_device_memory_") + family + "_bytes{device=\"cuda:0\"," + ids + "}"),
              std::string::npos) << family << "\n" << out;
  EXPECT_TRUE(has_line(out, "trainer_device_memory_reserved_bytes{device=\"cuda:0\"," + ids + "} 1024")) << out;
  EXPECT_TRUE(has_line(out, "trainer_gpu_utilization_percent{" + ids + "} 37")) << out;
  EXPECT_TRUE(has_line(out, "trainer_gpu_info{device=\"cuda:0\"," + ids + "} 1")) << out;
  EXPECT_EQ(out.find("GPU_I_ID"), std::string::npos) << out;
  EXPECT_NE(out.find("| gpu 37%"), std::string::npos) << out;
}

TEST(NvmlIdentity, CudaVisibleDevicesMapsCudasIndexToNvmls) {
  SKIP_WITHOUT_FAKE();
  const std::string gpus = std::string("FAKE_NVML_UUIDS=") + kUuid + "," + kUuid2;
  // By number: CUDA's device 0 is NVML's GPU 1.
  std::string out = child(gpus + " CUDA_VISIBLE_DEVICES=1");
  EXPECT_TRUE(has_line(out, std::string("identity uuid=") + kUuid2 + " gi=-1 mig= nvml_index=1")) << out;
  // By UUID, the second entry for CUDA's device 1.
  out = child(gpus + " CUDA_VISIBLE_DEVICES=" + kUuid2 + "," + kUuid + " CHILD_CUDA_INDEX=1");
  EXPECT_TRUE(has_line(out, std::string("identity uuid=") + kUuid + " gi=-1 mig= nvml_index=0")) << out;
  // A UUID NVML does not know: no labels, a note, the run goes on.
  out = child(gpus + " CUDA_VISIBLE_DEVICES=GPU-unknown");
  EXPECT_TRUE(has_line(out, "identity uuid= gi=-1 mig= nvml_index=-1")) << out;
  EXPECT_TRUE(has_line(out, "note: NVML does not know the device GPU-unknown")) << out;
  EXPECT_EQ(out.find("UUID="), std::string::npos) << out;
}

TEST(NvmlIdentity, AMigSliceIsLabelledWithItsParentsUuidAndItsGpuInstance) {
  SKIP_WITHOUT_FAKE();
  const std::string mig = std::string("FAKE_NVML_UUIDS=") + kUuid + " FAKE_NVML_MIG_UUIDS=" + kMig + "," + kMig2 +
                          " FAKE_NVML_GPU_I_IDS=3,5";
  const std::string ids = std::string("UUID=\"") + kUuid + "\",GPU_I_ID=\"5\"";
  // Named in CUDA_VISIBLE_DEVICES, as a scheduler does.
  std::string out = child(mig + " CUDA_VISIBLE_DEVICES=" + kMig2);
  EXPECT_TRUE(has_line(out, std::string("identity uuid=") + kUuid + " gi=5 mig=" + kMig2 + " nvml_index=0")) << out;
  EXPECT_TRUE(has_line(out, "trainer_device_memory_peak_bytes{device=\"cuda:0\"," + ids + "} 1500")) << out;
  EXPECT_TRUE(has_line(out, "trainer_gpu_info{device=\"cuda:0\"," + ids + ",mig_uuid=\"" + kMig2 + "\"} 1")) << out;
  // NVML has no utilisation of a slice: the series is left out and the line says why.
  EXPECT_EQ(out.find("trainer_gpu_utilization_percent"), std::string::npos) << out;
  EXPECT_NE(out.find("gpu n/a (NVML gave no utilisation for GPU 0)"), std::string::npos) << out;
  // Named by the container runtime alone (Kubernetes' device plugin sets NVIDIA_VISIBLE_DEVICES).
  out = child(mig + " NVIDIA_VISIBLE_DEVICES=" + kMig);
  EXPECT_TRUE(has_line(out, std::string("identity uuid=") + kUuid + " gi=3 mig=" + kMig + " nvml_index=0")) << out;
  // The pre-R470 name carries the parent and the instance itself.
  out = child(mig + " CUDA_VISIBLE_DEVICES=MIG-" + kUuid + "/7/0");
  EXPECT_TRUE(has_line(out, std::string("identity uuid=") + kUuid + " gi=7 mig=MIG-" + kUuid + "/7/0 nvml_index=-1")) << out;
}

TEST(NvmlIdentity, AGpuInMigModeStandsForItsOnlyVisibleSliceElseNoInstanceIsGuessed) {
  SKIP_WITHOUT_FAKE();
  const std::string gpu = std::string("FAKE_NVML_UUIDS=") + kUuid + " FAKE_NVML_GPU_I_IDS=9,4";
  std::string out = child(gpu + " FAKE_NVML_MIG_UUIDS=" + kMig);
  EXPECT_TRUE(has_line(out, std::string("identity uuid=") + kUuid + " gi=9 mig=" + kMig + " nvml_index=0")) << out;
  EXPECT_TRUE(has_line(out, std::string("trainer_device_memory_reserved_bytes{device=\"cuda:0\",UUID=\"") + kUuid +
                                "\",GPU_I_ID=\"9\"} 1024")) << out;
  out = child(gpu + " FAKE_NVML_MIG_UUIDS=" + kMig + "," + kMig2);
  EXPECT_TRUE(has_line(out, std::string("identity uuid=") + kUuid + " gi=-1 mig= nvml_index=0")) << out;
  EXPECT_NE(out.find("note: the GPU is in MIG mode and 2 MIG slices are visible"), std::string::npos) << out;
  EXPECT_EQ(out.find("GPU_I_ID"), std::string::npos) << out;
}

TEST(NvmlIdentity, NoNvmlOrAnOldOneLeavesTheLabelsOutAndNeverFails) {
  SKIP_WITHOUT_FAKE();
  // nvmlInit fails (no driver loaded).
  std::string out = child(std::string("FAKE_NVML_UUIDS=") + kUuid + " FAKE_NVML_INIT_FAIL=1 FAKE_NVML_UTIL=37");
  EXPECT_TRUE(has_line(out, "identity uuid= gi=-1 mig= nvml_index=-1")) << out;
  EXPECT_TRUE(has_line(out, "note: nvmlInit_v2 failed with NVML error 9")) << out;
  EXPECT_TRUE(has_line(out, "trainer_device_memory_reserved_bytes{device=\"cuda:0\"} 1024")) << out;
  EXPECT_EQ(out.find("UUID"), std::string::npos) << out;
  EXPECT_EQ(out.find("trainer_gpu_utilization_percent"), std::string::npos) << out;
  // A library with only nvmlInit_v2, nvmlDeviceGetHandleByIndex_v2 and nvmlDeviceGetUtilizationRates:
  // utilisation, and no identity.
  out = child(std::string("FAKE_NVML_UUIDS=") + kUuid + " FAKE_NVML_UTIL=42", "fake_nvml_minimal");
  EXPECT_TRUE(has_line(out, "identity uuid= gi=-1 mig= nvml_index=-1")) << out;
  EXPECT_TRUE(has_line(out, "note: NVML gave no UUID for the GPU")) << out;
  EXPECT_TRUE(has_line(out, "trainer_gpu_utilization_percent 42")) << out;
  EXPECT_EQ(out.find("UUID="), std::string::npos) << out;
  // A CUDA_VISIBLE_DEVICES naming a MIG slice with an old library: not known, not a crash.
  out = child(std::string("FAKE_NVML_UUIDS=") + kUuid + " CUDA_VISIBLE_DEVICES=" + kMig, "fake_nvml_minimal");
  EXPECT_TRUE(has_line(out, std::string("note: NVML does not know the device ") + kMig)) << out;
}

// The labels as the trainer writes them join the DCGM exporter's series in the shipped alert rules: the
// child's own exposition (a MIG slice), scraped as job "trainer", beside the exporter's series of that
// slice and of another slice of the same card, run through promtool against deploy/prometheus's rules.
TEST(NvmlIdentity, ItsLabelsJoinTheDcgmExportersSeriesInTheShippedRules) {
  SKIP_WITHOUT_FAKE();
  if (testutil::run("command -v promtool").exit_code != 0) GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  const std::string out = child(std::string("FAKE_NVML_UUIDS=") + kUuid + " FAKE_NVML_MIG_UUIDS=" + kMig + "," + kMig2 +
                                " FAKE_NVML_GPU_I_IDS=3,5 CUDA_VISIBLE_DEVICES=" + kMig2);
  std::string series;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("trainer_device_memory_", 0) != 0) continue;
    const auto brace = line.find('}');
    ASSERT_NE(brace, std::string::npos) << line;
    series += "      - series: '" + line.substr(0, brace) + ",job=\"trainer\",instance=\"gpu:8080\"}'\n        values: '" +
              line.substr(brace + 2) + "x10'\n";
  }
  ASSERT_NE(series.find("GPU_I_ID=\"5\""), std::string::npos) << out;
  // The exporter's series, labelled as dcgm-exporter labels a MIG slice: slice 5 (the child's) is full,
  // slice 3 is not. MiB.
  const std::string dcgm = std::string("gpu=\"0\",UUID=\"") + kUuid +
                           "\",device=\"nvidia0\",modelName=\"NVIDIA A100-SXM4-40GB\",Hostname=\"node1\",GPU_I_PROFILE=\"1g.10gb\"";
  for (const auto& [gi, used, free] : {std::tuple<int, int, int>{5, 9700, 100}, {3, 100, 9700}})
    for (const auto& [name, v] : {std::pair<std::string, int>{"DCGM_FI_DEV_FB_USED", used}, {"DCGM_FI_DEV_FB_FREE", free}})
      series += "      - series: '" + name + "{" + dcgm + ",GPU_I_ID=\"" + std::to_string(gi) +
                "\",job=\"dcgm\",instance=\"node1:9400\"}'\n        values: '" + std::to_string(v) + "x10'\n";
  std::string description;  // the rule's own, which promtool compares too
  for (const auto& g : YAML::LoadFile(testutil::source_dir() + "/deploy/prometheus/trainer-rules.yml")["groups"])
    for (const auto& rule : g["rules"])
      if (rule["alert"].as<std::string>("") == "TrainerGpuMemoryTakenByOthers")
        description = rule["annotations"]["description"].as<std::string>();
  ASSERT_FALSE(description.empty());
  testutil::TempDir dir("trainer_nvml_promtool");
  testutil::write_file(dir / "join.test.yml",
                       "rule_files: ['" + testutil::source_dir() + "/deploy/prometheus/trainer-rules.yml']\n"
                       "evaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n" + series +
                       "    alert_rule_test:\n      - eval_time: 10m\n        alertname: TrainerGpuMemoryTakenByOthers\n"
                       "        exp_alerts:\n          - exp_labels: {severity: warning, job: trainer, instance: 'gpu:8080', "
                       "device: 'cuda:0', UUID: '" + kUuid + "', GPU_I_ID: '5'}\n            exp_annotations:\n"
                       "              summary: 'Trainer gpu:8080: its GPU " + kUuid +
                       " is over 95% full while the trainer holds 1kiB, under half its cap'\n"
                       "              description: " + nlohmann::json(description).dump() + "\n");
  const auto r = testutil::run("promtool test rules " + (dir / "join.test.yml").string());
  EXPECT_EQ(r.exit_code, 0) << r.output << "\n" << testutil::read_file(dir / "join.test.yml");
  EXPECT_NE(r.output.find("SUCCESS"), std::string::npos) << r.output;
}

}  // namespace nvml_test
