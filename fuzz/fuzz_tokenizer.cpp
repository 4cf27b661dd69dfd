// Tokenizer files (data/text/tokenizer.h): a tiktoken rank file or a Hugging Face tokenizer.json.
// Tokenizer::load throws std::runtime_error for anything it does not accept. A tokenizer it accepts
// encodes any text into ids of its vocabulary, and decoding them gives back the text (after the
// replacement of invalid UTF-8, and the space a ByteLevel add_prefix_space puts first).
#include "data/text/tokenizer.h"
#include "fuzz_util.h"

#include <algorithm>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = fuzz::input_file().write(data, size);
  fuzz::expect_only<std::runtime_error>("Tokenizer::load", [&] {
    const auto tok = data::Tokenizer::load(path);
    // The input's own bytes as text: its tokens, pieces and odd bytes.
    for (const std::string text : {std::string(reinterpret_cast<const char*>(data), std::min<size_t>(size, 512)),
                                   std::string("Hello world, it's 2024!  \n\n\xE4\xB8\xAD\xE6\x96\x87 \xF0\x9F\x98\x80\xFF")}) {
      const auto ids = tok.encode(text);
      for (int32_t id : ids) {
        if (id < 0 || id >= tok.vocab_size()) {
          std::fprintf(stderr, "FINDING: id %d outside the vocabulary of %lld\n", id, static_cast<long long>(tok.vocab_size()));
          std::abort();
        }
      }
      std::string want = data::replace_invalid_utf8(text);
      if (tok.adds_prefix_space() && !want.empty() && want[0] != ' ') want.insert(want.begin(), ' ');
      if (tok.decode(ids) != want) {
        std::fprintf(stderr, "FINDING: decode(encode(text)) is not the text\n");
        std::abort();
      }
    }
  });
  return 0;
}
