#include "trainer/memory/oom.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <stdexcept>

#include "trainer/memory/curve.h"

namespace trainer {

namespace {

std::string bytes_text(int64_t b) {
  if (b == 0) return "none";
  // Plain MiB with one decimal keeps this file free of the torch-dependent memory.h.
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%.1f MiB", static_cast<double>(b) / (1024.0 * 1024.0));
  return buf;
}

const char* probe_name(ProbeKind p) {
  switch (p) {
    case ProbeKind::kNone: return "none";
    case ProbeKind::kGrow: return "grow";
    case ProbeKind::kCheckpointingOff: return "checkpointing_off";
  }
  return "none";
}

ProbeKind probe_from_name(const std::string& s) {
  if (s == "none") return ProbeKind::kNone;
  if (s == "grow") return ProbeKind::kGrow;
  if (s == "checkpointing_off") return ProbeKind::kCheckpointingOff;
  throw std::invalid_argument("micro-batch controller state: probe '" + s +
                              "' is not one of none, grow, checkpointing_off");
}

void check_options(const MicroBatchOptions& o, int64_t micro) {
  auto bad = [](const std::string& what) {
    throw std::invalid_argument("micro-batch controller: " + what);
  };
  if (o.global_batch < 1) bad("global_batch must be >= 1, got " + std::to_string(o.global_batch));
  if (o.min_micro_batch < 1 || o.min_micro_batch > o.global_batch)
    bad("min_micro_batch must be in [1, global_batch = " + std::to_string(o.global_batch) + "], got " +
        std::to_string(o.min_micro_batch));
  if (micro < o.min_micro_batch || micro > o.global_batch)
    bad("micro_batch must be in [min_micro_batch = " + std::to_string(o.min_micro_batch) +
        ", global_batch = " + std::to_string(o.global_batch) + "], got " + std::to_string(micro));
  if (o.grow_after < 1) bad("grow_after must be >= 1 step, got " + std::to_string(o.grow_after));
  if (o.max_micro_batch != 0 && (o.max_micro_batch < micro || o.max_micro_batch > o.global_batch))
    bad("max_micro_batch must be 0 or in [micro_batch = " + std::to_string(micro) + ", global_batch = " +
        std::to_string(o.global_batch) + "], got " + std::to_string(o.max_micro_batch));
  if (!(o.headroom >= 0 && o.headroom < 1)) bad("headroom must be in [0, 1), got " + std::to_string(o.headroom));
}

}  // namespace

int64_t accum_steps_for(int64_t global_batch, int64_t micro_batch) {
  if (micro_batch < 1 || micro_batch > global_batch)
    throw std::invalid_argument("micro-batch " + std::to_string(micro_batch) + " must be in [1, global batch " +
                                std::to_string(global_batch) + "]");
  return (global_batch + micro_batch - 1) / micro_batch;
}

std::vector<int64_t> split_batch(int64_t global_batch, int64_t micro_batch) {
  const int64_t n = accum_steps_for(global_batch, micro_batch);
  std::vector<int64_t> sizes(static_cast<size_t>(n), micro_batch);
  sizes.back() = global_batch - micro_batch * (n - 1);
  return sizes;
}

std::vector<int64_t> halving_ladder(int64_t global_batch, int64_t micro_batch, int64_t floor) {
  if (floor < 1 || micro_batch < floor || global_batch < micro_batch)
    throw std::invalid_argument("halving_ladder: need 1 <= floor <= micro_batch <= global_batch, got " +
                                std::to_string(floor) + ", " + std::to_string(micro_batch) + ", " +
                                std::to_string(global_batch));
  std::vector<int64_t> out;
  for (int64_t m : {global_batch, micro_batch}) {
    out.push_back(m);
    while (m > floor) {
      m = std::max(floor, (m + 1) / 2);
      out.push_back(m);
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

const char* to_string(OomEventKind kind) {
  switch (kind) {
    case OomEventKind::kBackoff: return "backoff";
    case OomEventKind::kCheckpointingOn: return "checkpointing_on";
    case OomEventKind::kGiveUp: return "give_up";
    case OomEventKind::kProbe: return "probe";
    case OomEventKind::kProbeFailed: return "probe_failed";
    case OomEventKind::kProbeSucceeded: return "probe_succeeded";
    case OomEventKind::kLimitChanged: return "limit_changed";
    case OomEventKind::kProbeSkipped: return "probe_skipped";
  }
  return "unknown";
}

nlohmann::json OomEvent::to_json() const {
  return {{"event", "oom"},
          {"kind", to_string(kind)},
          {"old_micro_batch", old_micro_batch},
          {"new_micro_batch", new_micro_batch},
          {"old_accum_steps", old_accum_steps},
          {"new_accum_steps", new_accum_steps},
          {"old_checkpointing", old_checkpointing},
          {"new_checkpointing", new_checkpointing},
          {"limit_bytes", limit_bytes},
          {"peak_bytes", peak_bytes},
          {"reason", reason}};
}

MicroBatchController::MicroBatchController(const MicroBatchOptions& options) : opt_(options) {
  micro_ = opt_.micro_batch == 0 ? opt_.global_batch : opt_.micro_batch;
  check_options(opt_, micro_);
  checkpointing_ = opt_.checkpointing;
  last_good_micro_ = micro_;
}

OomEvent MicroBatchController::make_event(OomEventKind kind, int64_t old_micro, bool old_ckpt,
                                          std::string reason) const {
  OomEvent e;
  e.kind = kind;
  e.old_micro_batch = old_micro;
  e.new_micro_batch = micro_;
  e.old_accum_steps = accum_steps_for(opt_.global_batch, old_micro);
  e.new_accum_steps = accum_steps();
  e.old_checkpointing = old_ckpt;
  e.new_checkpointing = checkpointing_;
  e.limit_bytes = limit_;
  e.reason = std::move(reason);
  return e;
}

OomEvent MicroBatchController::record(OomEvent e) {
  events_.push_back(e);
  return e;
}

void MicroBatchController::remember_failure(int64_t micro) {
  if (failed_micro_ == 0 || micro < failed_micro_) failed_micro_ = micro;
}

void MicroBatchController::on_state_shrank() {
  failed_micro_ = 0;
  skipped_micro_ = 0;
  ckpt_off_failed_ = false;
  limit_rose_ = true;
}

std::optional<OomEvent> MicroBatchController::on_limit_changed(int64_t new_limit) {
  if (new_limit < 0) throw std::invalid_argument("micro-batch controller: limit must be >= 0 (0 = none)");
  if (new_limit == limit_) return std::nullopt;
  const int64_t old = limit_;
  // "none" is the largest limit of all; from none to a number is a fall.
  const bool rose = (new_limit == 0) || (old != 0 && new_limit > old);
  limit_ = new_limit;
  std::string reason = old == 0 ? "memory limit set to " + bytes_text(new_limit) + " (was none)"
                                : "memory limit " + std::string(rose ? "rose" : "fell") + " from " +
                                      bytes_text(old) + " to " + bytes_text(new_limit);
  if (rose) {
    // Sizes that failed under the old limit may fit now; the next clean step probes.
    failed_micro_ = 0;
    skipped_micro_ = 0;
    ckpt_off_failed_ = false;
    limit_rose_ = true;
    reason += ": forgetting failed sizes, probing at the next clean step";
  } else {
    // A failure at a higher limit still fails at a lower one: keep it. Nothing shrinks ahead of time;
    // the next OOM climbs the ladder.
    reason += ": keeping the current micro-batch until an OOM";
  }
  return record(make_event(OomEventKind::kLimitChanged, micro_, checkpointing_, reason));
}

OomAction MicroBatchController::on_oom(int64_t limit_bytes) {
  on_limit_changed(limit_bytes);
  clean_steps_ = 0;
  OomAction a;
  if (probe_ != ProbeKind::kNone) {
    a.kind = OomAction::Kind::kRevertProbe;
    a.event = on_probe_failed();
  } else if (micro_ > opt_.min_micro_batch) {
    const int64_t old = micro_;
    remember_failure(old);
    micro_ = std::max(opt_.min_micro_batch, (old + 1) / 2);
    last_good_micro_ = micro_;
    a.kind = OomAction::Kind::kHalve;
    a.event = record(make_event(OomEventKind::kBackoff, old, checkpointing_,
                                "out of memory at micro-batch " + std::to_string(old) + ": halving to " +
                                    std::to_string(micro_) + " (" + std::to_string(accum_steps()) +
                                    " micro-batches per step, global batch " +
                                    std::to_string(opt_.global_batch) + " unchanged)"));
  } else if (!checkpointing_ && opt_.allow_checkpointing) {
    checkpointing_ = true;
    ckpt_by_ladder_ = true;
    // Failures seen without checkpointing say nothing about sizes with it.
    failed_micro_ = 0;
    skipped_micro_ = 0;
    ckpt_off_failed_ = false;
    a.kind = OomAction::Kind::kEnableCheckpointing;
    a.event = record(make_event(OomEventKind::kCheckpointingOn, micro_, false,
                                "out of memory at the smallest micro-batch " + std::to_string(micro_) +
                                    ": turning activation checkpointing on"));
  } else {
    remember_failure(micro_);
    a.kind = OomAction::Kind::kGiveUp;
    std::string why = "out of memory at the smallest micro-batch " + std::to_string(micro_) +
                      (checkpointing_ ? " with activation checkpointing on"
                                      : " with activation checkpointing off (not allowed to turn it on)") +
                      " under a memory limit of " + bytes_text(limit_) +
                      ": the model, its optimizer state and one micro-batch do not fit; raise the memory "
                      "limit, lower the micro-batch floor" +
                      (checkpointing_ ? "" : ", allow activation checkpointing") + " or use a smaller model";
    a.event = record(make_event(OomEventKind::kGiveUp, micro_, checkpointing_, why));
  }
  a.micro_batch = micro_;
  a.accum_steps = accum_steps();
  a.checkpointing = checkpointing_;
  return a;
}

OomEvent MicroBatchController::on_probe_failed() {
  if (probe_ == ProbeKind::kNone) throw std::logic_error("micro-batch controller: on_probe_failed without a probe");
  const int64_t old = micro_;
  const bool old_ckpt = checkpointing_;
  std::string reason;
  if (probe_ == ProbeKind::kGrow) {
    remember_failure(old);
    micro_ = last_good_micro_;
    reason = "probe at micro-batch " + std::to_string(old) + " ran out of memory: back to " +
             std::to_string(micro_) + "; not trying " + std::to_string(old) +
             " or more again until the limit rises";
  } else {
    checkpointing_ = true;
    ckpt_off_failed_ = true;
    reason = "probe with activation checkpointing off ran out of memory: turning it back on until the "
             "limit rises";
  }
  probe_ = ProbeKind::kNone;
  clean_steps_ = 0;
  return record(make_event(OomEventKind::kProbeFailed, old, old_ckpt, reason));
}

OomEvent MicroBatchController::on_probe_succeeded() {
  if (probe_ == ProbeKind::kNone)
    throw std::logic_error("micro-batch controller: on_probe_succeeded without a probe");
  const std::string what = probe_ == ProbeKind::kGrow ? "micro-batch " + std::to_string(micro_)
                                                      : std::string("activation checkpointing off");
  if (probe_ == ProbeKind::kCheckpointingOff) {
    ckpt_by_ladder_ = false;
    skipped_micro_ = 0;  // a skip was judged on the line with checkpointing
  }
  probe_ = ProbeKind::kNone;
  last_good_micro_ = micro_;
  clean_steps_ = 0;
  return record(make_event(OomEventKind::kProbeSucceeded, micro_, checkpointing_,
                           "probe step with " + what + " was clean: keeping it"));
}

void MicroBatchController::add_peak(int64_t micro_batch, bool checkpointing, int64_t peak_bytes) {
  if (micro_batch < 1 || micro_batch > opt_.global_batch)
    throw std::invalid_argument("micro-batch controller: a peak at micro-batch " + std::to_string(micro_batch) +
                                ", outside [1, global_batch = " + std::to_string(opt_.global_batch) + "]");
  if (peak_bytes <= 0) return;
  auto& seen = peaks_[checkpointing ? 1 : 0];
  // The lowest: the first step at a size may hold cuDNN's timing workspaces, which later steps do not.
  const auto [it, fresh] = seen.emplace(micro_batch, peak_bytes);
  if (!fresh) it->second = std::min(it->second, peak_bytes);
  while (seen.size() > kMaxPeakSizes) {  // drop the size farthest from where the run is now
    const auto last = std::prev(seen.end());
    seen.erase(std::llabs(seen.begin()->first - micro_) >= std::llabs(last->first - micro_) ? seen.begin() : last);
  }
}

namespace {

// peak = fixed + per_sample x micro-batch through the peaks seen, once they span a factor of two.
std::optional<MemoryFit> line_through(const std::map<int64_t, int64_t>& seen) {
  if (seen.size() < 2 || seen.rbegin()->first < 2 * seen.begin()->first) return std::nullopt;
  std::vector<CurvePoint> points;
  for (const auto& [micro, peak] : seen) points.push_back({micro, peak, 0});
  return fit_memory_curve(points);
}

std::string line_text(const std::map<int64_t, int64_t>& seen, const MemoryFit& line, int64_t micro) {
  return "the line through the peaks at micro-batch " + std::to_string(seen.begin()->first) + " to " +
         std::to_string(seen.rbegin()->first) + " (" + std::to_string(seen.size()) + " sizes) puts micro-batch " +
         std::to_string(micro) + " at " + bytes_text(static_cast<int64_t>(line.peak_at(micro)));
}

}  // namespace

int64_t MicroBatchController::largest_predicted_to_fit() const {
  const auto& seen = peaks(checkpointing_);
  const auto line = line_through(seen);
  if (limit_ == 0 || !line) return opt_.global_batch;
  int64_t allowed = predict_max_micro_batch(*line, limit_, opt_.global_batch);
  // A size that ran under this limit's bytes is not ruled out by a line that misses its point.
  for (const auto& [micro, peak] : seen)
    if (peak <= limit_) allowed = std::max(allowed, micro);
  return allowed;
}

// The size a grow probe tries (<= micro_: none): double while nothing has failed, else halfway to the
// smallest failed size; with halvings_only the ladder's next size below it. Then no more than the line
// through the clean steps' peaks allows under the limit: a size it puts over the limit is skipped.
MicroBatchController::GrowTarget MicroBatchController::grow_target(int64_t peak_bytes) {
  int64_t target = 0;
  if (opt_.halvings_only) {
    const int64_t start = opt_.micro_batch == 0 ? opt_.global_batch : opt_.micro_batch;
    const auto sizes = halving_ladder(opt_.global_batch, start, opt_.min_micro_batch);
    const auto next = std::upper_bound(sizes.begin(), sizes.end(), micro_);
    if (next == sizes.end() || (failed_micro_ != 0 && *next >= failed_micro_) || *next > max_micro_batch())
      return {micro_, ""};
    target = *next;
  } else {
    target = failed_micro_ == 0 ? 2 * micro_ : micro_ + (failed_micro_ - micro_) / 2;
    target = std::min(target, max_micro_batch());
    if (failed_micro_ != 0) target = std::min(target, failed_micro_ - 1);
  }
  const int64_t allowed = largest_predicted_to_fit();
  if (target <= micro_ || target <= allowed) return {target, ""};
  const auto& seen = peaks(checkpointing_);
  const std::string why = line_text(seen, *line_through(seen), target) + ", over the limit " + bytes_text(limit_);
  // With halvings_only no size of the ladder lies between micro_ and its next one.
  if (!opt_.halvings_only && allowed > micro_) return {allowed, " (not " + std::to_string(target) + ": " + why + ")"};
  if (skipped_micro_ == 0 || target < skipped_micro_) {  // once per size and limit, not every clean step
    skipped_micro_ = target;
    OomEvent e = make_event(OomEventKind::kProbeSkipped, micro_, checkpointing_,
                            "not probing micro-batch " + std::to_string(target) + ": " + why + "; keeping " +
                                std::to_string(micro_) + " until the limit rises");
    e.peak_bytes = peak_bytes;
    record(e);
  }
  return {micro_, ""};
}

std::optional<int64_t> MicroBatchController::maybe_grow(int64_t limit_bytes, int64_t peak_bytes) {
  on_limit_changed(limit_bytes);
  add_peak(micro_, checkpointing_, peak_bytes);  // the size and setting this step ran at, a probe's or not
  if (probe_ != ProbeKind::kNone) {
    on_probe_succeeded();
    // The next probe waits for grow_after clean steps again, unless the limit rises.
    if (!limit_rose_) return std::nullopt;
  } else {
    ++clean_steps_;
  }
  const bool headroom = limit_ == 0 || static_cast<double>(peak_bytes) <
                                           (1.0 - opt_.headroom) * static_cast<double>(limit_);
  const bool rose = limit_rose_;
  if (!rose && !(clean_steps_ >= opt_.grow_after && headroom)) return std::nullopt;
  limit_rose_ = false;

  const int64_t old = micro_;
  const bool old_ckpt = checkpointing_;
  const std::string why = rose ? "after the memory limit rose to " + bytes_text(limit_)
                               : "after " + std::to_string(clean_steps_) + " clean steps with peak " +
                                     bytes_text(peak_bytes) + " under limit " + bytes_text(limit_);
  // Checkpointing costs a recomputed forward on every step; dropping it first buys back more speed
  // than a larger micro-batch would.
  std::string lowered;
  if (checkpointing_ && ckpt_by_ladder_ && !ckpt_off_failed_) {
    checkpointing_ = false;
    probe_ = ProbeKind::kCheckpointingOff;
  } else if (micro_ < max_micro_batch()) {
    const GrowTarget target = grow_target(peak_bytes);
    if (target.micro_batch <= micro_) return std::nullopt;
    micro_ = target.micro_batch;
    lowered = target.lowered;
    probe_ = ProbeKind::kGrow;
  } else {
    return std::nullopt;
  }
  last_good_micro_ = old;
  clean_steps_ = 0;
  OomEvent e = make_event(OomEventKind::kProbe, old, old_ckpt,
                          (probe_ == ProbeKind::kGrow ? "probing micro-batch " + std::to_string(micro_)
                                                      : std::string("probing with activation checkpointing off")) +
                              " " + why + lowered);
  e.peak_bytes = peak_bytes;
  record(e);
  return micro_;
}

std::vector<OomEvent> MicroBatchController::take_events() {
  std::vector<OomEvent> out;
  out.swap(events_);
  return out;
}

nlohmann::json MicroBatchController::to_json() const {
  return {{"version", 1},
          {"global_batch", opt_.global_batch},
          {"min_micro_batch", opt_.min_micro_batch},
          {"allow_checkpointing", opt_.allow_checkpointing},
          {"grow_after", opt_.grow_after},
          {"headroom", opt_.headroom},
          {"halvings_only", opt_.halvings_only},
          {"max_micro_batch", opt_.max_micro_batch},
          {"initial_checkpointing", opt_.checkpointing},
          {"micro_batch", micro_},
          {"checkpointing", checkpointing_},
          {"checkpointing_by_ladder", ckpt_by_ladder_},
          {"limit_bytes", limit_},
          {"failed_micro_batch", failed_micro_},
          {"checkpointing_off_failed", ckpt_off_failed_},
          {"limit_rose", limit_rose_},
          {"clean_steps", clean_steps_},
          {"probe", probe_name(probe_)},
          {"last_good_micro_batch", last_good_micro_},
          // [[micro_batch, lowest peak bytes], ...]: a resumed run keeps the line its probes are judged on
          {"peaks", {{"without_checkpointing", peaks_[0]}, {"with_checkpointing", peaks_[1]}}},
          {"skipped_micro_batch", skipped_micro_}};
}

MicroBatchController MicroBatchController::from_json(const nlohmann::json& j) {
  auto get = [&](const char* key) -> const nlohmann::json& {
    if (!j.is_object() || !j.contains(key))
      throw std::invalid_argument(std::string("micro-batch controller state: missing key '") + key + "'");
    return j.at(key);
  };
  try {
    if (get("version").get<int>() != 1)
      throw std::invalid_argument("micro-batch controller state: version " + get("version").dump() +
                                  " is not 1; this trainer cannot read it");
    MicroBatchOptions o;
    o.global_batch = get("global_batch").get<int64_t>();
    o.min_micro_batch = get("min_micro_batch").get<int64_t>();
    o.allow_checkpointing = get("allow_checkpointing").get<bool>();
    o.grow_after = get("grow_after").get<int64_t>();
    o.headroom = get("headroom").get<double>();
    o.halvings_only = j.value("halvings_only", false);  // absent in states written before the option
    o.checkpointing = get("initial_checkpointing").get<bool>();
    o.micro_batch = get("micro_batch").get<int64_t>();
    // Absent in states written before the option; checked against the size the state resumes at.
    o.max_micro_batch = j.value("max_micro_batch", int64_t{0});
    MicroBatchController c(o);
    c.checkpointing_ = get("checkpointing").get<bool>();
    c.ckpt_by_ladder_ = get("checkpointing_by_ladder").get<bool>();
    c.limit_ = get("limit_bytes").get<int64_t>();
    c.failed_micro_ = get("failed_micro_batch").get<int64_t>();
    c.ckpt_off_failed_ = get("checkpointing_off_failed").get<bool>();
    c.limit_rose_ = get("limit_rose").get<bool>();
    c.clean_steps_ = get("clean_steps").get<int64_t>();
    c.probe_ = probe_from_name(get("probe").get<std::string>());
    c.last_good_micro_ = get("last_good_micro_batch").get<int64_t>();
    // Both absent in states written before the controller kept peaks: the line starts empty.
    c.skipped_micro_ = j.value("skipped_micro_batch", int64_t{0});
    if (j.contains("peaks")) {
      const auto& peaks = j.at("peaks");
      c.peaks_[0] = peaks.at("without_checkpointing").get<std::map<int64_t, int64_t>>();
      c.peaks_[1] = peaks.at("with_checkpointing").get<std::map<int64_t, int64_t>>();
      for (const auto& seen : c.peaks_)
        for (const auto& [micro, peak] : seen)
          if (micro < 1 || micro > o.global_batch || peak < 1 || seen.size() > kMaxPeakSizes)
            throw std::invalid_argument("micro-batch controller state: peaks out of range in " + peaks.dump());
    }
    if (c.limit_ < 0 || c.failed_micro_ < 0 || c.skipped_micro_ < 0 || c.clean_steps_ < 0 ||
        c.last_good_micro_ < o.min_micro_batch || c.last_good_micro_ > o.global_batch)
      throw std::invalid_argument("micro-batch controller state: a counter is out of range in " + j.dump());
    return c;
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(std::string("micro-batch controller state: wrong type: ") + e.what());
  }
}

namespace {

// Between a size known to fit and a larger one known to fail: the largest that fits (monotone fits).
int64_t bisect(const std::function<bool(int64_t)>& fits, int64_t good, int64_t bad) {
  while (bad - good > 1) {
    const int64_t mid = good + (bad - good) / 2;
    if (fits(mid)) good = mid;
    else bad = mid;
  }
  return good;
}

// From a predicted size: +1, +2, +4, ... while sizes fit, or -1, -2, -4, ... while they fail, then
// bisect the bracket. A good prediction costs two calls (it fits, one more does not).
int64_t gallop_from(const std::function<bool(int64_t)>& fits, int64_t lo, int64_t hi, int64_t start) {
  if (fits(start)) {
    int64_t good = start;
    for (int64_t step = 1; good < hi; step *= 2) {
      const int64_t next = std::min(hi, good + step);
      if (!fits(next)) return bisect(fits, good, next);
      good = next;
    }
    return good;
  }
  int64_t bad = start;
  for (int64_t step = 1; bad > lo; step *= 2) {
    const int64_t next = std::max(lo, bad - step);
    if (fits(next)) return bisect(fits, next, bad);
    bad = next;
  }
  return 0;  // lo itself failed
}

}  // namespace

int64_t find_max_micro_batch(const std::function<bool(int64_t)>& fits, int64_t lo, int64_t hi, int64_t start) {
  if (lo < 1 || hi < lo)
    throw std::invalid_argument("find_max_micro_batch: need 1 <= lo <= hi, got lo = " + std::to_string(lo) +
                                ", hi = " + std::to_string(hi));
  if (start > 0) return gallop_from(fits, lo, hi, std::clamp(start, lo, hi));
  if (!fits(lo)) return 0;
  int64_t good = lo;
  while (good < hi) {
    const int64_t next = std::min(hi, 2 * good);
    if (!fits(next)) return bisect(fits, good, next);
    good = next;
  }
  return good;
}

}  // namespace trainer
