// `train.micro_batch: auto`'s search and the cuDNN pretuning: the one part that measures the step before
// the run's first step. Its probes run the step's own passes (forward, backward, the cuDNN policy's flag)
// on the step's parts and put the step's snapshot back, so that nothing they run counts as training.
//
//   search.h          MicroBatchSearcher: find (the probes, the search, the agreement between ranks, the
//                     speed choice) and pretune, with their results
//   search_choice.h   which search and which size, from measured seconds (pure)
//   search_findings.h what a search found so far, kept in the run folder as it goes
//   trainer/memory/curve.h  the memory curve the search fits to its probes' peaks (pure)
//
// TrainingRun (trainer/run/auto_batch.cpp) runs it once before the first step.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "data/samples/batch.h"
#include "trainer/memory/curve.h"
#include "trainer/step/step.h"

namespace trainer {

/// Thrown inside MicroBatchSearcher::find when its SearchControl::stop says so (a SIGTERM): between probes,
/// or at a block boundary inside one (models::ModelImpl::set_block_check). The search catches it and
/// returns what it had found; what() says where the search was.
struct SearchStopped : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// What MicroBatchSearcher::find found, and what it cost.
struct MicroBatchSearch {
  /// The size the run starts at: the largest that fits (the smallest over ranks), or under
  /// memory.auto_search: auto the speed choice among the sizes that fit (`speed`)
  int64_t micro_batch = 0;
  int64_t largest = 0;      ///< the largest that fits, the smallest over ranks (micro_batch before the speed choice)
  int64_t start = 0;        ///< where the search started (0: doubling from the floor)
  int64_t probes = 0;       ///< forward and backward passes it ran (this rank)
  bool floor_fits = true;   ///< false: not even the floor fitted (on some rank); micro_batch is the floor
  /// curve (find_max_micro_batch_by_curve), doubling (from the floor), start (galloping from `start`);
  /// under memory.auto_search: auto the one `choice` took
  std::string method = "curve";
  std::string method_from = "config";    ///< config | auto (choose_search, trainer/step/search_choice.h)
  nlohmann::json choice;                 ///< auto: SearchChoice::to_json() (null otherwise)
  nlohmann::json speed;                  ///< auto: SpeedChoice::to_json() (null otherwise)
  std::string ended;                     ///< curve: how the search ended (CurveSearch::ended)
  /// every probe: {micro_batch, role, fits, peak_bytes, held_after_bytes, s, warm_s (a warm pass's seconds)}
  nlohmann::json trace = nlohmann::json::array();
  std::vector<int64_t> tuned_sizes;      ///< sizes cuDNN timed during the search (CudnnPolicy)
  int64_t reused = 0;    ///< probes answered from SearchControl::known instead of run (counted in probes)
  /// The search was stopped (SearchControl::stop, on some rank): micro_batch means nothing, and the run
  /// exits without a step. `stopped_at` says where ("in backward at block 7 of 16 of probe 3 ...").
  bool stopped = false;
  std::string stopped_at;
};

/// What the caller gives MicroBatchSearcher::find besides the batch: when to stop, and what an earlier process
/// already found under the same conditions.
struct SearchControl {
  /// Asked before each probe and at every block boundary inside one (forward and backward): true stops
  /// the search there (MicroBatchSearch::stopped). The run passes its SIGTERM/SIGINT flag.
  std::function<bool()> stop;
  /// Outcomes by micro-batch size, taken as the probe's answer without running it (an interrupted
  /// search's findings, read back by the run that resumes it).
  std::map<int64_t, ProbeOutcome> known;
  /// Called after each probe that ran to its end (not a known one), with its size and outcome: the run
  /// writes its findings as the search goes, so that a stop or a kill loses at most the probe in progress.
  std::function<void(int64_t micro_batch, const ProbeOutcome& outcome)> on_probe;
};

/// What MicroBatchSearcher::pretune did.
struct Pretune {
  std::vector<int64_t> tuned;    ///< sizes timed
  std::vector<int64_t> skipped;  ///< sizes that ran out of memory (their first use later takes the heuristics)
  double seconds = 0;
};

/// The search and the pretuning, on a Step's parts (alive as long as the searcher).
class MicroBatchSearcher {
 public:
  explicit MicroBatchSearcher(Step& step) : s_(step) {}

  /// `train.micro_batch: auto`: the largest micro-batch in [min_micro_batch, the batch's size] whose
  /// forward and backward fit under the cap, found on `batch`'s samples with the optimizer state
  /// allocated; the smallest over ranks. With `start` > 0 (a memory curve file's prediction) the search
  /// gallops from it (find_max_micro_batch, exact); otherwise memory.auto_search: `curve`
  /// (find_max_micro_batch_by_curve on the probes' own peaks: a few probes, within 90%), `doubling`
  /// (from the floor, exact) or `auto`: the floor and the curve's second point are probed and timed, and
  /// choose_search takes doubling where its projected time is within budget, else the curve; then, on
  /// the agreed size, choose_fastest picks among it and its halvings by samples/s measured in warm timed
  /// passes (every rank the slowest rank's figure per size). Exactness assumes fitting is monotone.
  /// Each probe asks the cuDNN policy for its benchmark flag (a confirm probe is where the run will
  /// likely start). The probes run with the checkpointing the blocks have (apply_activation_checkpointing)
  /// and do not count as training (the snapshot is put back). `control` (SearchControl): a stop is
  /// honoured before the next probe or at the next block boundary of the probe in progress, and answered
  /// sizes are not probed again. Under data parallel every rank learns that one stopped (the agreement
  /// carries it).
  MicroBatchSearch find(const data::Batch& batch, int64_t min_micro_batch, int64_t limit, int64_t start = 0,
                        const SearchControl& control = {});

  /// memory.cudnn_policy pretune, before the first step: one forward and backward on `batch`'s first
  /// samples at each of CudnnPolicy::pretune_sizes (the ladder's next halvings below the current
  /// micro-batch) with cuDNN's benchmark on, so that a backoff to them finds timed algorithms. A size
  /// that runs out of memory is skipped. Nothing trains (the snapshot is put back); nothing in the other
  /// modes. Writes a `cudnn_pretune` event.
  Pretune pretune(const data::Batch& batch, int64_t step);

 private:
  /// One probe of find's search (search.cpp).
  class Probe;
  /// The search proper: the optimizer state and the snapshot allocated, then the search `how` (auto,
  /// the curve, or doubling: galloping from found.start when it is set); -1 when those did not fit. A stop
  /// is recorded in `found`.
  int64_t search(Probe& probe, AutoSearch how, int64_t floor, int64_t size, int64_t limit,
                 std::optional<StepSnapshot>& snapshot, MicroBatchSearch& found);
  /// Data parallel: the smallest micro-batch over ranks, and a stop on any rank.
  int64_t agree(int64_t mb, MicroBatchSearch& found);

  Step& s_;
};

}  // namespace trainer
