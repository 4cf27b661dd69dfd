// The thin executable: parses the command line, builds the config and calls the core.
//
//   trainer [--config FILE] [--set key=value ...] [--run-dir DIR] [--dry-run] [--resume PATH] [--no-resume]
//   trainer convert-idx --src DIR --out DIR
//   trainer export --run-dir DIR --out PATH
#include <cxxopts.hpp>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <iostream>

#include "app/cli.h"
#include "common/log.h"
#include "common/signals.h"

int main(int argc, char** argv) {
  try {
    return trainer::cli_main(argc, argv);
  } catch (const std::exception& e) {
    // The one line a user sees for bad input; never "terminate called after throwing".
    std::cerr << "error: " << trainer::one_line(e) << std::endl;
    return trainer::kExitBadInput;
  }
}
