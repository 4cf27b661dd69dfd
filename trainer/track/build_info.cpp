#include "trainer/track/build_info.h"

#include <unistd.h>

#include "trainer/track/build_commit.h"

namespace trainer::track {

std::string build_commit() { return TRAINER_GIT_COMMIT; }

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "";
  return name;
}

}  // namespace trainer::track
