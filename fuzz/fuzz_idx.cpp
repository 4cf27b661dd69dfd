// IDX files (data/files/idx.h), gzipped or not: read_idx_images and read_idx_labels throw std::runtime_error
// for anything they do not accept. An accepted file must be exactly its header's size.
#include "data/files/idx.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = fuzz::input_file().write(data, size);
  fuzz::expect_only<std::runtime_error>("read_idx_images", [&] {
    const auto images = data::read_idx_images(path);
    if (images.dim() != 4 || images.size(1) != 1) std::abort();
  });
  fuzz::expect_only<std::runtime_error>("read_idx_labels", [&] {
    const auto labels = data::read_idx_labels(path);
    if (labels.dim() != 1) std::abort();
  });
  return 0;
}
