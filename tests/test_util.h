// Small helpers shared by the test files: temporary folders, running a command and capturing its
// output, and the Python reference interpreter.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <vector>
#include <sys/wait.h>

namespace testutil {

namespace fs = std::filesystem;

/// What f() threw, or "(no exception)".
template <typename F>
std::string error_text(F f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

/// Seconds on the steady clock since t.
inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

/// A fresh folder under the system temp dir, removed when the object goes out of scope.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag = "trainer_test") {
    std::random_device rd;
    path = fs::temp_directory_path() / (tag + "_" + std::to_string(rd()) + std::to_string(rd()));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    if (!std::getenv("TRAINER_KEEP_TEST_DIRS")) fs::remove_all(path, ec);
  }
  std::string str() const { return path.string(); }
  fs::path operator/(const std::string& p) const { return path / p; }
};

/// Result of running a shell command: its exit code (or 128+signal) and stdout+stderr together.
struct CommandResult {
  int exit_code = -1;
  std::string output;
};

/// Runs `cmd` through /bin/sh with stderr merged into stdout.
inline CommandResult run(const std::string& cmd) {
  CommandResult r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  int status = pclose(p);
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  else if (WIFSIGNALED(status)) r.exit_code = 128 + WTERMSIG(status);
  return r;
}

/// `fallback` (the path compiled in), unless the environment variable `name` is set: the GPU bundle
/// (scripts/bundle-gpu.sh) runs the tests on a host where the build folder does not exist.
inline std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : fallback;
}
/// Path of the trainer executable under test (TRAINER_TEST_BIN overrides).
inline std::string trainer_bin() { return env_or("TRAINER_TEST_BIN", TRAINER_BIN); }
/// Root of the source tree: configs/, tests/ref/ (TRAINER_TEST_SOURCE_DIR overrides).
inline std::string source_dir() { return env_or("TRAINER_TEST_SOURCE_DIR", TRAINER_SOURCE_DIR); }
/// The reference Python interpreter, with torch and torchvision of the LibTorch under test: Debian's
/// for 1.13, the wheel's virtual environment for 2.11 (TRAINER_TEST_PYTHON overrides).
inline std::string python() { return env_or("TRAINER_TEST_PYTHON", TRAINER_PYTHON); }

/// "" when `python() SCRIPT modules` exits 0 (the reference Python has every module the script needs),
/// else the first line it printed, which names the module it lacks. Asked once per script.
inline std::string missing_module_of(const std::string& script) {
  static std::mutex mutex;
  static std::map<std::string, std::string> answers;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = answers.find(script); it != answers.end()) return it->second;
  const auto r = run(python() + " " + script + " modules");
  std::string missing;
  if (r.exit_code != 0) missing = r.output.empty() ? std::string("(the script failed)") : r.output.substr(0, r.output.find('\n'));
  return answers[script] = missing;
}

/// The comma-separated integers after "KEY " on a line of a reference script's output ("tokens 3,1,4");
/// empty when the key is not there.
inline std::vector<int64_t> ids_after(const std::string& output, const std::string& key) {
  const auto at = output.find(key + " ");
  if (at == std::string::npos) return {};
  std::stringstream ss(output.substr(at + key.size() + 1, output.find('\n', at) - at - key.size() - 1));
  std::vector<int64_t> ids;
  for (std::string item; std::getline(ss, item, ',');) ids.push_back(std::stoll(item));
  return ids;
}

inline std::string read_file(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

/// Writes `text` to `p` as it is (std::string holds any bytes), replacing what was there.
inline void write_file(const fs::path& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << text;
}

/// Writes `bytes` to `p` exactly (creating its folder); returns the path.
inline std::string write_bytes(const fs::path& p, const std::vector<uint8_t>& bytes) {
  if (p.has_parent_path()) fs::create_directories(p.parent_path());
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  return p.string();
}

inline std::vector<uint8_t> read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

constexpr int64_t kKiB = 1024;
constexpr int64_t kMiB = 1024 * 1024;

/// The real Fashion-MNIST, gzipped IDX files (Debian's dataset-fashion-mnist).
constexpr const char* kFashionDir = "/usr/share/datasets/fashion-mnist";

/// `chattr +i` on `path` while the object lives: a real EPERM for every change to it, also for root
/// (chmod does not stop root). ok() is false where the file system or the privileges do not allow it.
class Immutable {
 public:
  explicit Immutable(const fs::path& path) : path_(path) {
    ok_ = std::system(("chattr +i '" + path_.string() + "' 2>/dev/null").c_str()) == 0;
  }
  ~Immutable() { release(); }
  Immutable(const Immutable&) = delete;
  Immutable& operator=(const Immutable&) = delete;
  bool ok() const { return ok_; }
  void release() {
    if (ok_) (void)!std::system(("chattr -i '" + path_.string() + "'").c_str());
    ok_ = false;
  }

 private:
  fs::path path_;
  bool ok_ = false;
};

/// A tmpfs of `bytes` mounted at `path` (created if needed) while the object lives: a real full disk
/// (ENOSPC). ok() is false where mounting is not allowed (not root, no CAP_SYS_ADMIN).
class SmallDisk {
 public:
  SmallDisk(const fs::path& path, int64_t bytes) : path_(path) {
    fs::create_directories(path_);
    ok_ = std::system(("mount -t tmpfs -o size=" + std::to_string(bytes) + " tmpfs '" + path_.string() +
                       "' 2>/dev/null").c_str()) == 0;
  }
  ~SmallDisk() {
    if (ok_) (void)!std::system(("umount -l '" + path_.string() + "'").c_str());
  }
  SmallDisk(const SmallDisk&) = delete;
  SmallDisk& operator=(const SmallDisk&) = delete;
  bool ok() const { return ok_; }

 private:
  fs::path path_;
  bool ok_ = false;
};

}  // namespace testutil
