// safetensors files (trainer/checkpoint/safetensors.h): safetensors_from_bytes and read_safetensors (the
// memory-mapped path, on the input as a file) throw std::runtime_error for anything the format does not
// allow. What they accept must hold its tensors (`sum()` touches every element) and must come back the
// same through the writer: the same names, metadata, dtypes, shapes and bytes.
#include "trainer/checkpoint/safetensors.h"
#include "fuzz_util.h"

#include <cstring>

namespace {

void check(const trainer::SafetensorsContents& c) {
  for (const auto& [name, t] : c.tensors) {
    if (!t.defined()) std::abort();
    (void)t.sum();
  }
  const auto again = trainer::safetensors_from_bytes(trainer::safetensors_bytes(c.tensors, c.metadata), "<written>");
  if (again.metadata != c.metadata || again.tensors.size() != c.tensors.size()) std::abort();
  for (const auto& [name, t] : c.tensors) {
    bool found = false;
    for (const auto& [n2, t2] : again.tensors) {
      if (n2 != name) continue;
      found = true;
      if (t2.scalar_type() != t.scalar_type() || t2.sizes() != t.sizes() || t2.nbytes() != t.nbytes() ||
          (t.nbytes() > 0 && std::memcmp(t2.data_ptr(), t.data_ptr(), t.nbytes()) != 0)) {
        std::fprintf(stderr, "FINDING: tensor '%s' does not come back the same through the writer\n", name.c_str());
        std::abort();
      }
    }
    if (!found) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  fuzz::expect_only<std::runtime_error>("safetensors_from_bytes", [&] { check(trainer::safetensors_from_bytes(bytes, "<fuzz>")); });
  const std::string& path = fuzz::input_file().write(data, size);
  fuzz::expect_only<std::runtime_error>("read_safetensors", [&] { check(trainer::read_safetensors(path)); });
  return 0;
}
