#include "data/hdf5_lock.h"

#include <algorithm>
#include <vector>

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

std::string dataset_size_problem(hid_t file, hid_t dset, const std::string& name) {
  H5Handle space(H5Dget_space(dset), H5Sclose);
  H5Handle type(H5Dget_type(dset), H5Tclose);
  const int rank = space.valid() ? H5Sget_simple_extent_ndims(space.get()) : -1;
  if (rank < 0 || !type.valid()) return "cannot read the extent of dataset '" + name + "'";
  std::vector<hsize_t> dims(static_cast<size_t>(rank));
  H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  const uint64_t element = H5Tget_size(type.get());
  uint64_t claimed = element;
  bool overflow = false;
  std::string shape = "(";
  for (int d = 0; d < rank; ++d) {
    shape += (d ? ", " : "") + std::to_string(dims[d]);
    overflow = __builtin_mul_overflow(claimed, dims[d], &claimed) || overflow;
  }
  shape += ")";
  if (overflow) {
    return "dataset '" + name + "' claims " + shape + " elements of " + std::to_string(element) +
           " bytes, more than any file holds";
  }
  if (claimed == 0) return "";

  uint64_t ratio = 1;
  H5Handle dcpl(H5Dget_create_plist(dset), H5Pclose);
  const int filters = dcpl.valid() ? H5Pget_nfilters(dcpl.get()) : 0;
  for (int k = 0; k < filters; ++k) {
    unsigned flags = 0;
    size_t ncd = 0;
    const H5Z_filter_t f = H5Pget_filter2(dcpl.get(), static_cast<unsigned>(k), &flags, &ncd, nullptr, 0, nullptr, nullptr);
    if (f == H5Z_FILTER_DEFLATE) {
      if (__builtin_mul_overflow(ratio, uint64_t{1032}, &ratio)) return "";
    } else if (f != H5Z_FILTER_SHUFFLE && f != H5Z_FILTER_FLETCHER32) {
      return "";
    }
  }
  hsize_t file_bytes = 0;
  if (H5Fget_filesize(file, &file_bytes) < 0) return "cannot read the size of the file";
  const uint64_t stored = std::min<uint64_t>(H5Dget_storage_size(dset), file_bytes);
  uint64_t capacity = 0;
  if (__builtin_mul_overflow(stored, ratio, &capacity) || claimed <= capacity) return "";
  std::string msg = "dataset '" + name + "' claims " + shape + " = " + std::to_string(claimed) +
                    " bytes, but the file holds " + std::to_string(stored) + " bytes of it";
  if (ratio > 1) msg += " (compressed: at most " + std::to_string(capacity) + " bytes inflated)";
  return msg + "; the file has " + std::to_string(file_bytes) + " bytes: truncated, or a header that does not match its data";
}

}  // namespace data
