// What every HDF5 user in data/ shares. Debian's libhdf5 is the serial build, which is not thread-safe:
// every HDF5 call in the process, by any reader or writer, must be made while holding the one lock
// below. Under that lock, H5Handle owns an identifier, H5Quiet keeps HDF5's error stack off stderr,
// dataset_size_problem() checks a dataset's extent against what the file really stores, and the h5_*
// helpers turn failed calls into H5FormatError and read and write root attributes.
#pragma once

// LibTorch first: 1.13's c10/util/variant.h calls an unqualified data(), which finds `namespace data`
// when that is declared before it; then a file that includes this header before LibTorch stops compiling.
#include <torch/torch.h>

#include <hdf5.h>

#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace data {

/// The process-wide lock around every HDF5 call.
std::mutex& hdf5_lock();

/// Owns an HDF5 identifier (file, dataset, dataspace, type, attribute, property list) and closes it with
/// the function given (H5Fclose, H5Dclose, ...) when destroyed or reset. A negative id means "none"
/// (a failed H5*open/create returns one), and nothing is closed for it. Closing is an HDF5 call: destroy
/// handles while hdf5_lock() is held, i.e. declare the lock guard before any handle so they go first.
class H5Handle {
 public:
  H5Handle() = default;
  H5Handle(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  ~H5Handle() { reset(); }
  H5Handle(const H5Handle&) = delete;
  H5Handle& operator=(const H5Handle&) = delete;

  hid_t get() const { return id_; }
  /// True for an id that is not negative.
  bool valid() const { return id_ >= 0; }
  /// Gives the id up without closing it (the caller closes it).
  hid_t release() {
    const hid_t r = id_;
    id_ = -1;
    return r;
  }
  /// Closes the id now (if any); the handle is then empty.
  void reset();

 private:
  hid_t id_ = -1;
  herr_t (*close_)(hid_t) = nullptr;
};

/// Turns HDF5's automatic error printing off for a scope and restores the previous handler after:
/// failures become one exception line of ours instead of a stack dump on stderr, and other HDF5 users
/// keep their setting. Construct and destroy it while hdf5_lock() is held.
class H5Quiet {
 public:
  H5Quiet();
  ~H5Quiet();
  H5Quiet(const H5Quiet&) = delete;
  H5Quiet& operator=(const H5Quiet&) = delete;

 private:
  H5E_auto2_t func_ = nullptr;
  void* data_ = nullptr;
};

/// Why dataset `dset` of `file` cannot hold what its extent claims, or "" when it can; `name` names it in
/// the message. The claim (every dimension times the element size) must fit in 64 bits, and the bytes the
/// file stores for the dataset (H5Dget_storage_size, at most the file's size) must cover it: all of it
/// without filters, and at most 1032 bytes per stored byte per deflate (gzip) filter, deflate's largest
/// ratio. A pipeline with other compressing filters (szip, nbit, scaleoffset, plugins), which the
/// trainer's writers never use, is not bounded here. Call it before allocating anything of the claimed
/// size: a truncated file or a chunked dataset whose data was never written then costs no memory.
/// Call with hdf5_lock() held.
std::string dataset_size_problem(hid_t file, hid_t dset, const std::string& name);

/// A problem with a file's contents found by the helpers below; the readers catch it and prefix the
/// file's name.
struct H5FormatError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The most specific message on HDF5's error stack (the stack is then cleared).
std::string h5_error();

/// Throws H5FormatError("<what>: <h5_error()>") for a negative status or identifier.
void h5_check(herr_t status, const std::string& what);
hid_t h5_check_id(hid_t id, const std::string& what);

/// Whether `loc` has an attribute `name`.
bool h5_has_attr(hid_t loc, const char* name);
/// Attribute `name` of `loc`; H5FormatError "missing root attribute '<name>'" when there is none.
H5Handle h5_open_attr(hid_t loc, const char* name);
/// Writes a scalar little-endian int64 attribute.
void h5_write_int64(hid_t loc, const char* name, int64_t value);
/// Its number of elements.
int64_t h5_attr_points(hid_t attr);
/// A string attribute, scalar or 1-D, variable or fixed length (as h5py and h5py-like tools write).
std::vector<std::string> h5_read_strings(hid_t loc, const char* name);
/// Writes variable-length UTF-8 strings (what h5py reads as str), a scalar or a 1-D attribute.
void h5_write_strings(hid_t loc, const char* name, const std::vector<std::string>& values, bool scalar);

}  // namespace data
