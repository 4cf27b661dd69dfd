// trainer.images HDF5 files (data/files/image_h5.h): ImageH5Dataset throws std::runtime_error for anything it
// does not accept, from disk and in memory; an accepted file serves its first and last samples.
#include "data/files/image_h5.h"
#include "fuzz_util.h"

#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = fuzz::input_file().write(data, size);
  for (bool in_memory : {false, true}) {
    fuzz::expect_only<std::runtime_error>("ImageH5Dataset", [&] {
      data::ImageH5Dataset ds(path, in_memory);
      if (ds.size() == 0) return;
      const std::vector<int64_t> indices = {ds.size() - 1, 0};
      std::vector<uint8_t> images(indices.size() * static_cast<size_t>(ds.sample_bytes()));
      std::vector<int64_t> labels(indices.size());
      ds.read(indices, images.data(), labels.data());
      for (int64_t l : labels) {
        if (l < 0 || l >= ds.meta().num_classes) std::abort();
      }
    });
  }
  return 0;
}
