#include "data/hdf5_lock.h"

namespace data {

std::mutex& hdf5_lock() {
  // A function-local static: constructed on first use, so it exists before any static initializer that
  // might open a file.
  static std::mutex m;
  return m;
}

}  // namespace data
