// Checkpoint manifests (trainer/checkpoint.h): CheckpointStore::load of a checkpoint folder whose
// manifest.json is the input throws std::runtime_error for anything it does not accept. The folder also
// holds two files (model.pt, state.json) that a manifest may describe, rightly or wrongly; an accepted
// checkpoint holds exactly the bytes of the files its manifest lists.
#include "trainer/checkpoint/store.h"
#include "fuzz_util.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace {

namespace fs = std::filesystem;

const char* kModel = "model bytes\n";
const char* kState = "{\"step\": 1}";

// One folder per process: <tmp>/trainer-fuzz-manifest-<pid>/step-00000001, removed at exit.
struct Folder {
  fs::path root, dir;
  Folder() {
    root = fs::temp_directory_path() / ("trainer-fuzz-manifest-" + std::to_string(::getpid()));
    dir = root / "step-00000001";
    fs::create_directories(dir);
    std::ofstream(dir / "model.pt", std::ios::binary) << kModel;
    std::ofstream(dir / "state.json", std::ios::binary) << kState;
  }
  ~Folder() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Folder folder;
  {
    std::ofstream m(folder.dir / "manifest.json", std::ios::binary | std::ios::trunc);
    m.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  fuzz::expect_only<std::runtime_error>("CheckpointStore::load", [&] {
    const trainer::LoadedCheckpoint ck = trainer::CheckpointStore::load(folder.dir.string());
    if (ck.step != 1) std::abort();
    for (const auto& [name, bytes] : ck.files) {
      if ((name == "model.pt" && bytes != kModel) || (name == "state.json" && bytes != kState)) std::abort();
    }
  });
  return 0;
}
