// Crash-safe checkpoint storage: a container killed, resized or rescheduled at any instant keeps its
// last complete checkpoint, and a resumed run reads back exactly the bytes that were saved.
//
// Layout (docs/CHECKPOINTS.md has the whole protocol):
//
//   <run_dir>/checkpoints/
//     step-00001200/            one complete checkpoint: the caller's files plus manifest.json
//       model.pt  optimizer.pt  rng.pt  state.json  config.yaml  manifest.json
//     step-00001300/
//     step-00001300-r1/         a retry of step 1300's save under a fresh name (attempt 1)
//     latest                    "step-00001300-r1\n": the commit point, replaced atomically
//     .tmp-step-00001400-4242/  a save in progress (or the remains of a crash, removed at startup)
//
// The store knows nothing of models or optimizers: the caller serializes (trainer/state_dict.h) and
// hands over name -> bytes. A store is used from one thread (the training loop's); only the file writes
// of save_async run on a background thread. One run folder has one writer.
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace trainer {

/// The files of one checkpoint: file name (no '/', not starting with '.', not "manifest.json") -> bytes.
using CheckpointFiles = std::map<std::string, std::string>;

/// A checkpoint read back and verified: every file present, of the size and CRC32 the manifest records.
struct LoadedCheckpoint {
  std::string path;          ///< the checkpoint folder, e.g. <run_dir>/checkpoints/step-00001200
  int64_t step = 0;          ///< the step the caller saved it at
  CheckpointFiles files;     ///< name -> bytes, exactly as saved
  nlohmann::json manifest;   ///< the whole manifest; the caller's extra fields are under "extra"
  /// One line per newer checkpoint that was skipped (corrupt, truncated, missing files, other format
  /// version, dangling `latest`), each naming the folder and the reason. Also logged with spdlog::warn.
  std::vector<std::string> warnings;

  /// The bytes of file `name`; throws std::runtime_error naming the checkpoint if it has no such file.
  const std::string& file(const std::string& name) const;
};

/// The caller's check of a checkpoint's contents, after the store verified its files: "" when it is
/// usable, else the reason (one line). The store knows only files; the caller knows what they must say
/// (that config.yaml is there, that the data position is inside the data).
using CheckpointCheck = std::function<std::string(const LoadedCheckpoint&)>;

/// How a background save ended (take_outcome()).
struct SaveOutcome {
  int64_t step = 0;
  std::string path;   ///< the checkpoint folder written; "" when the save failed
  std::string error;  ///< one line naming the file and the system's reason; "" when it succeeded
  bool ok() const { return error.empty(); }
};

/// A valid checkpoint as list() reports it.
struct CheckpointInfo {
  std::string path;     ///< the checkpoint folder
  int64_t step = 0;
  uint64_t bytes = 0;   ///< total size of its files (manifest excluded)
  std::string created;  ///< UTC time of the save, ISO 8601
};

class CheckpointStore {
 public:
  /// Version of the folder layout and manifest written by this build; other versions are not read.
  static constexpr int kFormatVersion = 1;

  /// A store for `<run_dir>/checkpoints`, keeping the `keep_last` newest checkpoints (0 keeps all).
  /// `device` ("cpu", "cuda:0") is recorded in each manifest. Creates nothing; if the folder exists,
  /// removes the temporary folders and files a crashed save left behind (one writer per run folder).
  /// Throws std::invalid_argument for keep_last < 0.
  CheckpointStore(std::string run_dir, int keep_last, std::string device = "cpu");
  /// Waits for a background save; a failure nobody took with take_outcome() is logged.
  ~CheckpointStore();
  CheckpointStore(const CheckpointStore&) = delete;
  CheckpointStore& operator=(const CheckpointStore&) = delete;

  /// Creates `<run_dir>/checkpoints` and a probe file in it, then removes the probe. Call it BEFORE
  /// training starts so an unwritable run folder fails in the first second, not at the first save.
  /// Throws std::runtime_error naming the folder and the system's reason.
  void check_writable() const;

  /// Saves `files` as the checkpoint of `step` and makes it `latest`; returns its folder. `extra` (a
  /// JSON object) is stored in the manifest under "extra". `attempt` > 0 names the folder
  /// step-NNNNNNNN-r<attempt>: a retry of a failed save of the same step writes to a fresh folder, so
  /// a folder the failed attempt could not replace (or remove) is not in its way. Waits for a
  /// background save first (its outcome stays for take_outcome()). Atomic: on any failure (ENOSPC,
  /// EFBIG, EIO, ...) it throws std::runtime_error naming the file and the reason, removes its
  /// temporary folder, and leaves the previous checkpoints and `latest` untouched. A crash at any
  /// instant leaves either the old or the new checkpoint as `latest`, both complete. Saving a step that
  /// already has a checkpoint replaces it atomically. Afterwards, checkpoints beyond keep_last are removed.
  std::string save(int64_t step, const CheckpointFiles& files,
                   const nlohmann::json& extra = nlohmann::json::object(), int attempt = 0);

  /// Like save(), but the writing happens on a background thread and this returns at once. `files` is
  /// taken by value: serialize on the caller's thread first, so training can go on changing the model.
  /// At most one save is in flight: this waits for the previous one first. How it ended is reported
  /// by take_outcome(), never by a later save: a failure does not stop the next save from being tried.
  void save_async(int64_t step, CheckpointFiles files, nlohmann::json extra = nlohmann::json::object());

  /// Waits for the background save, if any. Its outcome stays for take_outcome().
  void wait();

  /// The outcome of a background save that has finished, oldest first, each once; nullopt when none
  /// finished since the last call (or one is still writing). Never blocks.
  std::optional<SaveOutcome> take_outcome();

  /// True while a background save is writing.
  bool in_flight() const { return in_flight_.load(); }

  /// The checkpoint `latest` names, verified. If it is unusable (missing, corrupt, truncated, missing
  /// files, other format version, rejected by `check`) or `latest` is missing or dangling, falls back to
  /// the newest older valid checkpoint and says why in `warnings`. nullopt when there is no checkpoint
  /// at all (a fresh run). Throws std::runtime_error listing every reason when checkpoints exist but none
  /// is valid: starting from scratch silently would lose the run's progress. Does not wait for a
  /// background save.
  std::optional<LoadedCheckpoint> load_latest(const CheckpointCheck& check = {}) const;

  /// Reads exactly the checkpoint at `path` (for --resume PATH), without falling back: a checkpoint
  /// folder, or a checkpoints or run folder whose `latest` is then followed. Throws std::runtime_error
  /// naming the path and the reason if it is not a valid checkpoint (or `check` rejects it).
  static LoadedCheckpoint load(const std::string& path, const CheckpointCheck& check = {});

  /// The valid checkpoints (checksums verified), oldest first. Reads every file: for tools, not the loop.
  std::vector<CheckpointInfo> list() const;

  /// `<run_dir>/checkpoints`.
  const std::string& dir() const { return dir_; }

 private:
  std::string write_checkpoint(int64_t step, int attempt, const CheckpointFiles& files,
                               const nlohmann::json& extra) const;
  // The stages of write_checkpoint: the files and the manifest into a temporary folder, the folder
  // renamed into place, `latest` pointed at it, old checkpoints beyond keep_last removed.
  void write_folder(const std::filesystem::path& tmp_dir, int64_t step, const CheckpointFiles& files,
                    const nlohmann::json& extra) const;
  void publish_folder(const std::filesystem::path& tmp_dir, const std::filesystem::path& final_dir,
                      const std::string& name) const;
  void commit_latest(const std::string& name, int64_t step, const std::filesystem::path& final_dir) const;
  void prune(int64_t step) const;

  std::string run_dir_;
  std::string dir_;
  int keep_last_;
  std::string device_;
  std::thread worker_;
  std::atomic<bool> in_flight_{false};
  std::mutex outcomes_mu_;             // guards outcomes_ (the worker appends, take_outcome() takes)
  std::deque<SaveOutcome> outcomes_;
};

}  // namespace trainer
