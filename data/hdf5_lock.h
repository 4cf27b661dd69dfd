// Debian's libhdf5 is the serial build, which is not thread-safe: every HDF5 call in the process, by any
// reader or writer, must be made while holding this one lock.
#pragma once

#include <mutex>

namespace data {

/// The process-wide lock around every HDF5 call.
std::mutex& hdf5_lock();

}  // namespace data
