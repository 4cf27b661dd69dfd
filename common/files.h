// Paths a user names as files, looked at before they are opened.
//
// Opening a named pipe (FIFO) for reading waits until some process opens it for writing, which may be
// never; a character device (/dev/zero) has no end and no size; a socket cannot be opened at all. A reader
// that sizes, maps, seeks in or rereads a file (weights, checkpoints, HDF5 splits, memory curves, data
// files) asks first what the path is. stat() follows links and opens nothing, so it never blocks: such a
// path is refused at once, with one line naming what it is.
//
// Readers that take a stream (a config, compare's inputs) read a FIFO as the stream it is and do not
// call this: there, waiting for the writer is right (`--config <(make-config)`).
#pragma once

#include <string>

namespace trainer {

/// "" when `path` is a regular file (after links) or cannot be looked at (it does not exist, a folder on
/// the way cannot be searched: the open that follows names that error). Otherwise what it is, written to
/// follow the path: "is a named pipe (FIFO), not a regular file", "is a socket, ...", "is a character
/// device, ...", "is a block device, ...", "is a directory, ...".
std::string not_a_regular_file(const std::string& path);

/// Throws std::runtime_error("<what> '<path>' <not_a_regular_file(path)>") when that is not "".
void require_regular_file(const std::string& path, const std::string& what);

/// Writes `bytes` to `path` through "<path>.tmp", renamed over it when complete: a failed write (a full
/// disk, a folder that cannot be written) never leaves a truncated file under the final name, and the
/// temporary file is removed. Throws std::runtime_error "<what>: cannot write <path>", with the reason in
/// parentheses where the system gives one. (eval's JSON, export's weight files, sample's JSON.)
void write_file_atomically(const std::string& path, const std::string& bytes, const std::string& what);

}  // namespace trainer
