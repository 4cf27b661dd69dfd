// The thin executable: parses the command line, builds the config and calls the core.
//
//   trainer [--config FILE] [--set key=value ...] [--run-dir DIR] [--wait-for-run-dir S] [--dry-run] [--resume PATH] [--no-resume]
//   trainer convert-idx | convert-text | convert-bin | eval | sample | export | compare | bench ...  (app/cli.cpp)
#include <cxxopts.hpp>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <iostream>

#include "app/cli.h"
#include "common/log.h"
#include "common/signals.h"
#include "data/files/h5_check.h"

int main(int argc, char** argv) {
  // First: as the child that checks an HDF5 file (data/files/h5_check.h) this process does nothing else; as the
  // trainer it turns that check on before any command can open a user's file.
  if (const auto code = data::serve_h5_check(argc, argv)) return *code;
  try {
    return trainer::cli_main(argc, argv);
  } catch (const std::exception& e) {
    // The one line a user sees for bad input; never "terminate called after throwing", never a
    // LibTorch backtrace (a TORCH_CHECK's what() appends one; error_message() drops it, also when
    // another exception's message wraps it, and joins the lines).
    std::cerr << "error: " << trainer::error_message(e) << std::endl;
    return trainer::kExitBadInput;
  }
}
