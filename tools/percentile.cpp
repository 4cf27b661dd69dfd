#include "tools/percentile.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace trainer {

double percentile(std::vector<double> values, double q) {
  if (values.empty()) throw std::invalid_argument("percentile: no values");
  if (!(q >= 0 && q <= 100)) throw std::invalid_argument("percentile: q must lie in [0, 100], got " + std::to_string(q));
  std::sort(values.begin(), values.end());
  const double rank = q / 100.0 * static_cast<double>(values.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, values.size() - 1);
  return values[lo] + (rank - static_cast<double>(lo)) * (values[hi] - values[lo]);
}

double median_of(const std::vector<double>& values) { return values.empty() ? 0.0 : percentile(values, 50); }

}  // namespace trainer
