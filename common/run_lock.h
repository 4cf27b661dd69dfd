// One run folder, one owner.
//
// A trainer (or a bench run with --run-dir) holds an exclusive lock on `<run folder>/trainer.lock` for
// its whole life, so that two processes never interleave their checkpoints, metrics and logs: a
// Kubernetes replacement pod started while the old one is still saving on SIGTERM, a nightly job started
// again before last night's has finished, the same command typed in two terminals.
//
// The lock is an open-file-description lock (fcntl F_OFD_SETLK, Linux 3.15+; plain POSIX record locks
// where the kernel has none). The kernel drops it when the process ends, however it ends (SIGKILL and
// an OOM kill included), so there is no stale lock to clean up. Linux forwards these locks to the server
// on NFS (NLM for v3, v4's own locks), so two hosts that share the folder over NFS exclude each other too.
//
// The file holds one JSON object naming the holder (host, pid, start time, config, command line); it is
// written by the holder after it took the lock and is never deleted (deleting it would let a process
// lock an unlinked file while another locks a new one). Its contents mean something only while the lock
// is held: a second process reads them to say who holds the folder.
//
// Within one process the lock is shared: a bench holding its --run-dir runs its jobs in the same folder.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

namespace trainer {

/// The lock file's name inside a run folder.
inline constexpr const char* kRunLockFile = "trainer.lock";

/// Who holds a run folder, as its lock file says.
struct RunFolderHolder {
  std::string host;
  int64_t pid = 0;
  std::string started;  ///< UTC, ISO 8601
  std::string config;   ///< the config file's name ("built-in" without --config)
  std::string command;  ///< "train", "bench", ...
  /// "pid 41 on host trainer-0 since 2026-11-26T10:00:00Z (train, config resnet50.yaml)", or
  /// "another process (it has not written its name yet)" when the file is still empty.
  std::string describe() const;
};

/// How a process takes a run folder.
struct RunLockOptions {
  std::string config;              ///< recorded in the lock file
  std::string command = "train";   ///< recorded in the lock file
  double wait_s = 0;               ///< 0: refuse at once when held; > 0: wait up to this long
  double report_every_s = 5;       ///< while waiting, one line this often
  double poll_every_s = 0.25;      ///< while waiting, how often the lock is tried
  /// While waiting: called with the holder and the seconds waited, every report_every_s. Default: a log
  /// line. Tests and torchrun's other ranks replace it.
  std::function<void(const RunFolderHolder&, double waited_s)> on_wait;
};

/// Thrown when the folder is held by another process (after the wait, if any). The message is the one
/// line a user sees: the folder, the holder, and what to do.
struct RunFolderBusy : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class RunFolderLock {
 public:
  /// Creates the folder if needed and takes its lock: at once, or waiting up to opts.wait_s. Throws
  /// RunFolderBusy when another process holds it, std::runtime_error when the folder or the lock file
  /// cannot be created. A file system that does not support locks is a warning, and no lock is held.
  static std::shared_ptr<RunFolderLock> acquire(const std::string& dir, const RunLockOptions& opts);

  /// One non-blocking try: the lock, or nullptr with *holder filled in when another process holds it.
  static std::shared_ptr<RunFolderLock> try_acquire(const std::string& dir, const RunLockOptions& opts,
                                                    RunFolderHolder* holder);

  /// Whether another process holds `dir` now, and who (never takes the lock for longer than the test).
  /// nullopt: free, or held by this process.
  static std::optional<RunFolderHolder> held_by_other(const std::string& dir);

  /// The holder as the lock file says, whether or not the lock is held now (nullopt: no file, or it
  /// cannot be read).
  static std::optional<RunFolderHolder> read_holder(const std::string& dir);

  /// The one line for a folder held by `holder`.
  static std::string busy_message(const std::string& dir, const RunFolderHolder& holder, double waited_s);

  ~RunFolderLock();
  RunFolderLock(const RunFolderLock&) = delete;
  RunFolderLock& operator=(const RunFolderLock&) = delete;

  const std::string& dir() const { return dir_; }
  bool held() const { return fd_ >= 0; }  ///< false where the file system has no locks (warned)

 private:
  RunFolderLock(std::string dir, int fd, uint64_t dev, uint64_t ino) : dir_(std::move(dir)), fd_(fd), dev_(dev), ino_(ino) {}
  std::string dir_;
  int fd_ = -1;
  uint64_t dev_ = 0, ino_ = 0;  // the folder's identity, the key of this process's table of held folders
};

}  // namespace trainer
