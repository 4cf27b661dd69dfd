// The command line: the default action trains; subcommands convert data and export weights.
#pragma once

namespace trainer {

/// Runs the command line; returns the exit code. Throws std::exception with a one-line message for bad
/// input (the executable prints it and exits with kExitBadInput).
int cli_main(int argc, char** argv);

}  // namespace trainer
