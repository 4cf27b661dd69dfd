#include "common/files.h"

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace trainer {
namespace {

// What a file of mode `mode` is, as not_a_regular_file() words it; "" for a regular file.
std::string kind_of(mode_t mode) {
  const char* kind = S_ISREG(mode)    ? nullptr
                     : S_ISFIFO(mode) ? "a named pipe (FIFO)"
                     : S_ISSOCK(mode) ? "a socket"
                     : S_ISCHR(mode)  ? "a character device"
                     : S_ISBLK(mode)  ? "a block device"
                     : S_ISDIR(mode)  ? "a directory"
                                      : "not a file";
  return kind ? std::string("is ") + kind + ", not a regular file" : std::string();
}

}  // namespace

std::string not_a_regular_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return "";
  return kind_of(st.st_mode);
}

void require_regular_file(const std::string& path, const std::string& what) {
  const std::string kind = not_a_regular_file(path);
  if (!kind.empty()) throw std::runtime_error(what + " '" + path + "' " + kind);
}

void write_file_atomically(const std::string& path, const std::string& bytes, const std::string& what) {
  namespace fs = std::filesystem;
  const std::string tmp = path + ".tmp";
  std::error_code ec;
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!f.flush()) {
      fs::remove(tmp, ec);
      throw std::runtime_error(what + ": cannot write " + path);
    }
  }
  fs::rename(tmp, path, ec);
  if (ec) {
    const std::string reason = ec.message();
    fs::remove(tmp, ec);
    throw std::runtime_error(what + ": cannot write " + path + " (" + reason + ")");
  }
}

}  // namespace trainer
