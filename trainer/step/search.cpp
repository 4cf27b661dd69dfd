// `train.micro_batch: auto`'s search and the cuDNN pretuning (search.h): the probes run the step's own
// passes on the step's parts, and put its snapshot back after.
#include "trainer/step/search.h"

#include <spdlog/spdlog.h>

#include "common/clock.h"
#include "trainer/step/search_choice.h"
#include "trainer/step/snapshot.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>

namespace trainer {

// ---- the micro-batch search ------------------------------------------------------------------------

// A probe is the step's worst micro-batch: the first one's forward and backward, then, when the step
// accumulates (mb below the batch), the second one's with the first one's gradients alive. One pass alone
// misses those gradients, and picked sizes whose real step then ran out of memory. Its peak is what the
// curve search fits. Nothing trains: the gradients are zeroed after, and MicroBatchSearcher::find puts the
// snapshot back.
//
// One line per probe: on a CPU a probe of a large micro-batch takes minutes, and the search must not be
// silent for that long. A stop is honoured before a probe and at every block boundary inside one (forward
// and backward), so a SIGTERM waits for one block, not for a probe that takes minutes on a CPU.
//
// Timing (memory.auto_search: auto, trainer/step/search_choice.h): a probe's second pass at the size of
// its first runs warm (the first paid the size's one-off costs: cuDNN's choice of algorithms, the
// allocator's growth), so it is timed, synchronized with the device, and kept as the size's warm seconds.
// Where a probe has no such pass, time_at runs a warm-up pass and a timed one.
class MicroBatchSearcher::Probe {
 public:
  Probe(Step& step, const data::Batch& batch, const SearchControl& control, MicroBatchSearch& found)
      : s_(step),
        batch_(batch),
        control_(control),
        found_(found),
        blocks_(step.parts().model->num_blocks()),
        timer_(PassTimer::steady(device_sync(step.options().forward.device))) {}

  /// What the searches call: the outcome at `mb`, found before the restart or measured now; a size asked
  /// again (auto's first two probes, taken up by the search it chose) answers from this search's own.
  ProbeOutcome operator()(int64_t mb, ProbeRole role) {
    if (const auto s = seen_.find(mb); s != seen_.end()) return s->second;
    if (const auto k = control_.known.find(mb); k != control_.known.end()) return seen_[mb] = reuse(mb, role, k->second);
    const auto t = std::chrono::steady_clock::now();
    const CudnnAttempt kind = role == ProbeRole::kConfirm ? CudnnAttempt::kConfirmProbe : CudnnAttempt::kCalibrationProbe;
    ProbeOutcome o = measure(mb, kind);
    // A probe that timed a new size and ran out of memory may have failed in the timing's workspaces.
    if (!o.fits && s_.cudnn().on_oom()) o = measure(mb, kind);
    if (control_.on_probe) control_.on_probe(mb, o);
    log_measured(mb, role, o, seconds_since(t));
    return seen_[mb] = o;
  }

  /// memory.auto_search: auto: the floor and the curve's second point, timed; then doubling or the curve
  /// (choose_search), which takes up those two probes. The largest size that fitted (0: not the floor).
  int64_t search_auto(int64_t floor, int64_t size, int64_t limit) {
    const ProbeOutcome f = (*this)(floor, ProbeRole::kCalibrate);
    if (!f.fits || floor == size) {
      found_.ended = f.fits ? "whole" : "floor";
      found_.method = mode_name(AutoSearch::kCurve);
      found_.choice = {{"method", found_.method}, {"reason", "the first probe decided it: " + found_.ended}};
      return f.fits ? floor : 0;
    }
    const int64_t second = std::min(size, std::max(floor + 1, kCurveSecondPoint * floor));
    const ProbeOutcome s = (*this)(second, ProbeRole::kCalibrate);
    const SearchChoice c = choose(floor, f, second, s, size, limit);
    found_.method = mode_name(c.method);
    found_.choice = c.to_json();
    cost_ = c.timed ? std::optional<PassCost>(c.cost) : std::nullopt;
    spdlog::info("micro_batch auto: {}", c.reason);
    if (c.method == AutoSearch::kCurve) {
      const CurveSearch cs = find_max_micro_batch_by_curve(std::ref(*this), floor, size, limit);
      found_.ended = cs.ended;
      return cs.micro_batch;
    }
    auto fits = [&](int64_t m) { return (*this)(m, ProbeRole::kCalibrate).fits; };
    return s.fits ? find_max_micro_batch(fits, second, size) : find_max_micro_batch(fits, floor, second - 1);
  }

  /// The speed choice on the agreed largest size `largest`: it and its halvings timed within
  /// kSpeedBudgetS of projected pass time, each rank's figures agreed (the slowest rank's per size: a
  /// data-parallel step runs at its slowest rank's pace), then choose_fastest. Every rank calls it.
  SpeedChoice choose_speed(int64_t largest, int64_t floor) {
    const std::vector<int64_t> candidates = speed_candidates(largest, floor);
    const std::vector<int64_t> sizes = cost_ ? speed_sizes_within(*cost_, candidates, ran_) : std::vector<int64_t>{};
    std::vector<double> failed(candidates.size(), 0.0), rate(candidates.size(), 0.0);
    for (size_t i = 0; i < sizes.size(); ++i) {
      const double secs = time_at(sizes[i], /*speed=*/true);
      if (secs < 0) failed[i] = 1;
      else if (secs > 0) rate[i] = static_cast<double>(sizes[i]) / secs;
    }
    if (s_.parts().dist) {
      std::vector<double> v = failed;
      for (double r : rate) v.push_back(-r);
      const auto a = s_.parts().dist->all_max(v, "the speed table agreement");
      for (size_t i = 0; i < candidates.size(); ++i) failed[i] = a[i], rate[i] = -a[candidates.size() + i];
    }
    std::vector<SpeedPoint> table;
    for (size_t i = 0; i < candidates.size(); ++i)
      if (failed[i] > 0 || rate[i] > 0) table.push_back({candidates[i], failed[i] == 0, rate[i]});
    SpeedChoice c = choose_fastest(table, largest);
    if (table.size() < candidates.size())
      c.reason += " (" + std::to_string(candidates.size() - table.size()) + " of " + std::to_string(candidates.size()) +
                  " candidates not timed: " + (cost_ ? "over the " + std::to_string(static_cast<int>(kSpeedBudgetS)) +
                                                           " s budget of timed passes"
                                                     : std::string("the first probes carry no timing")) + ")";
    return c;
  }

 private:
  /// On CUDA the device's synchronization, so that a timed pass is the kernels' time, not their queueing.
  static std::function<void()> device_sync(const c10::Device& device) {
    if (!device.is_cuda()) return {};
    return [index = device.index()] { torch::cuda::synchronize(index); };
  }

  /// choose_search from the first two probes: their warm seconds give the cost line, their peaks the
  /// predicted largest size; untimed (the curve) when they were read back after a restart.
  SearchChoice choose(int64_t floor, const ProbeOutcome& f, int64_t second, const ProbeOutcome& s, int64_t size,
                      int64_t limit) {
    if (control_.known.count(floor) || (s.fits && control_.known.count(second))) return untimed_search_choice();
    const double tf = time_at(floor);
    const double ts = s.fits ? time_at(second) : -1;
    if (tf <= 0) return untimed_search_choice();
    // Without a second warm pass (it did not fit): all of the floor's time per sample, an upper bound.
    const PassCost cost =
        ts > 0 ? PassCost::through(floor, tf, second, ts) : PassCost{0, tf / static_cast<double>(floor)};
    int64_t predicted = size;
    if (s.fits && limit > 0)
      predicted = predict_max_micro_batch(
          fit_memory_curve({{floor, f.peak_bytes}, {second, s.peak_bytes}}), limit, size);
    return choose_search(cost, floor, second, s.fits, size, predicted, batch_.size());
  }

  /// A warm pass's seconds at `mb`: for the search's choice a probe's second pass if it had one, else a
  /// timed pass; for the speed table (`speed`) the fastest of repeated timed passes (PassTimer::fastest).
  /// First a warm-up pass where the size never ran in this search. -1 when a pass ran out of memory.
  double time_at(int64_t mb, bool speed = false) {
    if (const auto w = warm_s_.find(mb); !speed && w != warm_s_.end()) return w->second;
    try {
      if (!ran_.count(mb)) {  // a size no probe ran: its first pass takes the one-off costs
        s_.apply_cudnn(CudnnAttempt::kCalibrationProbe, {mb}, 0);
        one_pass(0, mb);
        ran_.insert(mb);
      }
      if (speed) return timer_.fastest([&] { one_pass(0, mb); });
      return warm_s_[mb] = timer_.time([&] { one_pass(0, mb); });
    } catch (const std::exception& e) {
      if (!is_oom_error(e)) throw;
      s_.drop_failed_attempt();
      return -1;
    }
  }

  /// Found by an earlier process under the same conditions (the run's auto_search.json).
  ProbeOutcome reuse(int64_t mb, ProbeRole role, const ProbeOutcome& o) {
    ++found_.probes;
    ++found_.reused;
    spdlog::info("micro_batch auto: probe {}: micro-batch {} {}{} (found before the restart)", found_.probes, mb,
                 o.fits ? "fits" : "does not fit", o.fits ? " at " + format_bytes(o.peak_bytes) : "");
    found_.trace.push_back({{"micro_batch", mb}, {"role", to_string(role)}, {"fits", o.fits},
                            {"peak_bytes", o.peak_bytes}, {"reused", true}});
    return o;
  }

  /// One run of the probe at `mb`: its passes under the cuDNN policy's flag, and its peak; an OOM is a
  /// probe that does not fit.
  ProbeOutcome measure(int64_t mb, CudnnAttempt kind) {
    ++found_.probes;
    stop_if_asked("before probe " + std::to_string(found_.probes) + " (micro-batch " + std::to_string(mb) + ")");
    const std::vector<int64_t> sizes = probe_pass_sizes(mb, batch_.size());
    const CudnnDecision d = s_.apply_cudnn(kind, sizes, 0);
    for (int64_t t : d.tuned_sizes()) found_.tuned_sizes.push_back(t);
    s_.parts().memory->reset_peak();
    if (control_.stop) watch_blocks(mb);
    struct Unwatch {  // the check lives as long as the probe, whatever way it ends
      models::ModelImpl& m;
      ~Unwatch() { m.set_block_check(nullptr); }
    } unwatch{*s_.parts().model};
    ProbeOutcome o;
    try {
      const double warm = run_passes(sizes);
      o.peak_bytes = s_.parts().memory->peak_bytes();
      s_.parts().optimizer->zero_grad();
      o.fits = true;
      ran_.insert(mb);
      if (warm > 0) warm_s_[mb] = warm;
    } catch (const SearchStopped&) {
      s_.drop_failed_attempt();
      throw;
    } catch (const std::exception& e) {
      if (!is_oom_error(e)) throw;
      s_.drop_failed_attempt();
    }
    return o;
  }

  /// Forward and backward of each micro-batch in turn, the gradients accumulating. The seconds of the
  /// second pass when it has the first one's size (warm), else 0.
  double run_passes(const std::vector<int64_t>& sizes) {
    double warm = 0;
    for (int64_t at = 0, i = 0; i < static_cast<int64_t>(sizes.size()); at += sizes[i], ++i) {
      if (i == 1 && sizes[1] == sizes[0]) warm = timer_.time([&] { one_pass(at, sizes[i]); });
      else one_pass(at, sizes[i]);
    }
    return warm;
  }

  /// One forward and backward of samples [at, at + n).
  void one_pass(int64_t at, int64_t n) {
    Logits out = forward_logits(*s_.parts().model, batch_.images.narrow(0, at, n), batch_.labels.narrow(0, at, n),
                                s_.options().forward);
    summed_loss(out.logits, out.targets, s_.options().loss, out.columns).backward();
  }

  void stop_if_asked(const std::string& where) const {
    if (control_.stop && control_.stop()) throw SearchStopped(where);
  }

  /// The stop check at every block boundary of this probe's passes.
  void watch_blocks(int64_t mb) {
    s_.parts().model->set_block_check([this, mb, n = found_.probes](int64_t i, bool backward) {
      stop_if_asked(std::string(backward ? "in backward" : "in forward") + " at block " + std::to_string(i + 1) +
                    " of " + std::to_string(blocks_) + " of probe " + std::to_string(n) + " (micro-batch " +
                    std::to_string(mb) + ")");
    });
  }

  /// The probe's line, and what it left behind in the trace (its own tensors are gone: this is what the
  /// next probe starts from).
  void log_measured(int64_t mb, ProbeRole role, const ProbeOutcome& o, double secs) {
    spdlog::info("micro_batch auto: probe {}: micro-batch {} {}{} ({:.1f} s)", found_.probes, mb,
                 o.fits ? "fits" : "does not fit", o.fits ? " at " + format_bytes(o.peak_bytes) : "", secs);
    nlohmann::json t = {{"micro_batch", mb}, {"role", to_string(role)}, {"fits", o.fits},
                        {"peak_bytes", o.peak_bytes}, {"held_after_bytes", s_.parts().memory->current_bytes()},
                        {"s", secs}};
    if (const auto w = warm_s_.find(mb); w != warm_s_.end()) t["warm_s"] = w->second;
    found_.trace.push_back(std::move(t));
  }

  Step& s_;
  const data::Batch& batch_;
  const SearchControl& control_;
  MicroBatchSearch& found_;
  const int64_t blocks_;
  const PassTimer timer_;
  std::map<int64_t, ProbeOutcome> seen_;  // this search's outcomes by size
  std::map<int64_t, double> warm_s_;      // a warm pass's seconds by size
  std::set<int64_t> ran_;                 // sizes whose passes ran in this search (warm for the next)
  std::optional<PassCost> cost_;          // auto: the line through the first two probes' warm passes
};

MicroBatchSearch MicroBatchSearcher::find(const data::Batch& batch, int64_t min_micro_batch, int64_t limit,
                                        int64_t start, const SearchControl& control) {
  // Measured on real samples with the optimizer state already allocated, so the job starts fast rather
  // than OOM-ing its way down.
  s_.parts().optimizer->zero_grad();
  MicroBatchSearch found;
  Probe probe(s_, batch, control, found);
  const int64_t size = batch.size();
  const int64_t floor = std::min(min_micro_batch, size);
  found.start = start > 0 ? std::clamp(start, floor, size) : 0;
  // From a start, doubling gallops up from it; auto's method is the search it then takes.
  const AutoSearch how = found.start > 0 ? AutoSearch::kDoubling : s_.options().auto_search;
  found.method = found.start > 0 ? "start" : mode_name(how);
  if (how == AutoSearch::kAuto) found.method_from = "auto";
  std::optional<StepSnapshot> snapshot;
  int64_t mb = search(probe, how, floor, size, limit, snapshot, found);
  mb = agree(mb, found);
  // The speed choice, on every rank alike: the agreed size and the configured search are the same on all.
  std::optional<SpeedChoice> speed;
  if (how == AutoSearch::kAuto && !found.stopped && mb >= floor) speed = probe.choose_speed(mb, floor);
  if (snapshot) snapshot->restore();  // the probes must not count as training
  if (found.stopped) return found;
  if (mb < 0)
    throw OomGaveUp("micro_batch auto: the model and its optimizer state do not fit in memory (limit " +
                    (limit > 0 ? format_bytes(limit) : std::string("none")) +
                    "); raise memory.limit or use a smaller model");
  // Nothing fits even at the floor: start there, and let the caller or the ladder's next rung
  // (recomputation) try.
  found.floor_fits = mb >= floor;
  found.largest = std::max(mb, floor);
  found.micro_batch = speed ? speed->micro_batch : found.largest;
  if (speed) found.speed = speed->to_json();
  return found;
}

int64_t MicroBatchSearcher::search(Probe& probe, AutoSearch how, int64_t floor, int64_t size, int64_t limit,
                                   std::optional<StepSnapshot>& snapshot, MicroBatchSearch& found) {
  int64_t mb = -1;  // -1: the optimizer state or the snapshot did not fit
  try {
    s_.parts().optimizer->allocate_state();
    snapshot.emplace(*s_.parts().model, s_.options().forward.device);
    if (how == AutoSearch::kAuto) {
      mb = probe.search_auto(floor, size, limit);
    } else if (how == AutoSearch::kCurve) {
      const CurveSearch cs = find_max_micro_batch_by_curve(std::ref(probe), floor, size, limit);
      found.ended = cs.ended;
      mb = cs.micro_batch;  // 0: not even the floor fits
    } else {
      // The prediction of a memory curve file is the confirm probe: where the run will likely start.
      auto fits = [&](int64_t m) {
        return probe(m, m == found.start ? ProbeRole::kConfirm : ProbeRole::kCalibrate).fits;
      };
      mb = find_max_micro_batch(fits, floor, size, found.start);
    }
  } catch (const SearchStopped& e) {
    found.stopped = true;
    found.stopped_at = e.what();
  } catch (const std::exception& e) {
    if (!is_oom_error(e)) throw;
    s_.drop_failed_attempt();
  }
  return mb;
}

int64_t MicroBatchSearcher::agree(int64_t mb, MicroBatchSearch& found) {
  // The smallest over ranks: the micro-batch count per step (and so the collectives) must be equal. A
  // rank that was stopped still comes here, so that every rank learns of it and none waits for it.
  if (!s_.parts().dist) return mb;
  const auto a = s_.parts().dist->all_max({-static_cast<double>(mb), found.stopped ? 1.0 : 0.0}, "the micro-batch agreement");
  if (a[1] > 0 && !found.stopped) {
    found.stopped = true;
    found.stopped_at = "on another rank";
  }
  return static_cast<int64_t>(-a[0]);
}

Pretune MicroBatchSearcher::pretune(const data::Batch& batch, int64_t step) {
  Pretune out;
  const auto sizes = s_.cudnn().pretune_sizes(s_.controller().global_batch(), s_.controller().micro_batch(),
                                          s_.controller().min_micro_batch());
  if (sizes.empty()) return out;
  const auto t = std::chrono::steady_clock::now();
  s_.parts().optimizer->zero_grad();
  std::optional<StepSnapshot> snapshot;
  try {
    snapshot.emplace(*s_.parts().model, s_.options().forward.device, s_.options().batched_snapshot);
  } catch (const std::exception& e) {
    if (!is_oom_error(e)) throw;
    s_.drop_failed_attempt();
    out.skipped = sizes;
  }
  for (int64_t s : snapshot ? sizes : std::vector<int64_t>{}) {
    if (s > batch.size()) continue;
    s_.apply_cudnn(CudnnAttempt::kPretune, {s}, step);
    try {
      Logits o = forward_logits(*s_.parts().model, batch.images.narrow(0, 0, s), batch.labels.narrow(0, 0, s), s_.options().forward);
      summed_loss(o.logits, o.targets, s_.options().loss, o.columns).backward();
      s_.parts().optimizer->zero_grad();
      out.tuned.push_back(s);
    } catch (const std::exception& e) {
      if (!is_oom_error(e)) throw;
      s_.drop_failed_attempt();
      out.skipped.push_back(s);
    }
  }
  if (snapshot) snapshot->restore();  // nothing trained
  set_cudnn_benchmark(false);
  out.seconds = seconds_since(t);
  spdlog::info("cuDNN pretune: timed micro-batch {} in {:.1f} s{}", nlohmann::json(out.tuned).dump(), out.seconds,
               out.skipped.empty() ? "" : "; out of memory at " + nlohmann::json(out.skipped).dump());
  if (s_.parts().metrics)
    s_.parts().metrics->event("cudnn_pretune", {{"step", step}, {"tuned", out.tuned}, {"skipped", out.skipped},
                                        {"seconds", out.seconds}});
  return out;
}

}  // namespace trainer
