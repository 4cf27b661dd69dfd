// Small helpers shared by the test files: temporary folders, running a command and capturing its
// output, and the Python reference interpreter.
#pragma once

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <sys/wait.h>

namespace testutil {

namespace fs = std::filesystem;

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

/// Path of the trainer executable under test.
inline std::string trainer_bin() { return TRAINER_BIN; }
/// Root of the source tree (configs/, tests/ref/).
inline std::string source_dir() { return TRAINER_SOURCE_DIR; }
/// The Python interpreter with Debian's torch and torchvision.
inline std::string python() { return TRAINER_PYTHON; }

inline std::string read_file(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

inline void write_file(const fs::path& p, const std::string& text) {
  std::ofstream f(p);
  f << text;
}

}  // namespace testutil
