#include "data/files/text_input.h"

#include "common/files.h"

#include <filesystem>
#include <iterator>

namespace data {
namespace {

namespace fs = std::filesystem;

bool skipped_in_directory(const fs::path& p) { return p.extension() == ".dat" || p.extension() == ".u8"; }

}  // namespace

std::string bytes_text(int64_t n) { return std::to_string(n) + (n == 1 ? " byte" : " bytes"); }

// The files named, and those under the folders named (sorted; skipped_in_directory() leaves some out).
std::vector<std::string> text_files(const std::vector<std::string>& files_or_dirs) {
  std::vector<std::string> files;
  for (const auto& entry : files_or_dirs) {
    const fs::path p(entry);
    std::error_code ec;
    if (fs::is_directory(p, ec)) {
      std::vector<std::string> found;
      for (const auto& e : fs::recursive_directory_iterator(p)) {
        if (e.is_regular_file() && !skipped_in_directory(e.path())) found.push_back(e.path().string());
      }
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else if (fs::is_regular_file(p, ec)) {
      files.push_back(entry);
    } else if (const auto kind = trainer::not_a_regular_file(entry); !kind.empty()) {
      throw std::invalid_argument("convert-text: '" + entry + "' " + kind + "; give text files or folders");
    } else {
      throw std::invalid_argument("convert-text: '" + entry + "' is neither a file nor a directory");
    }
  }
  if (files.empty()) throw std::invalid_argument("convert-text: no text files found in the given paths");
  return files;
}


// The sizes are planned before reading, so the split point is known and the bytes stream through once.
// A file whose size says 0 (procfs, sysfs) may hold bytes all the same: it is read to its end now and
// kept in memory (such files are small). Every other file gives the bytes its size promised: one that
// grows while being read is cut there, one that shrinks is an error (stream_text).
std::vector<TextInput> plan_text_inputs(const std::vector<std::string>& files) {
  std::vector<TextInput> inputs;
  for (const auto& f : files) {
    std::error_code ec;
    const auto size = fs::file_size(f, ec);
    if (ec) throw std::runtime_error("convert-text: cannot read the size of '" + f + "': " + ec.message());
    TextInput in{f, static_cast<int64_t>(size), std::nullopt};
    if (size == 0) {
      std::ifstream file(f, std::ios::binary);
      in.content = std::string(std::istreambuf_iterator<char>(file), {});
      if (!file.is_open() || file.bad()) throw std::runtime_error("convert-text: cannot read '" + f + "'");
      in.bytes = static_cast<int64_t>(in.content->size());
    }
    inputs.push_back(std::move(in));
  }
  return inputs;
}

}  // namespace data
