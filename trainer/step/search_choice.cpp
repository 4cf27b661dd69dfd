#include "trainer/step/search_choice.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>

#include "trainer/memory/oom.h"

namespace trainer {

namespace {

// Seconds as a person reads them: "150.0 µs" below a millisecond, "12.0 ms" below a second, "3.40 s" above.
std::string secs_text(double s) {
  char buf[32];
  if (s < 1e-3) std::snprintf(buf, sizeof(buf), "%.1f µs", s * 1e6);
  else if (s < 1.0) std::snprintf(buf, sizeof(buf), "%.1f ms", s * 1e3);
  else std::snprintf(buf, sizeof(buf), "%.2f s", s);
  return buf;
}

std::string rate_text(double samples_per_s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", samples_per_s);
  return buf;
}

}  // namespace

PassCost PassCost::through(int64_t m1, double s1, int64_t m2, double s2) {
  if (m1 < 1 || m2 < 1 || m1 == m2)
    throw std::invalid_argument("PassCost::through: need two distinct sizes >= 1, got " + std::to_string(m1) +
                                " and " + std::to_string(m2));
  if (m1 > m2) {
    std::swap(m1, m2);
    std::swap(s1, s2);
  }
  PassCost c;
  c.per_sample_s = std::max(0.0, (s2 - s1) / static_cast<double>(m2 - m1));
  c.fixed_s = s2 - c.per_sample_s * static_cast<double>(m2);
  if (c.fixed_s < 0) {  // all of the larger pass's time per sample
    c.fixed_s = 0;
    c.per_sample_s = std::max(0.0, s2) / static_cast<double>(m2);
  }
  return c;
}

nlohmann::json PassCost::to_json() const { return {{"fixed_s", fixed_s}, {"per_sample_s", per_sample_s}}; }

PassTimer::PassTimer(Clock clock, std::function<void()> sync) : clock_(std::move(clock)), sync_(std::move(sync)) {
  if (!clock_) throw std::invalid_argument("PassTimer: a clock is required");
}

PassTimer PassTimer::steady(std::function<void()> sync) {
  return PassTimer(
      [] { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); },
      std::move(sync));
}

double PassTimer::time(const std::function<void()>& pass) const {
  if (sync_) sync_();
  const double t0 = clock_();
  pass();
  if (sync_) sync_();
  return clock_() - t0;
}

double PassTimer::fastest(const std::function<void()>& pass, double min_total_s, int64_t max_repeats) const {
  double best = time(pass), total = best;
  for (int64_t n = 1; n < max_repeats && total < min_total_s; ++n) {
    const double s = time(pass);
    best = std::min(best, s);
    total += s;
  }
  return best;
}

std::vector<int64_t> probe_pass_sizes(int64_t m, int64_t batch) {
  std::vector<int64_t> sizes;
  for (int64_t at = 0; at < std::min<int64_t>(2 * m, batch); at += m) sizes.push_back(std::min<int64_t>(m, batch - at));
  return sizes;
}

double projected_doubling_s(const PassCost& cost, int64_t lo, int64_t hi, int64_t largest, int64_t batch) {
  if (lo < 1 || hi < lo || batch < hi)
    throw std::invalid_argument("projected_doubling_s: need 1 <= lo <= hi <= batch, got " + std::to_string(lo) + ", " +
                                std::to_string(hi) + ", " + std::to_string(batch));
  double total = 0;
  auto fits = [&](int64_t m) {
    if (m != lo)
      for (int64_t n : probe_pass_sizes(m, batch)) total += cost.at(n);
    return m <= largest;
  };
  find_max_micro_batch(fits, lo, hi);
  return total;
}

nlohmann::json SearchChoice::to_json() const {
  return {{"method", mode_name(method)}, {"timed", timed},         {"projected_s", projected_s},
          {"budget_s", budget_s},      {"cost", cost.to_json()}, {"predicted", predicted},
          {"reason", reason}};
}

SearchChoice choose_search(const PassCost& cost, int64_t lo, int64_t second, bool second_fits, int64_t hi,
                           int64_t predicted, int64_t batch, double budget_s) {
  if (lo < 1 || second <= lo || hi < second || batch < hi)
    throw std::invalid_argument("choose_search: need 1 <= lo < second <= hi <= batch, got " + std::to_string(lo) + ", " +
                                std::to_string(second) + ", " + std::to_string(hi) + ", " + std::to_string(batch));
  SearchChoice c;
  c.timed = true;
  c.cost = cost;
  c.budget_s = budget_s;
  // Doubling goes on from the second probe if it fitted, else it searches below it from the floor.
  const int64_t from = second_fits ? second : lo, to = second_fits ? hi : second - 1;
  c.predicted = std::clamp(predicted, from, to);
  c.projected_s = projected_doubling_s(cost, from, to, c.predicted, batch);
  c.method = c.projected_s <= budget_s ? AutoSearch::kDoubling : AutoSearch::kCurve;
  c.reason = mode_name(c.method) + ": a pass costs " + secs_text(cost.fixed_s) + " + " + secs_text(cost.per_sample_s) +
             " a sample (warm passes at " + std::to_string(lo) + " and " + std::to_string(second) +
             "), so doubling and bisection from " + std::to_string(from) + " to the predicted " +
             std::to_string(c.predicted) + " would take " + secs_text(c.projected_s) +
             (c.method == AutoSearch::kDoubling ? ", within " : ", over ") + "the " + secs_text(budget_s) + " budget";
  return c;
}

SearchChoice untimed_search_choice() {
  SearchChoice c;
  c.reason = "curve: the first probes were found before the restart and carry no timing";
  return c;
}

nlohmann::json SpeedChoice::to_json() const {
  nlohmann::json t = nlohmann::json::array();
  for (const auto& p : table)
    t.push_back({{"micro_batch", p.micro_batch}, {"fits", p.fits}, {"samples_per_s", p.samples_per_s}});
  return {{"micro_batch", micro_batch}, {"largest", largest}, {"margin", kSpeedMargin}, {"table", t}, {"reason", reason}};
}

std::vector<int64_t> speed_candidates(int64_t largest, int64_t floor) {
  std::vector<int64_t> out;
  for (int64_t m = largest; m >= std::max<int64_t>(1, floor) && static_cast<int64_t>(out.size()) < kSpeedRungs;
       m = (m + 1) / 2) {
    if (!out.empty() && out.back() == m) break;  // 1 halves to 1
    out.push_back(m);
  }
  return out;
}

std::vector<int64_t> speed_sizes_within(const PassCost& cost, const std::vector<int64_t>& candidates,
                                        const std::set<int64_t>& warm, double budget_s) {
  std::vector<int64_t> out;
  double total = 0;
  for (int64_t m : candidates) {
    const double pass = cost.at(m);
    total += std::max(pass, std::min(kSpeedMinTimedS, pass * static_cast<double>(kSpeedMaxRepeats))) +
             (warm.count(m) ? 0.0 : pass);
    if (total > budget_s) break;
    out.push_back(m);
  }
  return out;
}

SpeedChoice choose_fastest(const std::vector<SpeedPoint>& table, int64_t largest, double margin) {
  SpeedChoice c;
  c.largest = largest;
  c.table = table;
  std::sort(c.table.begin(), c.table.end(), [](const auto& a, const auto& b) { return a.micro_batch > b.micro_batch; });
  double fastest = 0;
  int64_t fastest_at = 0;
  for (const auto& p : c.table)
    if (p.fits && p.samples_per_s > fastest) fastest = p.samples_per_s, fastest_at = p.micro_batch;
  if (fastest <= 0) {
    c.micro_batch = largest;
    c.reason = "the largest that fits: no speed was measured";
    return c;
  }
  for (const auto& p : c.table) {  // largest first: the first within the margin
    if (!p.fits || p.samples_per_s * (1.0 + margin) < fastest) continue;
    c.micro_batch = p.micro_batch;
    break;
  }
  // The largest's figure, or why it has none that counts.
  std::string at_largest = "no figure at " + std::to_string(largest) + ", the largest that fits";
  double chosen = 0;
  for (const auto& p : c.table) {
    if (p.micro_batch == c.micro_batch) chosen = p.samples_per_s;
    if (p.micro_batch != largest) continue;
    at_largest = p.fits ? rate_text(p.samples_per_s) + " at " + std::to_string(largest) + ", the largest that fits"
                        : std::to_string(largest) + ", the largest that fits, out of memory in its timed pass";
  }
  char pct[16];
  std::snprintf(pct, sizeof(pct), "%.0f%%", margin * 100);
  if (c.micro_batch == largest)
    c.reason = "the largest that fits, " + rate_text(chosen) + " samples/s: no smaller size is more than " + pct +
               " faster";
  else if (c.micro_batch == fastest_at)
    c.reason = "the fastest, " + rate_text(fastest) + " samples/s against " + at_largest + " (more than " + pct +
               " faster)";
  else
    c.reason = "within " + std::string(pct) + " of the fastest (" + rate_text(fastest) + " samples/s at " +
               std::to_string(fastest_at) + "), " + rate_text(chosen) + " samples/s against " + at_largest;
  return c;
}

}  // namespace trainer
