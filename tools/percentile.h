// The percentile of a list of numbers, as numpy computes it: what `trainer compare` and `trainer bench`
// (tools/bench/bench.h) summarize their step times with.
#pragma once

#include <vector>

namespace trainer {

/// The q-th percentile (q in [0, 100]) of `values`, interpolating linearly between the two nearest
/// order statistics (numpy.percentile's default): rank = q/100 * (n-1). Throws std::invalid_argument
/// for no values or q outside [0, 100].
double percentile(std::vector<double> values, double q);

/// The median (the 50th percentile), or 0 for no values: a summary that a run with no steps still has.
double median_of(const std::vector<double>& values);

}  // namespace trainer
