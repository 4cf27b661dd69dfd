#include "data/files/token_h5.h"

#include "common/files.h"
#include "data/files/hdf5_lock.h"
#include "data/files/text_input.h"

#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <type_traits>

// The header stores handles as int64_t to keep hdf5.h out of it.
static_assert(std::is_same<hid_t, int64_t>::value, "hid_t must be int64_t (HDF5 >= 1.10)");

namespace data {
namespace {

namespace fs = std::filesystem;
using Lock = std::lock_guard<std::mutex>;

// ---- HDF5 helpers (call with hdf5_lock() held) ---------------------------------------------------------

// A problem found while holding the lock; public entry points prefix the file's path.
struct H5Problem : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void check(herr_t status, const std::string& what) {
  if (status < 0) throw H5Problem(what + " failed");
}
hid_t check_id(hid_t id, const std::string& what) {
  if (id < 0) throw H5Problem(what + " failed");
  return id;
}

void write_string_attr(hid_t loc, const char* name, const std::string& value) {
  H5Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
  check(H5Tset_size(type.get(), H5T_VARIABLE), "string type");
  check(H5Tset_cset(type.get(), H5T_CSET_UTF8), "string type");
  H5Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  H5Handle attr(check_id(H5Acreate2(loc, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT),
                         std::string("creating attribute '") + name + "'"),
                H5Aclose);
  const char* p = value.c_str();
  check(H5Awrite(attr.get(), type.get(), &p), std::string("writing attribute '") + name + "'");
}

// A scalar string attribute, variable or fixed length (h5py writes the former, some tools the latter).
std::string read_string_attr(hid_t loc, const char* name) {
  H5Handle attr(check_id(H5Aopen(loc, name, H5P_DEFAULT), std::string("opening attribute '") + name + "'"), H5Aclose);
  H5Handle type(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(type.get()) != H5T_STRING) throw H5Problem(std::string("attribute '") + name + "' is not a string");
  H5Handle space(H5Aget_space(attr.get()), H5Sclose);
  if (H5Sget_simple_extent_npoints(space.get()) != 1) {
    throw H5Problem(std::string("attribute '") + name + "' is not a single string");
  }
  if (H5Tis_variable_str(type.get()) > 0) {
    H5Handle mem(H5Tcopy(H5T_C_S1), H5Tclose);
    check(H5Tset_size(mem.get(), H5T_VARIABLE), "string type");
    check(H5Tset_cset(mem.get(), H5Tget_cset(type.get())), "string type");
    char* s = nullptr;
    check(H5Aread(attr.get(), mem.get(), &s), std::string("reading attribute '") + name + "'");
    std::string out = s ? s : "";
    H5free_memory(s);
    return out;
  }
  const size_t n = H5Tget_size(type.get());
  std::string buf(n, '\0');
  H5Handle mem(H5Tcopy(H5T_C_S1), H5Tclose);
  check(H5Tset_size(mem.get(), n), "string type");
  // HDF5 converts no string between character sets: the memory type takes the file's (ASCII or UTF-8).
  check(H5Tset_cset(mem.get(), H5Tget_cset(type.get())), "string type");
  check(H5Aread(attr.get(), mem.get(), buf.data()), std::string("reading attribute '") + name + "'");
  return buf.substr(0, buf.find('\0'));
}

int64_t read_int_attr(hid_t loc, const char* name) {
  H5Handle attr(check_id(H5Aopen(loc, name, H5P_DEFAULT), std::string("opening attribute '") + name + "'"), H5Aclose);
  H5Handle type(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(type.get()) != H5T_INTEGER) throw H5Problem(std::string("attribute '") + name + "' is not an integer");
  int64_t v = 0;
  check(H5Aread(attr.get(), H5T_NATIVE_INT64, &v), std::string("reading attribute '") + name + "'");
  return v;
}

// Checks the root attributes `format` and `format_version` of a trainer.tokens file.
void check_tokens_format(hid_t file) {
  if (!h5_has_attr(file, "format")) {
    throw H5Problem("no root attribute 'format'; expected a trainer.tokens file (docs/TRANSFORMERS.md)");
  }
  const std::string format = read_string_attr(file, "format");
  if (format != kTokensFormat) {
    throw H5Problem("format is '" + format + "', expected '" + kTokensFormat + "' (docs/TRANSFORMERS.md)");
  }
  if (!h5_has_attr(file, "format_version")) throw H5Problem("no root attribute 'format_version'");
  const int64_t version = read_int_attr(file, "format_version");
  if (version != kTokensVersion) {
    throw H5Problem("format_version " + std::to_string(version) + " is not supported (this build reads " +
                    std::to_string(kTokensVersion) + ")");
  }
}

// The root attribute `vocab_size`, checked to be in [1, 2^31).
int64_t read_tokens_vocab_size(hid_t file) {
  if (!h5_has_attr(file, "vocab_size")) throw H5Problem("no root attribute 'vocab_size'");
  const int64_t vocab = read_int_attr(file, "vocab_size");
  if (vocab < 1 || vocab > INT32_MAX) throw H5Problem("vocab_size " + std::to_string(vocab) + " is not in [1, 2^31)");
  return vocab;
}

// What /tokens holds: its element type and its number of tokens.
struct TokensDatasetLayout {
  bool is_u16 = true;
  hsize_t n = 0;
};

// Checks that /tokens is a 1-D uint16 or int32 dataset whose extent the file really stores.
TokensDatasetLayout check_tokens_dataset(hid_t file, hid_t dset) {
  H5Handle type(H5Dget_type(dset), H5Tclose);
  H5Handle space(H5Dget_space(dset), H5Sclose);
  const bool is_u16 = H5Tget_class(type.get()) == H5T_INTEGER && H5Tget_size(type.get()) == 2 &&
                      H5Tget_sign(type.get()) == H5T_SGN_NONE;
  const bool is_i32 = H5Tget_class(type.get()) == H5T_INTEGER && H5Tget_size(type.get()) == 4 &&
                      H5Tget_sign(type.get()) == H5T_SGN_2;
  if (H5Sget_simple_extent_ndims(space.get()) != 1 || !(is_u16 || is_i32)) {
    throw H5Problem("/tokens must be a 1-D uint16 or int32 dataset");
  }
  // Before anything of the claimed size is allocated (the in-memory copy, the loader's window order).
  if (auto problem = dataset_size_problem(file, dset, "tokens"); !problem.empty()) throw H5Problem(problem);
  TokensDatasetLayout layout;
  layout.is_u16 = is_u16;
  H5Sget_simple_extent_dims(space.get(), &layout.n, nullptr);
  return layout;
}

// Reads all n tokens of /tokens into `u16` (a uint16 dataset) or `i32`.
void read_all_tokens(hid_t dset, hsize_t n, bool is_u16, std::vector<uint16_t>& u16, std::vector<int32_t>& i32) {
  try {
    if (is_u16) u16.resize(n);
    else i32.resize(n);
  } catch (const std::bad_alloc&) {
    throw H5Problem("cannot hold its " + std::to_string(n) + " tokens in memory");
  }
  void* dst = is_u16 ? static_cast<void*>(u16.data()) : static_cast<void*>(i32.data());
  if (n > 0) check(H5Dread(dset, is_u16 ? H5T_NATIVE_UINT16 : H5T_NATIVE_INT32, H5S_ALL, H5S_ALL,
                           H5P_DEFAULT, dst),
                   "reading /tokens");
}

// Checks that every token read into memory is in [0, vocab); `where` prefixes the error.
template <typename T>
void check_tokens_in_vocab(const std::string& where, const std::vector<T>& tokens, int64_t vocab) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int64_t t = tokens[i];
    if (t < 0 || t >= vocab) {
      throw std::runtime_error(where + "token " + std::to_string(t) + " at position " + std::to_string(i) +
                               " is outside [0, vocab_size = " + std::to_string(vocab) + ")");
    }
  }
}



}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Writer

TokenWriter::TokenWriter(std::string path, int64_t vocab_size, std::string source)
    : path_(std::move(path)), tmp_(path_ + ".tmp"), source_(std::move(source)), vocab_(vocab_size) {
  if (vocab_ < 1 || vocab_ > INT32_MAX) {
    throw std::invalid_argument("token file '" + path_ + "': vocab_size must be in [1, 2^31), got " +
                                std::to_string(vocab_));
  }
  Lock lock(hdf5_lock());
  H5Quiet quiet;
  H5Handle file(H5Fcreate(tmp_.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
  if (!file.valid()) {
    throw std::runtime_error("token file '" + path_ + "': cannot create '" + tmp_ +
                             "' (does the folder exist and is it writable?)");
  }
  const hsize_t dims = 0, maxdims = H5S_UNLIMITED, chunk = kTokensChunk;
  H5Handle space(H5Screate_simple(1, &dims, &maxdims), H5Sclose);
  H5Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  H5Pset_chunk(dcpl.get(), 1, &chunk);
  const hid_t type = vocab_ <= 65536 ? H5T_STD_U16LE : H5T_STD_I32LE;
  H5Handle dset(H5Dcreate2(file.get(), "tokens", type, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT), H5Dclose);
  if (!dset.valid()) throw std::runtime_error("token file '" + path_ + "': cannot create dataset /tokens in '" + tmp_ + "'");
  dset_ = dset.release();
  file_ = file.release();
}

TokenWriter::~TokenWriter() {
  if (finished_) return;
  {
    Lock lock(hdf5_lock());
    if (dset_ >= 0) H5Dclose(dset_);
    if (file_ >= 0) H5Fclose(file_);
  }
  std::error_code ec;
  fs::remove(tmp_, ec);
}

void TokenWriter::append(const int64_t* tokens, int64_t n) {
  TORCH_CHECK(!finished_, "TokenWriter '", path_, "': append after finish");
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab_) {
      throw std::invalid_argument("token file '" + path_ + "': token " + std::to_string(tokens[i]) +
                                  " at position " + std::to_string(written_ + buffer_.size() + i) +
                                  " is outside [0, vocab_size = " + std::to_string(vocab_) + ")");
    }
  }
  buffer_.insert(buffer_.end(), tokens, tokens + n);
  if (static_cast<int64_t>(buffer_.size()) >= 16 * kTokensChunk) flush();
}

void TokenWriter::flush() {
  if (buffer_.empty()) return;
  // Narrowed here rather than by HDF5's conversion, which would clip out-of-range values silently (they
  // cannot occur: append() checked them).
  std::vector<uint16_t> u16;
  std::vector<int32_t> i32;
  const bool small = vocab_ <= 65536;
  if (small) u16.assign(buffer_.begin(), buffer_.end());
  else i32.assign(buffer_.begin(), buffer_.end());

  Lock lock(hdf5_lock());
  H5Quiet quiet;
  const hsize_t start = written_, count = buffer_.size(), size = start + count;
  try {
    check(H5Dset_extent(dset_, &size), "extending /tokens");
    H5Handle fspace(H5Dget_space(dset_), H5Sclose);
    check(H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, &start, nullptr, &count, nullptr), "selecting tokens");
    H5Handle mspace(H5Screate_simple(1, &count, nullptr), H5Sclose);
    check(H5Dwrite(dset_, small ? H5T_NATIVE_UINT16 : H5T_NATIVE_INT32, mspace.get(), fspace.get(), H5P_DEFAULT,
                   small ? static_cast<const void*>(u16.data()) : static_cast<const void*>(i32.data())),
          "writing tokens");
  } catch (const H5Problem& e) {
    throw std::runtime_error("token file '" + path_ + "': " + e.what() + " (disk full?)");
  }
  written_ += static_cast<int64_t>(count);
  buffer_.clear();
}

int64_t TokenWriter::finish() {
  TORCH_CHECK(!finished_, "TokenWriter '", path_, "': finish called twice");
  flush();
  {
    Lock lock(hdf5_lock());
    H5Quiet quiet;
    try {
      write_string_attr(file_, "format", kTokensFormat);
      h5_write_int64(file_, "format_version", kTokensVersion);
      h5_write_int64(file_, "vocab_size", vocab_);
      write_string_attr(file_, "source", source_);
      if (!tokenizer_.empty()) {
        write_string_attr(file_, "tokenizer", tokenizer_);
        write_string_attr(file_, "tokenizer_path", tokenizer_path_);
      }
    } catch (const std::runtime_error& e) {  // H5Problem, or H5FormatError from h5_write_int64
      throw std::runtime_error("token file '" + path_ + "': " + e.what());
    }
    H5Dclose(dset_);
    dset_ = -1;
    const herr_t closed = H5Fclose(file_);
    file_ = -1;
    if (closed < 0) throw std::runtime_error("token file '" + path_ + "': closing '" + tmp_ + "' failed (disk full?)");
  }
  std::error_code ec;
  fs::rename(tmp_, path_, ec);
  if (ec) throw std::runtime_error("token file: cannot rename '" + tmp_ + "' to '" + path_ + "': " + ec.message());
  finished_ = true;
  return written_;
}

int64_t write_tokens(const std::string& path, const std::vector<int64_t>& tokens, int64_t vocab_size,
                     const std::string& source) {
  TokenWriter w(path, vocab_size, source);
  w.append(tokens);
  return w.finish();
}

// ---------------------------------------------------------------------------------------------------------
// Converters

std::string TokenConversion::summary() const {
  std::ostringstream s;
  s << files.size() << (files.size() == 1 ? " file, " : " files, ") << bytes_text(bytes) << ": "
    << train_path << " " << train_tokens << " tokens";
  if (!val_path.empty()) s << ", " << val_path << " " << val_tokens << " tokens";
  s << (tokenizer.empty() ? std::string(" (vocab 256)") : " (" + tokenizer + ", vocab " + std::to_string(vocab_size) + ")");
  if (replaced > 0) s << "; " << replaced << " invalid UTF-8 sequence" << (replaced == 1 ? "" : "s") << " replaced by U+FFFD";
  return s.str();
}


TokenConversion convert_text(const std::vector<std::string>& files_or_dirs, const std::string& out_dir,
                             double val_fraction, const TextOptions& options) {
  if (!(val_fraction >= 0 && val_fraction < 1)) {
    std::ostringstream got;
    got << val_fraction;
    throw std::invalid_argument("convert-text: val_fraction must be in [0, 1), got " + got.str());
  }
  if (options.tokenizer && !options.tokenizer->is_bytes()) return convert_text_bpe(files_or_dirs, out_dir, val_fraction, options);
  TokenConversion r;
  r.files = text_files(files_or_dirs);
  const std::vector<TextInput> inputs = plan_text_inputs(r.files);
  int64_t total = 0;
  for (const auto& in : inputs) total += in.bytes;
  if (total == 0) throw std::invalid_argument("convert-text: the input files are all empty");

  const int64_t val = static_cast<int64_t>(std::llround(val_fraction * static_cast<double>(total)));
  const int64_t train = total - val;
  fs::create_directories(out_dir);
  r.train_path = (fs::path(out_dir) / "train.h5").string();
  if (val_fraction > 0) r.val_path = (fs::path(out_dir) / "val.h5").string();
  const std::string source = "bytes of " + std::to_string(r.files.size()) + " text files (" + r.files.front() +
                             (r.files.size() > 1 ? " ... " + r.files.back() : std::string()) + ")";
  TokenWriter train_w(r.train_path, 256, source + ", first " + std::to_string(train) + " bytes");
  std::unique_ptr<TokenWriter> val_w;
  if (!r.val_path.empty()) val_w = std::make_unique<TokenWriter>(r.val_path, 256, source + ", last " + std::to_string(val) + " bytes");

  // Never more than `total` bytes arrive, so bytes past the training split exist only when val > 0.
  int64_t seen = 0;
  std::vector<int64_t> tokens;
  auto emit = [&](const char* bytes, int64_t n) {
    tokens.resize(n);
    for (int64_t i = 0; i < n; ++i) tokens[i] = static_cast<unsigned char>(bytes[i]);
    const int64_t to_train = std::clamp<int64_t>(train - seen, 0, n);
    train_w.append(tokens.data(), to_train);
    if (n > to_train) val_w->append(tokens.data() + to_train, n - to_train);
    seen += n;
  };
  std::vector<char> buf(1 << 20);
  for (const auto& in : inputs) stream_text(in, buf, emit);
  r.train_tokens = train_w.finish();
  if (val_w) r.val_tokens = val_w->finish();
  r.bytes = total;
  return r;
}

int64_t convert_uint16_bin(const std::string& path, int64_t vocab_size, const std::string& out) {
  if (const auto kind = trainer::not_a_regular_file(path); !kind.empty())
    throw std::invalid_argument("convert-bin: '" + path + "' " + kind);
  std::error_code ec;
  const auto bytes = fs::file_size(path, ec);
  if (ec) throw std::invalid_argument("convert-bin: cannot read '" + path + "': " + ec.message());
  if (bytes % 2 != 0) {
    throw std::invalid_argument("convert-bin: '" + path + "' has an odd size (" +
                                bytes_text(static_cast<int64_t>(bytes)) + "); expected raw uint16 tokens");
  }
  if (vocab_size < 1 || vocab_size > 65536) {
    throw std::invalid_argument("convert-bin: vocab_size must be in [1, 65536], got " + std::to_string(vocab_size));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument("convert-bin: cannot open '" + path + "'");
  TokenWriter w(out, vocab_size, "uint16 tokens of " + path);
  std::vector<unsigned char> buf(2 << 20);
  std::vector<int64_t> tokens;
  int64_t seen = 0;
  while (in) {
    in.read(reinterpret_cast<char*>(buf.data()), static_cast<std::streamsize>(buf.size()));
    const int64_t n = in.gcount() / 2;
    tokens.resize(n);
    for (int64_t i = 0; i < n; ++i) tokens[i] = buf[2 * i] | (buf[2 * i + 1] << 8);  // little-endian
    for (int64_t i = 0; i < n; ++i) {
      if (tokens[i] >= vocab_size) {
        throw std::invalid_argument("convert-bin: token " + std::to_string(tokens[i]) + " at position " +
                                    std::to_string(seen + i) + " of '" + path + "' is >= vocab_size " +
                                    std::to_string(vocab_size));
      }
    }
    w.append(tokens.data(), n);
    seen += n;
  }
  return w.finish();
}

// ---------------------------------------------------------------------------------------------------------
// Reader

TokenDataset::TokenDataset(const std::string& path, bool in_memory) : path_(path), in_memory_(in_memory) {
  const std::string where = "token file '" + path + "': ";
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw std::runtime_error(where + "no such file (make one with `trainer convert-text` or `trainer convert-bin`; "
                                     "docs/TRANSFORMERS.md)");
  }
  if (const auto kind = trainer::not_a_regular_file(path); !kind.empty()) throw std::runtime_error(where + kind);
  Lock lock(hdf5_lock());
  H5Quiet quiet;
  if (H5Fis_hdf5(path.c_str()) <= 0) throw std::runtime_error(where + "not an HDF5 file");
  H5Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!file.valid()) throw std::runtime_error(where + "cannot open the HDF5 file");
  try {
    check_tokens_format(file.get());
    vocab_ = read_tokens_vocab_size(file.get());
    if (h5_has_attr(file.get(), "source")) source_ = read_string_attr(file.get(), "source");
    if (h5_has_attr(file.get(), "tokenizer")) tokenizer_ = read_string_attr(file.get(), "tokenizer");
    if (h5_has_attr(file.get(), "tokenizer_path")) tokenizer_path_ = read_string_attr(file.get(), "tokenizer_path");

    if (H5Lexists(file.get(), "tokens", H5P_DEFAULT) <= 0) throw H5Problem("no dataset /tokens");
    H5Handle dset(H5Dopen2(file.get(), "tokens", H5P_DEFAULT), H5Dclose);
    if (!dset.valid()) throw H5Problem("/tokens is not a dataset");
    const TokensDatasetLayout layout = check_tokens_dataset(file.get(), dset.get());
    uint16_ = layout.is_u16;
    size_ = static_cast<int64_t>(layout.n);
    if (in_memory_) {
      read_all_tokens(dset.get(), layout.n, uint16_, u16_, i32_);
    } else {
      dset_ = dset.release();
      file_ = file.release();
    }
  } catch (const H5Problem& e) {
    throw std::runtime_error(where + e.what());
  }
  if (in_memory_) {
    // Checked once here, so read() from memory needs no check.
    if (uint16_) check_tokens_in_vocab(where, u16_, vocab_);
    else check_tokens_in_vocab(where, i32_, vocab_);
  }
}

TokenDataset::~TokenDataset() {
  if (dset_ < 0 && file_ < 0) return;
  Lock lock(hdf5_lock());
  if (dset_ >= 0) H5Dclose(dset_);
  if (file_ >= 0) H5Fclose(file_);
}

void TokenDataset::read(int64_t begin, int64_t n, int64_t* out) const {
  if (begin < 0 || n < 0 || begin + n > size_) {
    throw std::out_of_range("token file '" + path_ + "': tokens [" + std::to_string(begin) + ", " +
                            std::to_string(begin + n) + ") are outside [0, " + std::to_string(size_) + ")");
  }
  if (n == 0) return;
  if (in_memory_) {
    if (uint16_) std::copy(u16_.begin() + begin, u16_.begin() + begin + n, out);
    else std::copy(i32_.begin() + begin, i32_.begin() + begin + n, out);
    return;
  }
  {
    Lock lock(hdf5_lock());
    H5Quiet quiet;
    const hsize_t start = begin, count = n;
    H5Handle fspace(H5Dget_space(dset_), H5Sclose);
    H5Handle mspace(H5Screate_simple(1, &count, nullptr), H5Sclose);
    if (H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, &start, nullptr, &count, nullptr) < 0 ||
        H5Dread(dset_, H5T_NATIVE_INT64, mspace.get(), fspace.get(), H5P_DEFAULT, out) < 0) {
      throw std::runtime_error("token file '" + path_ + "': reading tokens [" + std::to_string(begin) + ", " +
                               std::to_string(begin + n) + ") failed");
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (out[i] < 0 || out[i] >= vocab_) {
      throw std::runtime_error("token file '" + path_ + "': token " + std::to_string(out[i]) + " at position " +
                               std::to_string(begin + i) + " is outside [0, vocab_size = " + std::to_string(vocab_) +
                               ")");
    }
  }
}

}  // namespace data
