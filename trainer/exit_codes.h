// The trainer's exit codes, documented in the README. Kubernetes and nightly jobs decide on them.
#pragma once

namespace trainer {

inline constexpr int kExitOk = 0;
/// Bad input: config, dataset, checkpoint or run folder. One line on stderr names the problem.
inline constexpr int kExitBadInput = 2;
/// Out of memory with every rung of the backoff ladder tried; a checkpoint was saved first.
inline constexpr int kExitOomGaveUp = 3;
/// Training produced non-finite losses or gradients for too many steps in a row.
inline constexpr int kExitNonFinite = 4;
/// Any other failure (a bug, an I/O error while training).
inline constexpr int kExitInternal = 1;

}  // namespace trainer
