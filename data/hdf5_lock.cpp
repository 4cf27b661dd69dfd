#include "data/hdf5_lock.h"

namespace data {

std::mutex& hdf5_lock() {
  // A function-local static: constructed on first use, so it exists before any static initializer that
  // might open a file.
  static std::mutex m;
  return m;
}

void H5Handle::reset() {
  if (id_ >= 0 && close_) close_(id_);
  id_ = -1;
}

H5Quiet::H5Quiet() {
  H5Eget_auto2(H5E_DEFAULT, &func_, &data_);
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}

H5Quiet::~H5Quiet() { H5Eset_auto2(H5E_DEFAULT, func_, data_); }

}  // namespace data
