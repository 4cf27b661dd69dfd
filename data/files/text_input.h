// The text files a conversion reads (convert-text, data/files/token_h5.h): which files a list of files
// and folders names, their sizes planned before reading, and their bytes streamed once. Shared by the byte
// and the BPE conversions; internal to data/files.
#pragma once

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace data {

struct TokenConversion;
struct TextOptions;

/// convert_text with a BPE tokenizer (data/files/text_tokens.cpp).
TokenConversion convert_text_bpe(const std::vector<std::string>& files_or_dirs, const std::string& out_dir,
                                 double val_fraction, const TextOptions& options);

/// "1 byte", "N bytes".
std::string bytes_text(int64_t n);

/// The files named, and those under the folders named (sorted by path; the fortunes package's `.dat`
/// index files and `.u8` links left out). Throws std::invalid_argument for a missing path or no files.
std::vector<std::string> text_files(const std::vector<std::string>& files_or_dirs);

struct TextInput {
  std::string path;
  int64_t bytes = 0;
  std::optional<std::string> content;  // read already (a file whose size said 0)
};

/// The sizes, taken before reading (see the .cpp).
std::vector<TextInput> plan_text_inputs(const std::vector<std::string>& files);

// Passes the planned bytes of `in` to emit(bytes, n) in pieces of at most buf.size().
template <typename Emit>
void stream_text(const TextInput& in, std::vector<char>& buf, Emit&& emit) {
  const auto piece = static_cast<int64_t>(buf.size());
  if (in.content) {
    for (int64_t at = 0; at < in.bytes; at += piece) emit(in.content->data() + at, std::min<int64_t>(in.bytes - at, piece));
    return;
  }
  std::ifstream file(in.path, std::ios::binary);
  if (!file) throw std::runtime_error("convert-text: cannot read '" + in.path + "'");
  int64_t left = in.bytes;
  while (left > 0) {
    file.read(buf.data(), static_cast<std::streamsize>(std::min<int64_t>(left, piece)));
    const int64_t n = file.gcount();
    if (n == 0) break;
    emit(buf.data(), n);
    left -= n;
  }
  if (file.bad()) throw std::runtime_error("convert-text: reading '" + in.path + "' failed");
  if (left > 0) {
    throw std::runtime_error("convert-text: '" + in.path + "' gave " + bytes_text(in.bytes - left) + ", fewer than the " +
                             bytes_text(in.bytes) + " its size said when the conversion started (did it shrink "
                             "while being read?)");
  }
}


}  // namespace data
