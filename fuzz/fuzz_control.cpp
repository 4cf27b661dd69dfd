// control.yaml (trainer/resources.h): ControlFile::poll never throws; a malformed file is a warning, and
// a good one yields a memory.limit that validate_memory_limit_spec accepts.
#include "trainer/memory/resources.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = fuzz::input_file().write(data, size);
  trainer::ControlFile control(path);
  fuzz::expect_only<fuzz::NeverThrown>("ControlFile::poll", [&] {
    const trainer::ControlPoll poll = control.poll();
    if (poll.update && !poll.warning.empty()) std::abort();
    if (poll.update && poll.update->memory_limit) trainer::validate_memory_limit_spec(*poll.update->memory_limit);
  });
  return 0;
}
