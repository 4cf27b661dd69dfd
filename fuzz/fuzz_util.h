// What the fuzz targets share: the input as a file (the readers take paths), and the rule that decides
// what counts as a finding. A reader may refuse an input only with the exception type its header
// documents for bad input; anything else (another exception, an abort, a sanitizer report, a hang, a
// huge allocation) is a finding (docs/FUZZING.md).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>
#include <type_traits>

namespace fuzz {

/// The fuzz input as a file, for readers that open a path (gzopen, H5Fopen, YAML::LoadFile): one file per
/// process in /dev/shm (memory; the system's temp folder where there is none), rewritten for each input
/// and removed at exit. A memfd's /proc/self/fd/N path would be cheaper, but HDF5 resolves a file's real
/// path and refuses "/memfd:... (deleted)".
class InputFile {
 public:
  InputFile() {
    std::error_code ec;
    const std::filesystem::path dir = std::filesystem::is_directory("/dev/shm", ec) ? std::filesystem::path("/dev/shm")
                                                                                    : std::filesystem::temp_directory_path();
    path_ = (dir / ("trainer-fuzz-" + std::to_string(::getpid()))).string();
  }
  ~InputFile() { ::unlink(path_.c_str()); }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  /// Replaces the file's contents with the input; returns its path.
  const std::string& write(const uint8_t* data, size_t size) {
    FILE* f = std::fopen(path_.c_str(), "wb");
    if (!f || std::fwrite(data, 1, size, f) != size || std::fclose(f) != 0) {
      std::perror(path_.c_str());
      std::abort();
    }
    return path_;
  }
  /// The file's path (other files may be put beside it, under this name and a suffix).
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

/// The one InputFile of this process.
inline InputFile& input_file() {
  static InputFile file;
  return file;
}

/// For a reader that documents no exception at all: expect_only<NeverThrown>.
struct NeverThrown {};

/// Runs `f`; an exception of type Documented (the reader's documented "bad input" error) is fine, any
/// other exception is reported on stderr and aborts, which libFuzzer records as a crash.
/// FUZZ_VERBOSE=1 in the environment prints the documented ones too.
template <typename Documented, typename F>
void expect_only(const char* what, F&& f) {
  try {
    f();
  } catch (const Documented& e) {
    if constexpr (std::is_base_of_v<std::exception, Documented>) {
      if (std::getenv("FUZZ_VERBOSE")) std::fprintf(stderr, "refused by %s: %s\n", what, e.what());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FINDING: %s threw an undocumented exception: %s\n", what, e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "FINDING: %s threw a non-std exception\n", what);
    std::abort();
  }
}

}  // namespace fuzz
