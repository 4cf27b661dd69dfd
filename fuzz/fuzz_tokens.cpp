// trainer.tokens HDF5 files (data/files/token_h5.h): TokenDataset throws std::runtime_error for anything it does
// not accept, from disk and in memory; an accepted file serves its first and last tokens, each in
// [0, vocab_size) or refused with std::runtime_error.
#include "data/files/token_h5.h"
#include "fuzz_util.h"

#include <algorithm>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = fuzz::input_file().write(data, size);
  for (bool in_memory : {false, true}) {
    fuzz::expect_only<std::runtime_error>("TokenDataset", [&] {
      data::TokenDataset ds(path, in_memory);
      const int64_t n = std::min<int64_t>(ds.size(), 64);
      std::vector<int64_t> out(static_cast<size_t>(n));
      ds.read(0, n, out.data());
      ds.read(ds.size() - n, n, out.data());
      for (int64_t t : out) {
        if (t < 0 || t >= ds.vocab_size()) std::abort();
      }
    });
  }
  return 0;
}
