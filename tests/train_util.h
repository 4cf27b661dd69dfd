// Helpers for tests that run the trainer executable: a job description, metrics.jsonl parsing and the
// final weights of a run (through `trainer export`).
#pragma once

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "test_util.h"
#include "trainer/checkpoint/state_dict.h"
#include "trainer/config/config.h"

namespace testutil {

inline std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

/// Step lines (no "event"), keeping the last line per step (a resumed run repeats the steps after its
/// checkpoint), in step order.
inline std::vector<nlohmann::json> step_lines(const std::string& run_dir) {
  std::map<int64_t, nlohmann::json> by_step;
  for (auto& l : read_jsonl(run_dir + "/metrics.jsonl"))
    if (!l.contains("event")) by_step[l["step"].get<int64_t>()] = l;
  std::vector<nlohmann::json> out;
  for (auto& [s, l] : by_step) out.push_back(l);
  return out;
}

inline std::vector<nlohmann::json> events(const std::string& run_dir, const std::string& kind) {
  std::vector<nlohmann::json> out;
  for (auto& l : read_jsonl(run_dir + "/metrics.jsonl"))
    if (l.value("event", "") == kind) out.push_back(l);
  return out;
}

/// A small byte-token stream from 400 lines of text (`convert-text` into dir/tokens: train.h5, val.h5);
/// returns the folder.
inline std::string fox_tokens(const TempDir& dir) {
  const auto text = dir / "text.txt";
  std::string s;
  for (int i = 0; i < 400; ++i) s += "The quick brown fox jumps over the lazy dog " + std::to_string(i) + ".\n";
  write_file(text, s);
  const auto out = (dir / "tokens").string();
  auto r = run(trainer_bin() + " convert-text --src " + text.string() + " --out " + out);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return out;
}

/// The defaults with `sets` applied as --set would apply them, then validated (no file: the built-in job
/// would add its own keys). Throws what the config's edge throws for a bad value.
inline trainer::Config config_from_sets(const std::vector<std::string>& sets) {
  trainer::Config c;
  for (const auto& s : sets) trainer::apply_override(c, s);
  trainer::validate(c);
  return c;
}

/// `trainer` with `args` and the run folder; returns the command line.
inline std::string trainer_cmd(const std::string& run_dir, const std::string& args) {
  return trainer_bin() + " --run-dir " + run_dir + " " + args;
}

/// The final weights of a run, by name.
inline std::map<std::string, torch::Tensor> final_weights(const std::string& run_dir) {
  const std::string out = run_dir + "/exported.pt";
  auto r = run(trainer_bin() + " export --run-dir " + run_dir + " --out " + out);
  if (r.exit_code != 0) throw std::runtime_error("export failed: " + r.output);
  std::map<std::string, torch::Tensor> m;
  for (auto& [k, v] : trainer::read_tensors(out)) m[k] = v;
  return m;
}

/// plain_cnn (no batch statistics) on synthetic 1x16x16, 3 steps of 12 samples, no augmentation, one
/// thread: a job whose final weights two ways of running it can be compared on (micro-batches, activation
/// checkpointing, mixing). `extra`: more --set arguments.
inline std::string exact_job(const std::string& extra) {
  return "--set model.name=plain_cnn --set data.kind=synthetic --set data.shape=[1,16,16]"
         " --set data.synthetic_size=120 --set data.test= --set data.crop_padding=0 --set data.hflip=false"
         " --set train.global_batch=12 --set train.epochs=0 --set train.steps=3 --set optim.lr=0.05"
         " --set schedule.warmup_steps=0 --set schedule.name=constant"
         " --set checkpoint.every_seconds=0 --set seed=3"
         " --set train.threads=1 --set data.workers=1 " +
         extra;
}

/// Trains `args` in dir/name (a test failure if it does not exit 0) and returns its final weights.
inline std::map<std::string, torch::Tensor> run_and_export(const TempDir& dir, const std::string& name,
                                                           const std::string& args) {
  auto run_dir = (dir / name).string();
  auto r = run(trainer_cmd(run_dir, args));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return final_weights(run_dir);
}

/// Largest |a - b| over all tensors (both maps must have the same keys).
inline double max_abs_diff(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  double worst = 0;
  for (const auto& [k, t] : a) {
    auto it = b.find(k);
    if (it == b.end()) return INFINITY;
    if (!t.is_floating_point()) {
      if (!t.equal(it->second)) return INFINITY;
      continue;
    }
    worst = std::max(worst, (t.to(torch::kDouble) - it->second.to(torch::kDouble)).abs().max().item<double>());
  }
  return a.size() == b.size() ? worst : INFINITY;
}

inline bool bitwise_equal(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, t] : a) {
    auto it = b.find(k);
    if (it == b.end() || !t.equal(it->second)) return false;
  }
  return true;
}

/// Tensors' bytes one after another (each made contiguous), for a Python reference to read with torch.frombuffer.
inline void write_raw(const fs::path& p, const std::vector<torch::Tensor>& ts) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  for (const auto& t : ts) {
    const auto c = t.detach().contiguous();
    f.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
  }
}

/// A file of raw values of `dtype` (what a Python reference wrote with numpy's tobytes), as one 1-d tensor.
inline torch::Tensor read_raw(const fs::path& p, torch::ScalarType dtype) {
  auto bytes = read_bytes(p);
  const int64_t size = static_cast<int64_t>(torch::elementSize(dtype));
  return torch::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size()) / size}, dtype).clone();
}

}  // namespace testutil

#include <chrono>
#include <csignal>
#include <thread>
#include <unistd.h>

namespace testutil {

/// Starts `cmd` (through /bin/sh, with `exec` so the pid is the program's) with output to `log`;
/// returns the pid.
inline pid_t spawn(const std::string& cmd, const std::string& log) {
  pid_t pid = fork();
  if (pid == 0) {
    std::string full = "exec " + cmd + " > " + log + " 2>&1";
    execl("/bin/sh", "sh", "-c", full.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

/// Waits for `pid`; returns its exit code, or 128 + signal.
inline int wait_exit(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + WTERMSIG(status);
}

/// Polls metrics.jsonl until `pred(lines)` holds or `timeout_s` passes; returns whether it held.
template <typename Pred>
bool wait_for_metrics(const std::string& run_dir, Pred pred, double timeout_s = 120) {
  auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < timeout_s) {
    std::vector<nlohmann::json> lines;
    try {
      lines = read_jsonl(run_dir + "/metrics.jsonl");
    } catch (...) {  // a line being written
    }
    if (pred(lines)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

/// The highest "step" among step lines.
inline int64_t last_step(const std::vector<nlohmann::json>& lines) {
  int64_t s = 0;
  for (const auto& l : lines)
    if (!l.contains("event")) s = std::max<int64_t>(s, l["step"].get<int64_t>());
  return s;
}

}  // namespace testutil
