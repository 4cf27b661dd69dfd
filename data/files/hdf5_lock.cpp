#include "data/files/hdf5_lock.h"

#include <algorithm>
#include <cstring>
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

std::string h5_error() {
  std::string msg;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned n, const H5E_error2_t* e, void* out) -> herr_t {
        if (n == 0 && e->desc) *static_cast<std::string*>(out) = e->desc;
        return 0;
      },
      &msg);
  H5Eclear2(H5E_DEFAULT);
  return msg.empty() ? "unknown HDF5 error" : msg;
}

void h5_check(herr_t status, const std::string& what) {
  if (status < 0) throw H5FormatError(what + ": " + h5_error());
}

hid_t h5_check_id(hid_t id, const std::string& what) {
  if (id < 0) throw H5FormatError(what + ": " + h5_error());
  return id;
}

bool h5_has_attr(hid_t loc, const char* name) { return H5Aexists(loc, name) > 0; }

H5Handle h5_open_attr(hid_t loc, const char* name) {
  if (H5Aexists(loc, name) <= 0) throw H5FormatError(std::string("missing root attribute '") + name + "'");
  return H5Handle(h5_check_id(H5Aopen(loc, name, H5P_DEFAULT), std::string("opening attribute '") + name + "'"),
                  H5Aclose);
}

void h5_write_int64(hid_t loc, const char* name, int64_t value) {
  H5Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  H5Handle attr(h5_check_id(H5Acreate2(loc, name, H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT),
                            std::string("creating attribute '") + name + "'"),
                H5Aclose);
  h5_check(H5Awrite(attr.get(), H5T_NATIVE_INT64, &value), std::string("writing attribute '") + name + "'");
}

int64_t h5_attr_points(hid_t attr) {
  H5Handle space(H5Aget_space(attr), H5Sclose);
  return static_cast<int64_t>(H5Sget_simple_extent_npoints(space.get()));
}

std::vector<std::string> h5_read_strings(hid_t loc, const char* name) {
  H5Handle attr = h5_open_attr(loc, name);
  H5Handle ftype(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(ftype.get()) != H5T_STRING) throw H5FormatError(std::string("root attribute '") + name + "' is not a string");
  const int64_t n = h5_attr_points(attr.get());
  std::vector<std::string> out;
  const std::string what = std::string("reading attribute '") + name + "'";
  if (H5Tis_variable_str(ftype.get()) > 0) {
    H5Handle mtype(H5Tcopy(H5T_C_S1), H5Tclose);
    h5_check(H5Tset_size(mtype.get(), H5T_VARIABLE), what);
    h5_check(H5Tset_cset(mtype.get(), H5Tget_cset(ftype.get())), what);
    std::vector<char*> ptrs(static_cast<size_t>(n), nullptr);
    h5_check(H5Aread(attr.get(), mtype.get(), ptrs.data()), what);
    for (char* p : ptrs) {
      out.emplace_back(p ? p : "");
      if (p) H5free_memory(p);
    }
  } else {
    const size_t len = H5Tget_size(ftype.get());
    std::vector<char> buf(static_cast<size_t>(n) * len);
    h5_check(H5Aread(attr.get(), ftype.get(), buf.data()), what);
    for (int64_t i = 0; i < n; ++i) out.emplace_back(buf.data() + i * len, strnlen(buf.data() + i * len, len));
  }
  return out;
}

void h5_write_strings(hid_t loc, const char* name, const std::vector<std::string>& values, bool scalar) {
  H5Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
  h5_check(H5Tset_size(type.get(), H5T_VARIABLE), "string type");
  h5_check(H5Tset_cset(type.get(), H5T_CSET_UTF8), "string type");
  const hsize_t n = values.size();
  H5Handle space(scalar ? H5Screate(H5S_SCALAR) : H5Screate_simple(1, &n, nullptr), H5Sclose);
  H5Handle attr(h5_check_id(H5Acreate2(loc, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT),
                            std::string("creating attribute '") + name + "'"),
                H5Aclose);
  std::vector<const char*> ptrs;
  for (const auto& v : values) ptrs.push_back(v.c_str());
  h5_check(H5Awrite(attr.get(), type.get(), ptrs.data()), std::string("writing attribute '") + name + "'");
}

}  // namespace data
