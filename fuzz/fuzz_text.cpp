// Text through GPT-2's pre-tokenizer and convert-text (data/text/pretokenize.h, data/files/token_h5.h),
// differentially: the scanner cuts every input as the pattern does (PCRE2), and convert-text, which cuts
// the text into parts of a few bytes and encodes them on two threads, gives the ids of the whole text
// encoded at once, followed by <|endoftext|>. Any text is valid input: nothing may be refused but a
// piece of over 1 MiB, which a fuzz input cannot hold.
#include "data/files/token_h5.h"
#include "data/text/pretokenize.h"
#include "data/text/tokenizer.h"
#include "fuzz_util.h"

#include <filesystem>
#include <fstream>
#include <memory>

namespace {

namespace fs = std::filesystem;

// A small rank file: the 256 bytes and a few merges, written once next to the input file.
const std::shared_ptr<const data::Tokenizer>& tokenizer() {
  static const std::shared_ptr<const data::Tokenizer> tok = [] {
    const std::string path = fuzz::input_file().path() + ".tiktoken";
    std::ofstream f(path, std::ios::binary);
    static const char* abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    auto b64 = [](const std::string& s) {
      std::string out;
      for (size_t i = 0; i < s.size(); i += 3) {
        uint32_t v = uint8_t(s[i]) << 16;
        if (i + 1 < s.size()) v |= uint8_t(s[i + 1]) << 8;
        if (i + 2 < s.size()) v |= uint8_t(s[i + 2]);
        out += {abc[v >> 18], abc[(v >> 12) & 63], i + 1 < s.size() ? abc[(v >> 6) & 63] : '=', i + 2 < s.size() ? abc[v & 63] : '='};
      }
      return out;
    };
    int rank = 0;
    for (int b = 0; b < 256; ++b) f << b64(std::string(1, char(b))) << ' ' << rank++ << '\n';
    for (const char* t : {"th", "he", "the", " t", " the", "  ", "    ", "\n\n", "in", "ing", "\xE4\xB8", "\xE4\xB8\xAD", "'s", "99"})
      f << b64(t) << ' ' << rank++ << '\n';
    f.close();
    auto loaded = std::make_shared<const data::Tokenizer>(data::Tokenizer::load(path));
    fs::remove(path);
    return loaded;
  }();
  return tok;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string raw(reinterpret_cast<const char*>(data), size);
  const std::string text = data::replace_invalid_utf8(raw);
  static data::Pretokenizer scanner;
  static data::PatternMatcher pattern;
  for (size_t at = 0; at < text.size();) {
    const size_t end = scanner.piece_end(text, at);
    if (end != pattern.piece_end(text, at)) {
      std::fprintf(stderr, "FINDING: at byte %zu the scanner and the pattern cut differently\n", at);
      std::abort();
    }
    at = end;
  }
  if (size == 0) return 0;
  const auto& tok = tokenizer();
  std::vector<int64_t> want;
  for (int32_t id : tok->encode(raw)) want.push_back(id);
  want.push_back(tok->special("<|endoftext|>"));
  const std::string& path = fuzz::input_file().write(data, size);
  const std::string out = path + ".out";
  fuzz::expect_only<fuzz::NeverThrown>("convert_text", [&] {
    data::TextOptions options;
    options.tokenizer = tok;
    options.threads = 2;
    options.part_bytes = 1 + size % 13;
    const auto conv = data::convert_text({path}, out, 0.0, options);
    data::TokenDataset ds(conv.train_path, true);
    std::vector<int64_t> got(ds.size());
    ds.read(0, ds.size(), got.data());
    if (got != want) {
      std::fprintf(stderr, "FINDING: convert-text in parts of %zu bytes gives other ids than the whole text\n", options.part_bytes);
      std::abort();
    }
  });
  std::error_code ec;
  fs::remove_all(out, ec);
  return 0;
}
