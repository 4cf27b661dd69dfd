// The thin executable: parses the command line, builds the config and calls the core.
//
//   trainer [--config FILE] [--set key=value ...] [--run-dir DIR] [--dry-run] [--resume PATH] [--no-resume]
//   trainer convert-idx | convert-text | convert-bin | eval | export | compare | bench ...  (app/cli.cpp)
#include <cxxopts.hpp>
#include <spdlog/spdlog.h>

#include <c10/util/Exception.h>

#include <filesystem>
#include <iostream>

#include "app/cli.h"
#include "common/signals.h"

int main(int argc, char** argv) {
  try {
    return trainer::cli_main(argc, argv);
  } catch (const c10::Error& e) {
    // A TORCH_CHECK's what() appends a C++ backtrace; the user gets its message only.
    std::cerr << "error: " << e.what_without_backtrace() << std::endl;
    return trainer::kExitBadInput;
  } catch (const std::exception& e) {
    // The one line a user sees for bad input; never "terminate called after throwing".
    std::cerr << "error: " << e.what() << std::endl;
    return trainer::kExitBadInput;
  }
}
