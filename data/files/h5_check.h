// Checking an HDF5 file from outside in a child process before this process opens it (issue 16).
//
// Debian's libhdf5 1.10.8 crashes, aborts or loops forever on some corrupt files (fuzz/known/image_h5/,
// docs/FUZZING.md), inside the library, where no check of ours can come first. So the trainer first
// lets a child process open the file with the same reader (ImageH5Dataset, PackedImageDataset or
// TokenDataset), under a
// timeout and an address-space limit. A crash, a hang or an out-of-memory there becomes one error line
// naming the file; only a file the child read cleanly is opened here.
//
// The child is this executable again (posix_spawn of /proc/self/exe, never fork() of a multithreaded
// process), started with the hidden subcommand kH5CheckCommand. It initializes no GPU: it runs only the
// HDF5 reader, with CUDA_VISIBLE_DEVICES empty besides. docs/DATA.md has what it reads and costs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace data {

/// The hidden subcommand: `<exe> __check-h5 images|packed|tokens memory|file <parent pid> <path>`.
inline constexpr const char* kH5CheckCommand = "__check-h5";

/// Seconds added to H5CheckOptions::timeout_s per GiB of the file (reading from a disk at 50 MiB/s).
inline constexpr double kH5CheckSecondsPerGiB = 20;

enum class H5FileKind { images, packed_images, tokens };

struct H5CheckOptions {
  /// Which reader opens the file: ImageH5Dataset (images), PackedImageDataset (packed_images) or
  /// TokenDataset (tokens).
  H5FileKind kind = H5FileKind::images;
  /// The reads the parent will make: with in_memory every sample (or token) is read and checked, as the
  /// in-memory reader does; without, the metadata, the labels and the first and last samples (a packed
  /// file's first and last encoded images, undecoded; or tokens).
  bool in_memory = true;
  /// The child is killed timeout_s + kH5CheckSecondsPerGiB per GiB of the file after it began reading
  /// (its own process start is allowed 60 s more, and counts for nothing here).
  double timeout_s = 30;
  /// Appended to the timeout's message: how the user raises the limit.
  std::string timeout_hint;
};

/// What check_h5_file() did.
struct H5CheckResult {
  /// False when no child ran: the file passed an equal or stronger check in this process already (same
  /// path, size and modification time), the path is not a regular file (a FIFO would hold the child until
  /// its timeout; the reader refuses it at once, common/files.h), or this executable does not serve the
  /// check (see serve_h5_check).
  bool ran = false;
  /// Wall time from the spawn to the child's exit.
  double seconds = 0;
};

/// Checks `path` in a child process and returns when the child read it cleanly. Throws
/// std::runtime_error with one line otherwise: the reader's own refusal ("image file '<path>': ..." or
/// "token file '<path>': ..."), or what happened to the child ("libhdf5 crashed (SIGSEGV) reading the metadata of <path>: the file is
/// corrupt"; a timeout; running out of its address-space limit). No child outlives the call.
/// Thread-safe; the caller need not hold hdf5_lock() (this process makes no HDF5 call here).
H5CheckResult check_h5_file(const std::string& path, const H5CheckOptions& options);

/// Call first thing in main(). With argv[1] == kH5CheckCommand this process is the child: it checks the
/// file and returns the exit code for main to return (0 read cleanly, 2 refused, 3 out of memory).
/// Otherwise it returns nullopt and marks this executable as one that serves the check, which turns
/// check_h5_file() on: a program that never calls it (the test binary) opens files unchecked.
std::optional<int> serve_h5_check(int argc, char** argv);

}  // namespace data
