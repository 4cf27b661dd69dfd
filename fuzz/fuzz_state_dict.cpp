// torch.save archives (trainer/state_dict.h): tensors_from_bytes throws std::runtime_error for anything
// outside the pickle subset torch.save writes for a dict of tensors.
#include "trainer/checkpoint/state_dict.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  fuzz::expect_only<std::runtime_error>("tensors_from_bytes", [&] {
    for (const auto& [name, t] : trainer::tensors_from_bytes(bytes, "<fuzz>")) {
      if (!t.defined()) std::abort();
      (void)t.sum();  // touches every element: the storage must really hold the tensor
    }
  });
  return 0;
}
