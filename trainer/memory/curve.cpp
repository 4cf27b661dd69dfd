#include "trainer/memory/curve.h"

#include "common/files.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>

namespace trainer {

nlohmann::json MemoryFit::to_json() const {
  return {{"fixed_bytes", fixed_bytes},
          {"per_sample_bytes", per_sample_bytes},
          {"residuals_bytes", residuals_bytes},
          {"max_abs_residual_bytes", max_abs_residual_bytes},
          {"rms_residual_bytes", rms_residual_bytes}};
}

MemoryFit fit_memory_curve(const std::vector<CurvePoint>& points) {
  std::set<int64_t> sizes;
  for (const auto& p : points) sizes.insert(p.micro_batch);
  if (sizes.size() < 2)
    throw std::invalid_argument("fit_memory_curve: need points at two or more micro-batches, got " +
                                std::to_string(sizes.size()));
  // Centred sums: the byte counts are large (1e9) and squares of raw sums would lose digits.
  const double n = static_cast<double>(points.size());
  double mx = 0, my = 0;
  for (const auto& p : points) {
    mx += static_cast<double>(p.micro_batch) / n;
    my += static_cast<double>(p.peak_bytes) / n;
  }
  double sxx = 0, sxy = 0;
  for (const auto& p : points) {
    const double dx = static_cast<double>(p.micro_batch) - mx;
    sxx += dx * dx;
    sxy += dx * (static_cast<double>(p.peak_bytes) - my);
  }
  MemoryFit f;
  f.per_sample_bytes = sxy / sxx;
  f.fixed_bytes = my - f.per_sample_bytes * mx;
  double ss = 0;
  for (const auto& p : points) {
    const double r = static_cast<double>(p.peak_bytes) - f.peak_at(p.micro_batch);
    f.residuals_bytes.push_back(r);
    f.max_abs_residual_bytes = std::max(f.max_abs_residual_bytes, std::abs(r));
    ss += r * r;
  }
  f.rms_residual_bytes = std::sqrt(ss / n);
  return f;
}

int64_t predict_max_micro_batch(const MemoryFit& fit, int64_t limit_bytes, int64_t hi) {
  if (limit_bytes <= 0 || fit.per_sample_bytes <= 0) return hi;
  const double m = std::floor((static_cast<double>(limit_bytes) - fit.fixed_bytes) / fit.per_sample_bytes);
  if (m < 1) return 0;
  return m >= static_cast<double>(hi) ? hi : static_cast<int64_t>(m);
}

double interpolate_samples_per_s(const std::vector<CurvePoint>& points, int64_t m) {
  if (points.empty()) return 0.0;
  if (m <= points.front().micro_batch) return points.front().samples_per_s;
  for (size_t i = 1; i < points.size(); ++i) {
    if (m > points[i].micro_batch) continue;
    const CurvePoint &a = points[i - 1], &b = points[i];
    const double t = static_cast<double>(m - a.micro_batch) / static_cast<double>(b.micro_batch - a.micro_batch);
    return a.samples_per_s + t * (b.samples_per_s - a.samples_per_s);
  }
  return points.back().samples_per_s;
}

CurveChoice choose_setting(const MemoryCurve& curve, int64_t limit_bytes, int64_t hi) {
  CurveChoice best;
  for (const char* setting : {"none", "all"}) {
    const auto fit = curve.fits.find(setting);
    const auto pts = curve.points.find(setting);
    if (fit == curve.fits.end() || pts == curve.points.end()) continue;
    const int64_t m = predict_max_micro_batch(fit->second, limit_bytes, hi);
    const double sps = m > 0 ? interpolate_samples_per_s(pts->second, m) : 0.0;
    if (m > 0 && sps > best.samples_per_s) best = {setting, m, sps};
  }
  return best;
}

const char* to_string(ProbeRole role) {
  switch (role) {
    case ProbeRole::kCalibrate: return "calibrate";
    case ProbeRole::kConfirm: return "confirm";
    case ProbeRole::kBisect: return "bisect";
  }
  return "calibrate";
}

nlohmann::json CurveSearch::to_json() const {
  nlohmann::json p = nlohmann::json::array();
  for (const auto& r : probes)
    p.push_back({{"micro_batch", r.micro_batch}, {"role", to_string(r.role)}, {"fits", r.fits}, {"peak_bytes", r.peak_bytes}});
  return {{"micro_batch", micro_batch}, {"ended", ended}, {"probes", p}};
}

CurveSearch find_max_micro_batch_by_curve(const std::function<ProbeOutcome(int64_t, ProbeRole)>& probe, int64_t lo,
                                          int64_t hi, int64_t limit_bytes, double accept) {
  if (lo < 1 || hi < lo)
    throw std::invalid_argument("find_max_micro_batch_by_curve: need 1 <= lo <= hi, got lo = " + std::to_string(lo) +
                                ", hi = " + std::to_string(hi));
  if (!(accept > 0 && accept < 1))
    throw std::invalid_argument("find_max_micro_batch_by_curve: accept must be in (0, 1), got " + std::to_string(accept));
  CurveSearch s;
  int64_t good = 0, bad = hi + 1;  // the largest size that fitted, the smallest that failed (hi + 1: none)
  std::vector<CurvePoint> points;
  std::map<int64_t, bool> seen;
  auto run = [&](int64_t m, ProbeRole role) {
    if (auto it = seen.find(m); it != seen.end()) return it->second;
    const ProbeOutcome o = probe(m, role);
    s.probes.push_back({m, role, o.fits, o.fits ? o.peak_bytes : 0});
    seen[m] = o.fits;
    if (o.fits) {
      good = std::max(good, m);
      points.push_back({m, o.peak_bytes});
    } else {
      bad = std::min(bad, m);
    }
    return o.fits;
  };
  // The largest size that fits is below `bad`: `good` is within `accept` of it.
  auto bracketed = [&] { return bad - good <= 1 || static_cast<double>(good) >= accept * static_cast<double>(bad - 1); };
  auto finish = [&](const char* how) {
    s.micro_batch = good;
    s.ended = how;
    return s;
  };
  auto predict = [&] {
    if (limit_bytes <= 0) return hi;
    std::set<int64_t> distinct;
    for (const auto& p : points) distinct.insert(p.micro_batch);
    if (distinct.size() < 2) return hi;
    return predict_max_micro_batch(fit_memory_curve(points), limit_bytes, hi);
  };

  if (!run(lo, ProbeRole::kCalibrate)) return finish("floor");
  if (lo == hi) return finish("whole");
  const int64_t second = std::min(hi, std::max(lo + 1, kCurveSecondPoint * lo));
  if (run(second, ProbeRole::kCalibrate)) {
    if (second == hi) return finish("whole");
    for (int64_t round = 0; round < kCurveMaxConfirms && !bracketed(); ++round) {
      const int64_t aim = std::clamp(predict(), good + 1, bad - 1);
      if (run(aim, ProbeRole::kConfirm)) {
        if (aim == hi) return finish("whole");
        // Refitted with a point near the limit, the line has little left to extrapolate.
        const int64_t next = predict();
        if (next <= good || static_cast<double>(good) >= kPredictedAccept * static_cast<double>(next))
          return finish("predicted");
        continue;
      }
      // Over the limit: the largest size that fits is below `aim`, and ceil(accept x (aim - 1)) is within
      // `accept` of it; if that one fits too the search is done.
      if (bracketed()) break;
      const int64_t below = std::max(good + 1, static_cast<int64_t>(std::ceil(accept * static_cast<double>(bad - 1))));
      if (below < bad) run(below, ProbeRole::kConfirm);
      break;  // within `accept` if it fitted; else the line is off here: bisect
    }
  }
  while (!bracketed()) run(good + (bad - good) / 2, ProbeRole::kBisect);
  return finish("bracket");
}

MemoryCurve read_memory_curve(const std::string& path) {
  require_regular_file(path, "memory curve");
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot read the memory curve (write it with trainer bench --memory-curve)");
  MemoryCurve c;
  c.path = path;
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    if (j.value("mode", "") != "memory_curve") throw std::runtime_error("its mode is not memory_curve");
    c.model = j.at("model").get<std::string>();
    c.sample_shape = j.at("sample_shape").get<std::vector<int64_t>>();
    c.precision = j.at("precision").get<std::string>();
    for (const auto& [setting, curve] : j.at("curves").items()) {
      auto& pts = c.points[setting];
      for (const auto& p : curve.at("points"))
        pts.push_back({p.at("micro_batch").get<int64_t>(), p.at("peak_bytes").get<int64_t>(),
                       p.value("samples_per_s", 0.0)});
      std::sort(pts.begin(), pts.end(), [](const auto& a, const auto& b) { return a.micro_batch < b.micro_batch; });
      if (!curve.contains("fit") || curve.at("fit").is_null()) continue;  // too few points to fit
      MemoryFit f;
      f.fixed_bytes = curve.at("fit").at("fixed_bytes").get<double>();
      f.per_sample_bytes = curve.at("fit").at("per_sample_bytes").get<double>();
      c.fits[setting] = f;
    }
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": not a trainer bench --memory-curve result (" + e.what() + ")");
  }
  return c;
}

}  // namespace trainer
