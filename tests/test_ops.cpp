// Operations: the telemetry snapshot and its HTTP endpoint (Prometheus text parsed line by line,
// probes, hostile clients), the memory report on a real capped-CPU OOM, the resource line,
// `trainer compare`, TensorBoard event files read back byte by byte, and the metrics plot.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <regex>
#include <thread>

#include "common/clock.h"
#include "models/registry.h"
#include "test_util.h"
#include "http_client.h"
#include "train_util.h"
#include "tools/compare.h"
#include "trainer/observe/http.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/report.h"
#include "trainer/observe/telemetry.h"
#include "trainer/observe/tensorboard.h"

// This file's own namespace: the unity build compiles several test files as one unit (docs/TESTING.md).
namespace test_ops {

using nlohmann::json;
using testutil::TempDir;
namespace fs = std::filesystem;

namespace {

using testutil::seconds_since;

// ---- a plain HTTP client on a socket: what a scraper or the kubelet sends --------------------------

using testutil::connect_to;

using testutil::http_get;

// ---- the Prometheus text format, checked line by line -----------------------------------------------

struct Exposition {
  std::map<std::string, std::string> help, type;
  std::map<std::string, double> value;   // first sample of each metric name
  std::map<std::string, std::string> labels;
  std::vector<std::string> errors;
};

Exposition parse_prometheus(const std::string& text) {
  Exposition e;
  static const std::regex sample(
      R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*"(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*")*)?\})? (\S+)$)");
  static const std::regex comment(R"(^# (HELP|TYPE) ([a-zA-Z_:][a-zA-Z0-9_:]*) (.+)$)");
  std::istringstream in(text);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    std::smatch m;
    if (line.rfind("#", 0) == 0) {
      if (!std::regex_match(line, m, comment)) {
        e.errors.push_back("line " + std::to_string(n) + ": bad comment: " + line);
        continue;
      }
      (m[1] == "HELP" ? e.help : e.type)[m[2]] = m[3];
      if (m[1] == "TYPE" && m[3] != "gauge" && m[3] != "counter")
        e.errors.push_back("line " + std::to_string(n) + ": unexpected type " + std::string(m[3]));
      continue;
    }
    if (!std::regex_match(line, m, sample)) {
      e.errors.push_back("line " + std::to_string(n) + ": not `name{labels} value`: " + line);
      continue;
    }
    const std::string name = m[1], v = m[4];
    char* end = nullptr;
    const double x = std::strtod(v.c_str(), &end);
    if (end != v.c_str() + v.size() || !std::isfinite(x))
      e.errors.push_back("line " + std::to_string(n) + ": value not a finite number: " + line);
    if (!e.help.count(name) || !e.type.count(name))
      e.errors.push_back("line " + std::to_string(n) + ": no HELP/TYPE before " + name);
    if (e.type[name] == "counter" && name.size() > 6 && name.compare(name.size() - 6, 6, "_total") != 0)
      e.errors.push_back(name + ": a counter's name should end in _total");
    if (name.rfind("trainer_", 0) != 0) e.errors.push_back(name + ": not prefixed trainer_");
    if (!e.value.count(name)) {
      e.value[name] = x;
      e.labels[name] = m[3];
    }
  }
  return e;
}

// A fake /proc and /sys for the values read at scrape time (as test_memory.cpp's cgroup tests).
struct FakeRoot {
  TempDir dir{"trainer_ops_root"};
  void write(const std::string& rel, const std::string& text) {
    fs::create_directories((dir.path / rel).parent_path());
    testutil::write_file(dir.path / rel, text);
  }
  std::string root() const { return dir.str(); }
  FakeRoot() {
    write("proc/self/cgroup", "0::/job\n");
    write("sys/fs/cgroup/cgroup.controllers", "cpu memory\n");
    write("sys/fs/cgroup/job/memory.max", "3221225472\n");
    write("sys/fs/cgroup/job/memory.current", "1048576\n");
    write("proc/self/statm", "9000 250 100 1 0 500 0\n");
    // A command name with spaces and parentheses: the fields are counted after the last ')'.
    // utime (field 14) = 300 ticks, stime (field 15) = 100 ticks.
    write("proc/self/stat", "4242 (tr (a) iner) R 1 4242 4242 0 -1 4194560 100 0 0 0 300 100 0 0 20 0 3 0 5 6 7\n");
  }
};

trainer::StepTelemetry step_values(int64_t step) {
  trainer::StepTelemetry s;
  s.step = step;
  s.total_steps = 1000;
  s.epoch = step / 100.0;
  s.samples_seen = step * 128;
  s.loss = 2.0 / static_cast<double>(step);
  s.lr = 0.125;
  s.samples_per_s = 1536.5;
  s.step_time_s = 0.0625;
  s.data_wait_s = 0.001953125;
  s.micro_batch = 32;
  s.accum_steps = 4;
  return s;
}

}  // namespace

// ---- telemetry and the endpoint -----------------------------------------------------------------------

TEST(OpsTelemetry, MetricsEndpointServesValidPrometheusTextWhileTheLoopUpdates) {
  FakeRoot fake;
  trainer::Telemetry t;
  trainer::HttpServerOptions o;
  o.port = 0;
  o.root = fake.root();
  trainer::HttpServer server(t, o);
  ASSERT_GT(server.port(), 0);
  EXPECT_EQ(server.url(), "http://127.0.0.1:" + std::to_string(server.port()));

  // A fake loop writes as fast as it can while the endpoint is scraped: every scrape must parse.
  std::atomic<bool> stop{false};
  std::thread loop([&] {
    for (int64_t i = 1; !stop; ++i) {
      t.on_step(step_values(i));
      t.set_memory({"cpu", i, i, 2 * i, 1 << 30});
    }
  });
  for (int k = 0; k < 5; ++k) {
    auto r = http_get(server.port(), "/metrics");
    ASSERT_EQ(r.status, 200) << r.headers;
    EXPECT_NE(r.headers.find("text/plain; version=0.0.4"), std::string::npos) << r.headers;
    auto e = parse_prometheus(r.body);
    EXPECT_TRUE(e.errors.empty()) << e.errors.front() << "\n" << r.body;
  }
  stop = true;
  loop.join();

  // Known values, then one scrape compared exactly.
  t.on_step(step_values(42));
  t.set_memory({"cpu", 123456789, 223456789, 323456789, 1073741824});
  t.add_oom(3);
  t.add_backoff(2);
  t.add_probe(5);
  t.add_probe_failed(1);
  t.on_checkpoint();
  t.on_eval(0.75, 0.875);
  t.set_info("model", "resnet20");
  t.set_ready(true);
  auto r = http_get(server.port(), "/metrics");
  ASSERT_EQ(r.status, 200);
  auto e = parse_prometheus(r.body);
  ASSERT_TRUE(e.errors.empty()) << e.errors.front() << "\n" << r.body;
  const std::map<std::string, double> expected = {
      {"trainer_step", 42},
      {"trainer_total_steps", 1000},
      {"trainer_epoch", 0.42},
      {"trainer_samples_seen_total", 42 * 128},
      {"trainer_samples_per_second", 1536.5},
      {"trainer_step_time_seconds", 0.0625},
      {"trainer_data_wait_seconds", 0.001953125},
      {"trainer_loss", 2.0 / 42},
      {"trainer_learning_rate", 0.125},
      {"trainer_micro_batch", 32},
      {"trainer_accumulation_steps", 4},
      {"trainer_oom_total", 3},
      {"trainer_backoff_total", 2},
      {"trainer_grow_probes_total", 5},
      {"trainer_grow_probes_failed_total", 1},
      {"trainer_checkpoints_total", 1},
      {"trainer_evals_total", 1},
      {"trainer_eval_loss", 0.75},
      {"trainer_eval_top1", 0.875},
      {"trainer_ready", 1},
      {"trainer_device_memory_allocated_bytes", 123456789},
      {"trainer_device_memory_reserved_bytes", 223456789},
      {"trainer_device_memory_peak_bytes", 323456789},
      {"trainer_device_memory_limit_bytes", 1073741824},
      // From the fake tree: statm's resident pages, the cgroup files, stat's utime + stime.
      {"trainer_host_rss_bytes", 250.0 * sysconf(_SC_PAGE_SIZE)},
      {"trainer_container_memory_limit_bytes", 3221225472.0},
      {"trainer_container_memory_usage_bytes", 1048576},
      {"trainer_process_cpu_seconds_total", 400.0 / sysconf(_SC_CLK_TCK)},
      {"trainer_heartbeat_timeout_seconds", 300},
  };
  for (const auto& [name, v] : expected) {
    ASSERT_TRUE(e.value.count(name)) << name << " missing from\n" << r.body;
    EXPECT_DOUBLE_EQ(e.value[name], v) << name;
  }
  EXPECT_EQ(e.labels["trainer_device_memory_allocated_bytes"], "device=\"cpu\"");
  EXPECT_EQ(e.labels["trainer_info"], "model=\"resnet20\"");
  EXPECT_EQ(e.labels["trainer_phase"], "phase=\"train\"");
  EXPECT_GE(e.value["trainer_heartbeat_age_seconds"], 0);
  EXPECT_LT(e.value["trainer_heartbeat_age_seconds"], 5);
  EXPECT_LT(e.value["trainer_seconds_since_checkpoint"], 5);
  EXPECT_EQ(e.value.count("trainer_gpu_utilization_percent"), 0u) << "no NVML sample: no gauge";
  for (const char* name : {"trainer_allocation_refusals_total", "trainer_uptime_seconds",
                           "trainer_memory_limit_changes_total", "trainer_nonfinite_steps_total"})
    EXPECT_TRUE(e.value.count(name)) << name;
}

TEST(OpsTelemetry, ObserveCountsTheRecordsOfMetricsJsonl) {
  trainer::Telemetry t;
  t.observe({{"event", "start"}, {"total_steps", 500}});
  t.observe({{"step", 7}, {"epoch", 0.07}, {"loss", 1.5}, {"lr", 0.01}, {"samples_seen", 896}, {"micro_batch", 64},
             {"accum_steps", 2}, {"samples_per_s", 900.0}, {"step_time_s", 0.1}, {"data_wait_s", 0.02},
             {"mem_peak_bytes", 5000}, {"mem_limit_bytes", 9000}});
  // The step writes one "oom" line per failed attempt, the ladder's answer as "kind".
  t.observe({{"event", "oom"}, {"kind", "backoff"}, {"step", 8}});
  t.observe({{"event", "oom"}, {"kind", "checkpointing_on"}, {"step", 8}});
  t.observe({{"event", "oom"}, {"kind", "probe_failed"}, {"step", 9}});
  t.observe({{"event", "oom"}, {"kind", "give_up"}, {"step", 9}});
  t.observe({{"event", "probe"}, {"step", 9}});
  t.observe({{"event", "probe"}, {"step", 12}});
  t.observe({{"event", "limit_changed"}, {"step", 12}});
  t.observe({{"event", "checkpoint"}, {"step", 12}, {"reason", "periodic"}});
  t.observe({{"event", "eval"}, {"step", 12}, {"loss", 0.5}, {"top1", 0.9}});
  t.observe({{"event", "nonfinite"}, {"step", 13}});
  t.observe({{"event", "oom"}, {"kind", 17}});         // mistyped: counted as an OOM, no kind
  t.observe({{"step", "x"}, {"loss", 3.0}});           // mistyped step: ignored
  t.observe(json::array({1, 2}));                      // not an object: ignored
  auto s = t.snapshot();
  EXPECT_EQ(s.step.step, 7);
  EXPECT_EQ(s.step.total_steps, 500);
  EXPECT_DOUBLE_EQ(s.step.loss, 1.5);
  EXPECT_DOUBLE_EQ(s.step.samples_per_s, 900.0);
  EXPECT_EQ(s.step.micro_batch, 64);
  EXPECT_EQ(s.step.accum_steps, 2);
  EXPECT_EQ(s.memory.peak, 5000);
  EXPECT_EQ(s.memory.limit, 9000);
  EXPECT_EQ(s.ooms, 5);
  EXPECT_EQ(s.backoffs, 2);
  EXPECT_EQ(s.probes, 2);
  EXPECT_EQ(s.probes_failed, 1);
  EXPECT_EQ(s.limit_changes, 1);
  EXPECT_EQ(s.checkpoints, 1);
  EXPECT_EQ(s.evals, 1);
  EXPECT_DOUBLE_EQ(s.eval_top1, 0.9);
  EXPECT_EQ(s.nonfinite_steps, 1);
  EXPECT_FALSE(s.stopping);
  // A resumed run has no start event: the loop says how many steps there are.
  t.set_total_steps(900);
  t.observe({{"event", "resume"}, {"step", 12}});
  EXPECT_EQ(t.snapshot().step.total_steps, 900);
  EXPECT_EQ(t.snapshot().step.step, 12);
  t.observe({{"event", "stop"}, {"step", 13}, {"signal", "SIGTERM"}});
  EXPECT_TRUE(t.snapshot().stopping);
  EXPECT_EQ(t.snapshot().phase, "stopping");
}

TEST(OpsTelemetry, LastCheckpointTimestampFromTheResumedCheckpointThenFromEachSave) {
  // The trainer's own clock (whole microseconds): a finer one could read later than the gauge within
  // the same microsecond.
  auto unix_now = [] { return trainer::unix_now(); };
  auto scrape = [](const trainer::Telemetry& t) {
    auto e = parse_prometheus(t.prometheus_text());
    EXPECT_TRUE(e.errors.empty()) << e.errors.front();
    return e;
  };
  const std::string name = "trainer_last_checkpoint_timestamp_seconds";
  trainer::Telemetry t;
  // A fresh run has no checkpoint: no gauge (a 0 would read as "55 years ago" in an alert).
  EXPECT_EQ(scrape(t).value.count(name), 0u);
  t.observe({{"event", "resume"}, {"step", 12}});  // a resume line without the field (older trainer)
  EXPECT_EQ(scrape(t).value.count(name), 0u);
  // A resumed run reports the time its checkpoint was written, exactly, not the restart's.
  t.observe({{"event", "resume"}, {"step", 12}, {"checkpoint_created_unix", 1700000123}});
  auto e = scrape(t);
  ASSERT_EQ(e.value.count(name), 1u);
  EXPECT_EQ(e.value[name], 1700000123.0);
  EXPECT_EQ(e.type[name], "gauge");
  // A save through the metrics log, then one through on_checkpoint(): the wall-clock time of each.
  double before = unix_now();
  t.observe({{"event", "checkpoint"}, {"step", 14}, {"reason", "periodic"}});
  double after = unix_now();
  e = scrape(t);
  EXPECT_GE(e.value[name], before);
  EXPECT_LE(e.value[name], after);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  before = unix_now();
  t.on_checkpoint();
  after = unix_now();
  e = scrape(t);
  EXPECT_GE(e.value[name], before);
  EXPECT_LE(e.value[name], after);
  EXPECT_DOUBLE_EQ(t.snapshot().last_checkpoint_unix_s, e.value[name]);
}

TEST(OpsHttp, HealthzFollowsTheHeartbeatAge) {
  trainer::Telemetry t(0.25);
  trainer::HttpServer server(t, "127.0.0.1", 0);
  t.heartbeat();
  auto r = http_get(server.port(), "/healthz");
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.body.rfind("ok: last heartbeat", 0), 0u) << r.body;
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  r = http_get(server.port(), "/healthz");
  EXPECT_EQ(r.status, 503) << r.body;
  EXPECT_NE(r.body.find("stalled: last heartbeat"), std::string::npos) << r.body;
  EXPECT_NE(r.body.find("threshold 0.25 s"), std::string::npos) << r.body;
  t.heartbeat();
  EXPECT_EQ(http_get(server.port(), "/healthz").status, 200);
  // A long phase keeps the run alive through set_phase / heartbeat.
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  t.set_phase("eval");
  r = http_get(server.port(), "/healthz");
  EXPECT_EQ(r.status, 200);
  EXPECT_NE(r.body.find("phase eval"), std::string::npos) << r.body;
  EXPECT_THROW(trainer::Telemetry(0), std::invalid_argument);
}

TEST(OpsHttp, ReadyzAfterSetupAndUntilStopping) {
  trainer::Telemetry t;
  trainer::HttpServer server(t, "127.0.0.1", 0);
  auto r = http_get(server.port(), "/readyz");
  EXPECT_EQ(r.status, 503);
  EXPECT_NE(r.body.find("setup has not finished"), std::string::npos) << r.body;
  t.set_ready(true);
  EXPECT_EQ(http_get(server.port(), "/readyz").status, 200);
  t.set_stopping();
  r = http_get(server.port(), "/readyz");
  EXPECT_EQ(r.status, 503);
  EXPECT_NE(r.body.find("stopping"), std::string::npos) << r.body;
  EXPECT_EQ(http_get(server.port(), "/nope").status, 404);
}

TEST(OpsHttp, SilentAndStalledClientsNeverBlockTelemetryUpdates) {
  trainer::Telemetry t;
  trainer::HttpServerOptions o;
  o.max_connections = 2;
  o.idle_timeout_s = 1;
  o.read_timeout_s = 1;
  auto server = std::make_unique<trainer::HttpServer>(t, o);
  const int port = server->port();
  // More hostile clients than connection slots: two connect and say nothing, one sends half a request.
  std::vector<int> hostile;
  for (int i = 0; i < 2; ++i) hostile.push_back(connect_to(port, 10));
  hostile.push_back(connect_to(port, 10));
  const std::string partial = "GET /metrics HTTP/1.1\r\nHost: x\r\n";
  ASSERT_EQ(send(hostile.back(), partial.data(), partial.size(), 0), static_cast<ssize_t>(partial.size()));
  for (int fd : hostile) ASSERT_GE(fd, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));

  // The loop's writes take the telemetry mutex only: each returns in microseconds whatever the server does.
  double worst = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 1; i <= 20000; ++i) {
    const auto c0 = std::chrono::steady_clock::now();
    t.on_step(step_values(i));
    t.heartbeat();
    worst = std::max(worst, seconds_since(c0));
  }
  const double total = seconds_since(t0);
  std::printf("[ info ] 20000 updates with 3 hostile clients: %.1f ms in all, worst %.3f ms\n", total * 1e3, worst * 1e3);
  EXPECT_LT(total, 2.0);
  EXPECT_LT(worst, 0.05);

  // A real scrape still gets through (it takes the oldest hostile connection's slot).
  const auto s0 = std::chrono::steady_clock::now();
  auto r = http_get(port, "/healthz");
  EXPECT_EQ(r.status, 200);
  EXPECT_LT(seconds_since(s0), 5.0);
  for (int fd : hostile) close(fd);

  // Shutdown does not wait for clients.
  int lingering = connect_to(port, 10);
  const auto d0 = std::chrono::steady_clock::now();
  server.reset();
  EXPECT_LT(seconds_since(d0), 3.0);
  close(lingering);
}

TEST(OpsHttp, ASecondServerOnTheSamePortFailsWithAMessage) {
  trainer::Telemetry t;
  trainer::HttpServer first(t, "127.0.0.1", 0);
  try {
    trainer::HttpServer second(t, "127.0.0.1", first.port());
    FAIL() << "a second server bound port " << first.port();
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cannot bind 127.0.0.1:" + std::to_string(first.port())), std::string::npos) << msg;
    EXPECT_NE(msg.find("log.http_port"), std::string::npos) << msg;
  }
  EXPECT_THROW(trainer::HttpServer(t, "127.0.0.1", 70000), std::invalid_argument);
  EXPECT_EQ(http_get(first.port(), "/healthz").status, 200) << "the first server still serves";
}

TEST(OpsHttp, MemoryEndpointRequestsAReportAndReturnsTheLatest) {
  trainer::Telemetry t;
  t.set_memory_report_interval_s(0);  // the rate limit has its own test (test_hostile.cpp)
  trainer::HttpServer server(t, "127.0.0.1", 0);
  EXPECT_FALSE(t.take_memory_report_request());
  auto r = http_get(server.port(), "/memory");
  EXPECT_EQ(r.status, 202);
  EXPECT_EQ(json::parse(r.body)["status"], "requested");
  EXPECT_TRUE(t.take_memory_report_request());
  EXPECT_FALSE(t.take_memory_report_request()) << "a request is taken once";
  t.set_memory_report(R"({"step": 3, "allocated_bytes": 10})");
  r = http_get(server.port(), "/memory");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(json::parse(r.body)["allocated_bytes"], 10);
  EXPECT_TRUE(t.take_memory_report_request());
}

// ---- memory report --------------------------------------------------------------------------------------

TEST(OpsMemoryReport, WrittenOnARealCappedCpuOom) {
  TempDir dir;
  trainer::Telemetry t;
  trainer::CpuMemoryBackend backend;
  trainer::MemoryReporter reporter(dir.str(), &t, 2);
  reporter.record_phase_peak(5, "forward", 1000);
  reporter.record_phase_peak(6, "forward", 3000);
  reporter.record_phase_peak(6, "forward", 2000);  // a smaller micro-batch's peak keeps the larger
  reporter.record_phase_peak(6, "backward", 4000);
  reporter.record_phase_peak(7, "optimizer", 5000);  // keep_steps = 2: step 5 drops out

  const int64_t refused_before = trainer::cpu_allocator::refused_allocations();
  auto keep = torch::ones({1 << 18});  // 1 MiB that stays allocated
  const int64_t cap = trainer::cpu_allocator::live_bytes() + (4 << 20);
  std::string error;
  int64_t current_at_oom = 0;
  {
    trainer::ScopedCpuCap scoped(cap);
    try {
      auto big = torch::empty({16 << 20}, torch::kFloat);  // 64 MiB past a 4 MiB margin
      FAIL() << "the allocation past the cap succeeded";
    } catch (const std::exception& e) {
      ASSERT_TRUE(trainer::is_oom_error(e)) << e.what();
      error = e.what();
    }
    ASSERT_NE(error.find("\nException raised from"), std::string::npos) << "c10::Error appends a backtrace";
    current_at_oom = backend.current_bytes();
    auto rep = reporter.write(7, backend, "oom", error);
    EXPECT_EQ(rep.path, (dir / "memory_report_7.json").string());
    EXPECT_NE(rep.text.find("memory report: step 7, oom on cpu"), std::string::npos) << rep.text;
    EXPECT_NE(rep.text.find("allocation refusals"), std::string::npos) << rep.text;
    EXPECT_NE(rep.text.find("not applicable"), std::string::npos) << rep.text;
    std::printf("%s\n", rep.text.c_str());
  }
  auto j = json::parse(testutil::read_file(dir / "memory_report_7.json"));
  for (const char* k : {"step", "reason", "time", "device", "allocated_bytes", "reserved_bytes", "active_bytes",
                        "peak_bytes", "limit_bytes", "total_bytes", "free_bytes", "fragmentation_bytes",
                        "largest_free_block_bytes", "ooms", "allocation_refusals", "phase_peaks", "error", "note"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_EQ(j["step"], 7);
  EXPECT_EQ(j["reason"], "oom");
  EXPECT_EQ(j["device"], "cpu");
  EXPECT_EQ(j["limit_bytes"].get<int64_t>(), cap);
  EXPECT_EQ(j["allocated_bytes"].get<int64_t>(), current_at_oom);
  EXPECT_GE(j["allocated_bytes"].get<int64_t>(), int64_t{1} << 20);
  EXPECT_EQ(j["reserved_bytes"], j["allocated_bytes"]);
  EXPECT_EQ(j["fragmentation_bytes"], 0);
  EXPECT_TRUE(j["largest_free_block_bytes"].is_null());
  EXPECT_EQ(j["ooms"], 1);
  EXPECT_EQ(j["allocation_refusals"].get<int64_t>(), refused_before + 1);
  EXPECT_EQ(j["error"], error.substr(0, error.find("\nException raised from")));
  EXPECT_EQ(j["error"].get<std::string>().rfind("CPU out of memory (trainer memory cap): tried to allocate 64.00 MiB", 0), 0u);
  EXPECT_EQ(j["phase_peaks"], json::parse(R"([{"step": 6, "forward": 3000, "backward": 4000},
                                                {"step": 7, "optimizer": 5000}])"));
  // The endpoint's copy is the same report.
  EXPECT_EQ(json::parse(t.memory_report()), j);

  // A second report in the same step gets its own file; no temporary file is left behind.
  auto rep2 = reporter.write(7, backend, "SIGUSR2");
  EXPECT_EQ(rep2.path, (dir / "memory_report_7_2.json").string());
  EXPECT_EQ(json::parse(testutil::read_file(rep2.path))["ooms"], 1) << "a requested report is not an OOM";
  for (const auto& f : fs::directory_iterator(dir.path)) EXPECT_NE(f.path().extension(), ".tmp") << f.path();
  EXPECT_THROW(trainer::MemoryReporter(dir.str(), nullptr, 0), std::invalid_argument);

  // A report that cannot be written (the "run folder" is a file) still gives its text, and says why.
  testutil::write_file(dir / "not_a_folder", "x");
  trainer::MemoryReporter broken((dir / "not_a_folder").string());
  auto rep3 = broken.write(8, backend, "oom", "boom");
  EXPECT_TRUE(rep3.path.empty());
  EXPECT_NE(rep3.write_error.find("memory report: cannot write " + (dir / "not_a_folder").string() +
                                  "/memory_report_8.json.tmp"), std::string::npos) << rep3.write_error;
  EXPECT_NE(rep3.text.find("error: boom"), std::string::npos) << rep3.text;
}

// Per-phase peaks by hand: tensors of known sizes allocated and freed in each phase.
TEST(OpsMemoryReport, PhasePeaksOfKnownAllocationsAndTheStepPeakKept) {
  TempDir dir;
  trainer::PhasePeakBackend mem(std::make_unique<trainer::CpuMemoryBackend>());
  trainer::MemoryReporter reporter(dir.str());
  constexpr int64_t MiB = 1 << 20;
  mem.reset_peak();
  const int64_t base = mem.current_bytes();
  {
    trainer::PhasePeakRecorder phases(mem, reporter, 3, 8);
    phases.enter("forward");
    auto kept = torch::empty({MiB / 4});  // 1 MiB of floats, kept
    { auto tmp = torch::empty({MiB / 2}); }  // 2 MiB, freed: the forward peak is base + 3 MiB
    phases.enter("backward");
    auto grad = torch::empty({MiB / 16});  // 256 KiB, kept
    phases.enter("optimizer");
    { auto tmp = torch::empty({MiB / 8}); }  // 512 KiB on top of 1.25 MiB
    EXPECT_EQ(mem.phase_peak_bytes(), base + MiB + MiB / 4 + MiB / 2);
  }
  // The wrapped allocator's own peak restarted with each phase; the wrapper still knows the step's.
  EXPECT_EQ(trainer::cpu_allocator::peak_bytes(), base + MiB + MiB / 4 + MiB / 2);
  EXPECT_EQ(mem.peak_bytes(), base + 3 * MiB);
  // An attempt that an exception ends is marked failed in the phase it was in.
  try {
    trainer::PhasePeakRecorder phases(mem, reporter, 3, 4);
    phases.enter("forward");
    auto x = torch::empty({MiB / 4});
    phases.enter("backward");
    throw std::runtime_error("out of memory (a stand-in)");
  } catch (const std::runtime_error&) {
  }
  const json peaks = reporter.build(3, mem, "request")["phase_peaks"];
  EXPECT_EQ(peaks, json::parse("[{\"step\": 3, \"micro_batch\": 8, \"forward\": " + std::to_string(base + 3 * MiB) +
                               ", \"backward\": " + std::to_string(base + MiB + MiB / 4) +
                               ", \"optimizer\": " + std::to_string(base + MiB + MiB / 4 + MiB / 2) +
                               "}, {\"step\": 3, \"micro_batch\": 4, \"forward\": " + std::to_string(base + MiB) +
                               ", \"backward\": " + std::to_string(base + MiB) + ", \"failed_in\": \"backward\"}]"))
      << peaks.dump();
  const std::string text = trainer::MemoryReporter::format(reporter.build(3, mem, "request"));
  EXPECT_NE(text.find("failed in backward"), std::string::npos) << text;
  EXPECT_NE(text.find("micro-batch"), std::string::npos) << text;
  mem.reset_peak();
  EXPECT_EQ(mem.peak_bytes(), mem.current_bytes());

  // Any other backend: the recorder records nothing and leaves its peak alone.
  trainer::CpuMemoryBackend plain;
  trainer::MemoryReporter quiet(dir.str());
  auto big = torch::empty({MiB / 4});
  big.reset();
  const int64_t peak_before = plain.peak_bytes();
  {
    trainer::PhasePeakRecorder phases(plain, quiet, 1, 1);
    phases.enter("forward");
  }
  EXPECT_EQ(plain.peak_bytes(), peak_before);
  EXPECT_TRUE(quiet.build(1, plain, "request")["phase_peaks"].empty());
  EXPECT_THROW(trainer::PhasePeakBackend(nullptr), std::invalid_argument);
}

// A real run under a cap that fits micro-batch 16 and not 24 (plain_cnn, global batch 32): step 1 fails
// at 32 and completes at 16; step 2 probes 24 (grow_after 1, no headroom), fails, completes at 16. The
// report of step 2's OOM lists the three attempts with their phases, checked against the step lines,
// the parameter bytes and the error's own count of live bytes.
TEST(OpsMemoryReport, PhasePeaksOfARealCappedRunThatOoms) {
  TempDir dir;
  const std::string job = "--set model.name=plain_cnn --set data.kind=synthetic --set data.shape=[1,28,28]"
                          " --set data.synthetic_size=640 --set data.test= --set data.workers=1 --set train.threads=1"
                          " --set train.global_batch=32 --set train.epochs=0 --set schedule.name=constant"
                          " --set checkpoint.every_seconds=0 --set log.every=1000 --set seed=5 --set train.steps=2";
  auto peak_at = [&](int64_t mb) {
    const std::string run_dir = (dir / ("peak" + std::to_string(mb))).string();
    auto r = testutil::run(testutil::trainer_cmd(run_dir, job + " --set train.micro_batch=" + std::to_string(mb)));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    int64_t p = 0;
    for (const auto& l : testutil::step_lines(run_dir)) p = std::max(p, l["mem_peak_bytes"].get<int64_t>());
    return p;
  };
  const int64_t p16 = peak_at(16), p24 = peak_at(24);
  ASSERT_GT(p24, p16 + 400000) << "the test needs a clear gap between micro-batches 16 and 24";
  const int64_t cap = (p16 + p24) / 2;
  const std::string run_dir = (dir / "capped").string();
  auto r = testutil::run(testutil::trainer_cmd(run_dir, job + " --set memory.limit=" + std::to_string(cap) +
                                                            " --set memory.grow_after=1 --set memory.headroom=0"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto steps = testutil::step_lines(run_dir);
  ASSERT_EQ(steps.size(), 2u);
  ASSERT_EQ(steps[0]["micro_batch"], 16);
  ASSERT_EQ(steps[1]["micro_batch"], 16);
  ASSERT_EQ(steps[1]["oom_retries"], 1) << "step 2 should have probed 24 and failed";

  int64_t param_bytes = 0;
  auto model = models::create_model("plain_cnn", models::ModelOptions().in_channels(1).num_classes(10));
  for (const auto& p : model->parameters()) param_bytes += p.numel() * static_cast<int64_t>(sizeof(float));

  const json first = json::parse(testutil::read_file(dir / "capped" / "memory_report_1.json"));
  const json rep = json::parse(testutil::read_file(dir / "capped" / "memory_report_2.json"));
  const json& peaks = rep["phase_peaks"];
  ASSERT_EQ(peaks.size(), 3u) << peaks.dump();
  EXPECT_EQ(first["phase_peaks"], json::array({peaks[0]})) << "the first report saw the failed attempt only";
  const std::vector<std::string> names = {"forward", "backward", "optimizer"};
  // Failed attempts: step 1 at 32, step 2 at 24. The phase it failed in held at least the live bytes the
  // allocator reported when it refused, and nothing passed the cap.
  const std::regex live_re(R"(\((\d+) bytes\) live under a cap of [^(]*\((\d+) bytes\))");
  for (size_t i : {size_t{0}, size_t{2}}) {
    const json& e = peaks[i];
    EXPECT_EQ(e["step"], i == 0 ? 1 : 2);
    EXPECT_EQ(e["micro_batch"], i == 0 ? 32 : 24);
    ASSERT_TRUE(e.contains("failed_in")) << e.dump();
    const std::string failed = e["failed_in"];
    ASSERT_TRUE(e.contains(failed)) << e.dump();
    for (const auto& n : names)
      if (e.contains(n)) EXPECT_LE(e[n].get<int64_t>(), cap) << n;
    std::smatch m;
    const std::string error = (i == 0 ? first : rep)["error"];
    ASSERT_TRUE(std::regex_search(error, m, live_re)) << error;
    EXPECT_EQ(std::stoll(m[2].str()), cap);
    EXPECT_GE(e[failed].get<int64_t>(), std::stoll(m[1].str())) << e.dump() << "\n" << error;
  }
  // The completed attempt of step 1 at 16: all three phases; together they are the step's peak.
  const json& ok = peaks[1];
  EXPECT_EQ(ok["step"], 1);
  EXPECT_EQ(ok["micro_batch"], 16);
  EXPECT_FALSE(ok.contains("failed_in"));
  for (const auto& n : names) ASSERT_TRUE(ok.contains(n)) << ok.dump();
  const int64_t fwd = ok["forward"], bwd = ok["backward"], opt = ok["optimizer"];
  EXPECT_EQ(std::max({fwd, bwd, opt}), steps[0]["mem_peak_bytes"].get<int64_t>());
  const int64_t start = steps[0]["mem_start_bytes"].get<int64_t>();
  // Forward holds activations on top of what the step began with; backward ends with every gradient; the
  // first optimizer step adds the momentum buffers on top of the gradients.
  EXPECT_GT(fwd, start);
  EXPECT_GE(bwd, start + param_bytes);
  EXPECT_GE(opt, start + 2 * param_bytes);
  for (int64_t v : {fwd, bwd, opt}) EXPECT_LE(v, cap);
}

// ---- the resource line ----------------------------------------------------------------------------------

TEST(OpsResources, CpuSecondsFromProcStatAndTheResourceLine) {
  FakeRoot fake;
  EXPECT_DOUBLE_EQ(trainer::process_cpu_seconds(fake.root()), 400.0 / sysconf(_SC_CLK_TCK));
  EXPECT_EQ(trainer::process_cpu_seconds(fake.root() + "/nowhere"), -1);

  // The real process: a thread that spins until the process has used 0.3 s of CPU shows as CPU use.
  // On shared cores the spin may take longer than 0.3 s, so the reference is the CPU time over the wall
  // time of the same interval, measured independently (clock_gettime), not a fixed figure.
  auto cpu_now = [] {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
  };
  const double cpu0 = cpu_now();
  const auto t0 = std::chrono::steady_clock::now();
  trainer::ResourceMonitor mon(-1);
  volatile double x = 0;
  while (cpu_now() - cpu0 < 0.3) x = x + 1;
  trainer::CpuMemoryBackend backend;
  auto s = mon.sample(&backend);
  const double expected = 100.0 * (cpu_now() - cpu0) / seconds_since(t0);
  EXPECT_GT(s.cpu_percent, 0.7 * expected - 5) << "a thread busy for 0.3 s of CPU; reference " << expected << "%";
  EXPECT_LT(s.cpu_percent, 1.3 * expected + 5) << "reference " << expected << "%";
  EXPECT_LT(s.cpu_percent, 100.0 * s.usable_cpus + 50);
  EXPECT_GT(s.rss_bytes, 0);
  EXPECT_EQ(s.gpu_percent, -1);
  const std::string line = trainer::ResourceMonitor::format(s);
  std::printf("[ info ] %s\n", line.c_str());
  EXPECT_EQ(line.rfind("resources: cpu ", 0), 0u) << line;
  EXPECT_NE(line.find("| rss "), std::string::npos) << line;
  EXPECT_NE(line.find("| cpu mem "), std::string::npos) << line;
  EXPECT_NE(line.find("gpu n/a (cpu run)"), std::string::npos) << line;

  // NVML: absent on this machine; then the line says why.
  auto& nvml = trainer::Nvml::instance();
  if (!nvml.available()) {
    EXPECT_FALSE(nvml.error().empty());
    EXPECT_EQ(nvml.utilization(0), -1);
    trainer::ResourceMonitor gpu_mon(0);
    const std::string l = trainer::ResourceMonitor::format(gpu_mon.sample());
    EXPECT_NE(l.find("gpu n/a (" + nvml.error() + ")"), std::string::npos) << l;
    std::printf("[ info ] NVML not available here: %s\n", nvml.error().c_str());
  } else {
    EXPECT_GE(nvml.utilization(0), 0);
  }
}

// ---- compare --------------------------------------------------------------------------------------------

namespace {

const char* kBaseline = R"({"samples_per_s": 1000.0, "step_time_p50_s": 0.128, "peak_memory_bytes": 2147483648,
                            "final_loss": 0.40, "best_top1": 0.91, "model": "resnet20", "steps": 100})";

std::string compare_cmd(const std::string& a, const std::string& b, const std::string& extra = "") {
  return testutil::trainer_bin() + " compare " + a + " " + b + " " + extra;
}

}  // namespace

TEST(OpsCompare, IdenticalPassesAndAThroughputDropFailsWithExitCode5) {
  TempDir dir;
  testutil::write_file(dir / "base.json", kBaseline);
  testutil::write_file(dir / "same.json", kBaseline);
  auto worse = json::parse(kBaseline);
  worse["samples_per_s"] = 800.0;  // -20%
  testutil::write_file(dir / "worse.json", worse.dump());

  auto r = testutil::run(compare_cmd((dir / "base.json").string(), (dir / "same.json").string()));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("no regression"), std::string::npos) << r.output;

  r = testutil::run(compare_cmd((dir / "base.json").string(), (dir / "worse.json").string()));
  EXPECT_EQ(r.exit_code, trainer::kExitRegression) << r.output;
  EXPECT_EQ(trainer::kExitRegression, 5);
  std::printf("%s", r.output.c_str());
  // The row names the metric, the values, the change, the limit and why.
  std::regex row(R"(\nsamples_per_s +1000 +800 +-20\.00% +>= 900 +REGRESSION \(lower is worse\)\n)");
  EXPECT_TRUE(std::regex_search(r.output, row)) << r.output;
  EXPECT_NE(r.output.find("REGRESSION: 1 metric(s) beyond tolerance"), std::string::npos) << r.output;

  // A looser tolerance file lets it pass; the file is checked.
  testutil::write_file(dir / "loose.yaml", "samples_per_s: {rel: 0.25}\nmy_metric: {better: lower, abs: 1}\n");
  r = testutil::run(compare_cmd((dir / "base.json").string(), (dir / "worse.json").string(),
                                "--tolerances " + (dir / "loose.yaml").string()));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  testutil::write_file(dir / "bad.yaml", "samples_per_s: {relative: 0.25}\n");
  r = testutil::run(compare_cmd((dir / "base.json").string(), (dir / "worse.json").string(),
                                "--tolerances " + (dir / "bad.yaml").string()));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("samples_per_s.relative: unknown key"), std::string::npos) << r.output;
  testutil::write_file(dir / "nodir.yaml", "new_metric: {rel: 0.1}\n");
  r = testutil::run(compare_cmd((dir / "base.json").string(), (dir / "worse.json").string(),
                                "--tolerances " + (dir / "nodir.yaml").string()));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("new_metric has no default; give better: higher or lower"), std::string::npos) << r.output;
  r = testutil::run(compare_cmd((dir / "base.json").string(), (dir / "missing.json").string()));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("missing.json: no such file or folder"), std::string::npos) << r.output;
}

TEST(OpsCompare, DirectionsAndTolerancesPerMetric) {
  auto base = json::parse(kBaseline);
  auto run = base;
  run["peak_memory_bytes"] = 2147483648.0 * 1.06;  // +6% > 5%: worse (higher is worse)
  run["final_loss"] = 0.415;                       // +0.015 < max(5% of 0.40, 0.02) = 0.02: ok
  run["best_top1"] = 0.895;                        // -1.5 points > 1 point: worse (lower is worse)
  run["step_time_p50_s"] = 0.1;                    // faster by 22% > 10%: improved
  run["extra"] = 3;                                // no tolerance: info
  run.erase("samples_per_s");                      // only in the baseline: missing, not a failure
  auto c = trainer::compare_summaries(base, run);
  std::map<std::string, std::string> status;
  for (const auto& r : c.rows) status[r.metric] = r.status;
  EXPECT_TRUE(c.regression);
  EXPECT_EQ(status["peak_memory_bytes"], "REGRESSION");
  EXPECT_EQ(status["final_loss"], "ok");
  EXPECT_EQ(status["best_top1"], "REGRESSION");
  EXPECT_EQ(status["step_time_p50_s"], "improved");
  EXPECT_EQ(status["extra"], "info");
  EXPECT_EQ(status["samples_per_s"], "missing");
  EXPECT_EQ(status["steps"], "info");
  EXPECT_EQ(status.count("model"), 0u) << "strings are not metrics";
  const std::string table = c.table();
  EXPECT_NE(table.find("<= 2.10 GiB"), std::string::npos) << table;  // 2 GiB + 5%
  EXPECT_NE(table.find("REGRESSION (higher is worse)"), std::string::npos) << table;
  // NaN in the run is a regression, whatever the direction.
  run = base;
  run["final_loss"] = std::nan("");
  EXPECT_TRUE(trainer::compare_summaries(base, run).regression);
}

TEST(OpsCompare, SummaryOfAMetricsJsonlAgainstHandComputedValues) {
  TempDir dir;
  std::ofstream f(dir / "metrics.jsonl");
  f << R"({"event": "start", "total_steps": 6})" << "\n";
  // Step 1 (warm-up after start) is left out of throughput and step time.
  const double sps[] = {10, 100, 300, 200, 400};
  const double st[] = {9.0, 0.4, 0.2, 0.3, 0.1};
  const double loss[] = {2.0, 1.5, 1.0, 0.5, 0.25};
  const int64_t peak[] = {100, 500, 300, 200, 100};
  for (int i = 0; i < 5; ++i)
    f << json{{"step", i + 1}, {"loss", loss[i]}, {"samples_per_s", sps[i]}, {"step_time_s", st[i]},
              {"mem_peak_bytes", peak[i]}}.dump() << "\n";
  f << R"({"event": "eval", "step": 3, "loss": 0.9, "top1": 0.80})" << "\n";
  f << R"({"event": "oom", "step": 4, "kind": "backoff"})" << "\n";
  f << R"({"event": "eval", "step": 5, "loss": 0.7, "top1": 0.85})" << "\n";
  f << R"({"event": "resume", "step": 5})" << "\n";
  f << json{{"step", 6}, {"loss", 0.25}, {"samples_per_s", 5.0}, {"step_time_s", 8.0}, {"mem_peak_bytes", 50}}.dump()
    << "\n";
  f << R"({"event": "eval", "step": 6, "loss": 0.8, "top1": 0.83, "final": true})" << "\n";
  f << R"({"event": "end", "step": 6, "seconds": 12.5})" << "\n";
  f << R"({"step": 7, "loss": 0.1, "samp)" << "\n";  // cut by a kill: skipped
  f.close();
  auto s = trainer::load_summary(dir.str());  // the run folder
  EXPECT_EQ(s["steps"], 6);
  EXPECT_DOUBLE_EQ(s["final_loss"].get<double>(), (2.0 + 1.5 + 1.0 + 0.5 + 0.25 + 0.25) / 6);
  EXPECT_DOUBLE_EQ(s["samples_per_s"].get<double>(), 250.0);    // median of 100, 300, 200, 400
  EXPECT_DOUBLE_EQ(s["step_time_p50_s"].get<double>(), 0.25);    // median of 0.4, 0.2, 0.3, 0.1
  EXPECT_NEAR(s["step_time_p90_s"].get<double>(), 0.37, 1e-12);  // 0.3 + 0.7 * (0.4 - 0.3)
  EXPECT_EQ(s["peak_memory_bytes"], 500);
  EXPECT_DOUBLE_EQ(s["best_top1"].get<double>(), 0.85);
  EXPECT_DOUBLE_EQ(s["final_top1"].get<double>(), 0.83);
  EXPECT_DOUBLE_EQ(s["final_eval_loss"].get<double>(), 0.8);
  EXPECT_EQ(s["oom_events"], 1);
  EXPECT_DOUBLE_EQ(s["wall_time_s"].get<double>(), 12.5);
  EXPECT_EQ(trainer::load_summary((dir / "metrics.jsonl").string()), s);

  // The command line takes the folder too, and --summarize prints the same summary.
  auto r = testutil::run(testutil::trainer_bin() + " compare --summarize " + dir.str());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(json::parse(r.output), s);
  r = testutil::run(compare_cmd(dir.str(), (dir / "metrics.jsonl").string()));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  testutil::write_file(dir / "empty.jsonl", "{\"event\": \"start\"}\n");
  EXPECT_THROW(trainer::load_summary((dir / "empty.jsonl").string()), std::runtime_error);
}

// ---- TensorBoard ----------------------------------------------------------------------------------------

namespace {

uint64_t read_le(const std::string& s, size_t pos, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(s[pos + i])) << (8 * i);
  return v;
}

// A minimal protobuf reader: field number -> raw values (varints as numbers, fixed as bytes, strings).
struct Field {
  int number = 0, wire = 0;
  uint64_t varint = 0;
  std::string bytes;
};

std::vector<Field> decode(const std::string& msg) {
  std::vector<Field> out;
  size_t p = 0;
  auto varint = [&]() {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      if (p >= msg.size() || shift > 63) throw std::runtime_error("bad varint");
      const uint8_t b = static_cast<uint8_t>(msg[p++]);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
  };
  while (p < msg.size()) {
    const uint64_t key = varint();
    Field f;
    f.number = static_cast<int>(key >> 3);
    f.wire = static_cast<int>(key & 7);
    if (f.wire == 0) f.varint = varint();
    else if (f.wire == 1) f.bytes = msg.substr(p, 8), p += 8;
    else if (f.wire == 5) f.bytes = msg.substr(p, 4), p += 4;
    else if (f.wire == 2) {
      const uint64_t n = varint();
      f.bytes = msg.substr(p, n);
      p += n;
    } else throw std::runtime_error("unexpected wire type " + std::to_string(f.wire));
    if (p > msg.size()) throw std::runtime_error("truncated field");
    out.push_back(f);
  }
  return out;
}

struct Scalar {
  int64_t step;
  double wall_time;
  std::string tag;
  float value;
};

}  // namespace

TEST(OpsTensorboard, EventFileReadsBackWithValidFramingAndFields) {
  // The CRC-32C check value of the standard (RFC 3720 B.4): "123456789" -> 0xE3069283.
  EXPECT_EQ(trainer::tfrecord::crc32c("123456789", 9), 0xE3069283u);
  TempDir dir;
  std::string path;
  {
    trainer::TensorboardWriter w((dir / "run").string());
    path = w.path();
    w.add_scalar("train/loss", 1, 2.5, 1700000000.25);
    w.add_scalar("train/loss", 2, 1.25, 1700000001.5);
    w.add_scalar("train/lr", 300000000000LL, 0.1, 1700000002.0);  // a step past 2^32 (a multi-byte varint)
    w.observe({{"step", 3}, {"loss", 0.75}, {"lr", 0.05}, {"samples_per_s", 512.0}, {"mem_peak_bytes", 1048576}});
    w.observe({{"event", "eval"}, {"step", 3}, {"loss", 0.5}, {"top1", 0.9375}});
    w.observe({{"event", "checkpoint"}, {"step", 3}});  // not a scalar: nothing written
  }
  EXPECT_EQ(fs::path(path).parent_path(), dir / "run");
  EXPECT_EQ(fs::path(path).filename().string().rfind("events.out.tfevents.", 0), 0u) << path;

  std::ifstream in(path, std::ios::binary);
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> records;
  for (size_t p = 0; p < data.size();) {
    ASSERT_LE(p + 12, data.size()) << "truncated header at " << p;
    const uint64_t len = read_le(data, p, 8);
    EXPECT_EQ(read_le(data, p + 8, 4), trainer::tfrecord::masked_crc32c(data.data() + p, 8)) << "length CRC at " << p;
    ASSERT_LE(p + 12 + len + 4, data.size()) << "truncated record at " << p;
    const std::string rec = data.substr(p + 12, len);
    EXPECT_EQ(read_le(data, p + 12 + len, 4), trainer::tfrecord::masked_crc32c(rec.data(), rec.size()))
        << "data CRC at " << p;
    records.push_back(rec);
    p += 12 + len + 4;
  }
  ASSERT_EQ(records.size(), 6u);  // file_version + 3 add_scalar + 2 observed

  // The first event: wall_time and file_version.
  auto first = decode(records[0]);
  ASSERT_EQ(first.size(), 2u);
  EXPECT_EQ(first[0].number, 1);
  EXPECT_EQ(first[0].wire, 1);
  EXPECT_EQ(first[1].number, 3);
  EXPECT_EQ(first[1].bytes, "brain.Event:2");

  std::vector<Scalar> scalars;
  for (size_t i = 1; i < records.size(); ++i) {
    int64_t step = 0;
    double wall = 0;
    for (const auto& f : decode(records[i])) {
      if (f.number == 1) std::memcpy(&wall, f.bytes.data(), 8);
      else if (f.number == 2) step = static_cast<int64_t>(f.varint);
      else if (f.number == 5) {
        for (const auto& v : decode(f.bytes)) {
          ASSERT_EQ(v.number, 1);  // Summary.value
          Scalar s{step, wall, "", 0};
          for (const auto& vf : decode(v.bytes)) {
            if (vf.number == 1) s.tag = vf.bytes;
            if (vf.number == 2) {
              ASSERT_EQ(vf.wire, 5);
              std::memcpy(&s.value, vf.bytes.data(), 4);
            }
          }
          scalars.push_back(s);
        }
      } else {
        ADD_FAILURE() << "unexpected Event field " << f.number;
      }
    }
  }
  std::map<std::string, std::vector<std::pair<int64_t, float>>> by_tag;
  for (const auto& s : scalars) by_tag[s.tag].emplace_back(s.step, s.value);
  EXPECT_EQ(by_tag["train/loss"], (std::vector<std::pair<int64_t, float>>{{1, 2.5f}, {2, 1.25f}, {3, 0.75f}}));
  EXPECT_EQ(by_tag["train/lr"], (std::vector<std::pair<int64_t, float>>{{300000000000LL, 0.1f}, {3, 0.05f}}));
  EXPECT_EQ(by_tag["train/samples_per_s"], (std::vector<std::pair<int64_t, float>>{{3, 512.0f}}));
  EXPECT_EQ(by_tag["memory/peak_bytes"], (std::vector<std::pair<int64_t, float>>{{3, 1048576.0f}}));
  EXPECT_EQ(by_tag["eval/loss"], (std::vector<std::pair<int64_t, float>>{{3, 0.5f}}));
  EXPECT_EQ(by_tag["eval/top1"], (std::vector<std::pair<int64_t, float>>{{3, 0.9375f}}));
  EXPECT_EQ(scalars[0].wall_time, 1700000000.25);
  EXPECT_EQ(scalars[1].wall_time, 1700000001.5);

  // The same records through Google's protobuf decoder, with the Event / Summary schema (the fields
  // of tensorflow/core/util/event.proto and summary.proto that the writer uses) built at run time.
  auto has_pb = testutil::run(testutil::python() + " -c 'import google.protobuf'");
  if (has_pb.exit_code != 0) {
    std::printf("[ info ] cross-check with Google's protobuf skipped: %s has no google.protobuf "
                "(scripts/install-deps.sh installs python3-protobuf)\n", testutil::python().c_str());
  } else {
    const std::string pb_script =
        "import sys, struct\n"
        "from google.protobuf import descriptor_pb2, descriptor_pool, message_factory\n"
        "fdp = descriptor_pb2.FileDescriptorProto(name='event_subset.proto', package='tensorflow', syntax='proto3')\n"
        "m = fdp.message_type.add(name='Value')\n"
        "m.field.add(name='tag', number=1, type=9, label=1)\n"                // string
        "m.field.add(name='simple_value', number=2, type=2, label=1)\n"       // float
        "m = fdp.message_type.add(name='Summary')\n"
        "m.field.add(name='value', number=1, type=11, label=3, type_name='.tensorflow.Value')\n"
        "m = fdp.message_type.add(name='Event')\n"
        "m.field.add(name='wall_time', number=1, type=1, label=1)\n"          // double
        "m.field.add(name='step', number=2, type=3, label=1)\n"               // int64
        "m.field.add(name='file_version', number=3, type=9, label=1)\n"
        "m.field.add(name='summary', number=5, type=11, label=1, type_name='.tensorflow.Summary')\n"
        "pool = descriptor_pool.DescriptorPool(); pool.Add(fdp)\n"
        "d = pool.FindMessageTypeByName('tensorflow.Event')\n"
        "Event = message_factory.GetMessageClass(d) if hasattr(message_factory, 'GetMessageClass') "
        "else message_factory.MessageFactory(pool).GetPrototype(d)\n"
        "data = open(sys.argv[1], 'rb').read(); p = 0\n"
        "while p < len(data):\n"
        "    (n,) = struct.unpack_from('<Q', data, p); ev = Event.FromString(data[p + 12:p + 12 + n]); p += 16 + n\n"
        "    if ev.file_version: print('version', ev.file_version)\n"
        "    for v in ev.summary.value: print(ev.step, v.tag, repr(v.simple_value), repr(ev.wall_time))\n";
    testutil::write_file(dir / "read_pb.py", pb_script);
    auto r = testutil::run(testutil::python() + " " + (dir / "read_pb.py").string() + " " + path);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(r.output.rfind("version brain.Event:2\n"
                             "1 train/loss 2.5 1700000000.25\n"
                             "2 train/loss 1.25 1700000001.5\n"
                             "300000000000 train/lr 0.10000000149011612 1700000002.0\n"
                             "3 train/loss 0.75 ", 0), 0u)
        << r.output;
    EXPECT_NE(r.output.find("3 eval/top1 0.9375 "), std::string::npos) << r.output;
  }

  // The same file through TensorBoard's own reader, where Python has it.
  auto probe = testutil::run(testutil::python() + " -c 'import tensorboard'");
  if (probe.exit_code != 0) {
    std::printf("[ info ] cross-check with TensorBoard's reader skipped: %s has no `tensorboard` package "
                "(no Debian package for it; pip install tensorboard to enable)\n",
                testutil::python().c_str());
    return;
  }
  const std::string script =
      "import sys\n"
      "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n"
      "ea = EventAccumulator(sys.argv[1]); ea.Reload()\n"
      "for s in ea.Scalars('train/loss'): print(s.step, s.value)\n";
  testutil::write_file(dir / "read_tb.py", script);
  auto r = testutil::run(testutil::python() + " " + (dir / "read_tb.py").string() + " " + (dir / "run").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("1 2.5\n2 1.25\n3 0.75"), std::string::npos) << r.output;
}

// ---- plots ----------------------------------------------------------------------------------------------

TEST(OpsPlot, PlotScriptDrawsLossThroughputMemoryAndEvents) {
  auto probe = testutil::run(testutil::python() + " -c 'import matplotlib'");
  if (probe.exit_code != 0) {
    std::printf("[ info ] plot check skipped: %s has no matplotlib (scripts/install-deps.sh installs "
                "python3-matplotlib)\n", testutil::python().c_str());
    return;
  }
  TempDir dir;
  {
    std::ofstream f(dir / "metrics.jsonl");
    f << R"({"event": "start", "total_steps": 40})" << "\n";
    for (int i = 1; i <= 40; ++i) {
      const int mb = i < 15 ? 64 : i < 30 ? 32 : 64;
      f << json{{"step", i}, {"loss", 2.0 / i}, {"lr", 0.1}, {"samples_per_s", 100.0 + i}, {"micro_batch", mb},
                {"accum_steps", 128 / mb}, {"mem_peak_bytes", mb * 1000000}, {"mem_limit_bytes", 80000000}}
               .dump()
        << "\n";
      if (i == 15) f << R"({"event": "oom", "step": 15, "kind": "backoff"})" << "\n";
      if (i == 30) f << R"({"event": "probe", "step": 30})" << "\n";
      if (i == 20) f << R"({"event": "checkpoint", "step": 20})" << "\n";
      if (i == 20) f << R"({"event": "eval", "step": 20, "loss": 0.3, "top1": 0.8})" << "\n";
    }
  }
  auto r = testutil::run(testutil::python() + " " + testutil::source_dir() + "/scripts/plot_metrics.py " + dir.str() +
                         " --out " + (dir / "plot.png").string() + " --html " + (dir / "plot.html").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string png = testutil::read_file(dir / "plot.png");
  ASSERT_GT(png.size(), 10000u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  const std::string html = testutil::read_file(dir / "plot.html");
  EXPECT_NE(html.find("data:image/png;base64,"), std::string::npos);
  EXPECT_NE(r.output.find("1 oom"), std::string::npos) << r.output;
  // Bad input names the file.
  r = testutil::run(testutil::python() + " " + testutil::source_dir() + "/scripts/plot_metrics.py " +
                    (dir / "nothing.jsonl").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("nothing.jsonl"), std::string::npos) << r.output;
  // Two runs on one figure: each run's last evaluation printed under its label.
  testutil::fs::create_directories(dir / "b");
  {
    std::ofstream f(dir / "b" / "metrics.jsonl");
    for (int i = 1; i <= 40; ++i) f << json{{"step", i}, {"loss", 2.2 / i}}.dump() << "\n";
    f << R"({"event": "eval", "step": 40, "loss": 0.25})" << "\n";
  }
  const std::string script = testutil::python() + " " + testutil::source_dir() + "/scripts/plot_metrics.py ";
  r = testutil::run(script + dir.str() + " " + (dir / "b").string() + " --labels float32,int8 --smooth 5 --out " +
                    (dir / "compare.png").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(testutil::read_file(dir / "compare.png").substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_NE(r.output.find("float32: 40 steps, eval loss 0.3 at step 20"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("int8: 40 steps, eval loss 0.25 at step 40"), std::string::npos) << r.output;
  r = testutil::run(script + dir.str() + " " + (dir / "b").string() + " --labels one --out " + (dir / "c.png").string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--labels"), std::string::npos) << r.output;
}

}  // namespace test_ops
