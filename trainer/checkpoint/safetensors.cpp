#include "trainer/checkpoint/safetensors.h"

#include "common/files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <unordered_set>

namespace trainer {
namespace {

struct DType {
  const char* name;
  at::ScalarType type;
  uint64_t size;
};

// The dtypes read and written: every dtype a PyTorch state dict of this project's models (and the
// checkpoints users bring) holds. The format also has unsigned 16-64-bit, 8/6/4-bit floats and C64.
constexpr DType kDTypes[] = {{"F64", at::kDouble, 8}, {"F32", at::kFloat, 4}, {"F16", at::kHalf, 2},
                             {"BF16", at::kBFloat16, 2}, {"I64", at::kLong, 8}, {"I32", at::kInt, 4},
                             {"I16", at::kShort, 2}, {"I8", at::kChar, 1}, {"U8", at::kByte, 1},
                             {"BOOL", at::kBool, 1}};
constexpr const char* kOtherFormatDTypes[] = {"U16", "U32", "U64", "F8_E4M3", "F8_E5M2", "F8_E8M0",
                                              "F6_E2M3", "F6_E3M2", "F4", "C64"};
constexpr size_t kMaxDims = 64;

const DType* dtype_named(const std::string& name) {
  for (const auto& d : kDTypes)
    if (name == d.name) return &d;
  return nullptr;
}

const DType* dtype_of(at::ScalarType t) {
  for (const auto& d : kDTypes)
    if (t == d.type) return &d;
  return nullptr;
}

std::string supported_dtypes() {
  std::string s;
  for (const auto& d : kDTypes) s += (s.empty() ? "" : ", ") + std::string(d.name);
  return s;
}

// Text from a hostile file goes into a one-line error: control and non-ASCII bytes escaped, length cut.
std::string printable(const std::string& s, size_t max = 120) {
  std::string out;
  for (size_t i = 0; i < s.size() && out.size() < max; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  if (out.size() >= max) out += "...";
  return out;
}

std::string shape_text(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// One header entry as parsed, before its checks against the data.
struct Entry {
  std::string name;
  const DType* dtype = nullptr;
  std::vector<uint64_t> shape;
  std::vector<uint64_t> offsets;
  bool has_dtype = false, has_shape = false, has_offsets = false;
};

/// A SAX handler for the header: builds the entries directly (no JSON tree, so a 100 MB header costs
/// about its own size), refuses duplicate names and fields at once (a JSON tree would keep the last
/// one silently), anything nested deeper than the format, and every value of the wrong type.
class HeaderParser {
 public:
  using json = nlohmann::json;
  explicit HeaderParser(std::string source) : source_(std::move(source)) {}

  std::vector<Entry> entries;
  SafetensorsMetadata metadata;

  // The parts of the header: the top-level object, a tensor's object, __metadata__, and one of a
  // tensor's two lists.
  enum class At { start, root, tensor, metadata, list, done };

  bool null() { return scalar("null"); }
  bool boolean(bool) { return scalar("a boolean"); }
  bool number_integer(json::number_integer_t v) {
    if (at_ == At::list) fail("tensor '" + printable(entry().name) + "': " + field_ + " holds the negative number " + std::to_string(v));
    return scalar("a number");
  }
  bool number_unsigned(json::number_unsigned_t v) {
    if (at_ != At::list) return scalar("a number");
    auto& list = field_ == "shape" ? entry().shape : entry().offsets;
    if (list.size() >= (field_ == "shape" ? kMaxDims : 2))
      fail("tensor '" + printable(entry().name) + "': " + field_ +
           (field_ == "shape" ? " has more than " + std::to_string(kMaxDims) + " dimensions" : " has more than 2 numbers"));
    list.push_back(v);
    return true;
  }
  bool number_float(json::number_float_t, const std::string& text) {
    if (at_ == At::list)
      fail("tensor '" + printable(entry().name) + "': " + field_ + " holds " + printable(text) +
           ", not an integer from 0 to 2^64-1");
    return scalar("a number");
  }
  bool string(std::string& v) {
    if (at_ == At::metadata) {
      metadata[key_] = v;
      return true;
    }
    if (at_ == At::tensor && field_ == "dtype") {
      entry().dtype = dtype_named(v);
      if (!entry().dtype) {
        const bool other = std::any_of(std::begin(kOtherFormatDTypes), std::end(kOtherFormatDTypes),
                                       [&](const char* d) { return v == d; });
        fail("tensor '" + printable(entry().name) + "' has " +
             (other ? "dtype " + v + ", which the trainer does not read"
                    : "an unknown dtype '" + printable(v) + "'") +
             " (read: " + supported_dtypes() + ")");
      }
      return true;
    }
    return scalar("a string");
  }
  bool binary(json::binary_t&) { return scalar("binary data"); }

  bool start_object(std::size_t) {
    switch (at_) {
      case At::start: at_ = At::root; return true;
      case At::root:
        at_ = key_ == "__metadata__" ? At::metadata : At::tensor;
        return true;
      default: return scalar("an object");
    }
  }
  bool key(std::string& k) {
    if (at_ == At::root) {
      if (!names_.insert(k).second) fail("the name '" + printable(k) + "' appears twice in the header");
      key_ = k;
      if (k != "__metadata__") {
        entries.emplace_back();
        entries.back().name = k;
      }
      return true;
    }
    if (at_ == At::metadata) {
      if (metadata.count(k)) fail("__metadata__ has the key '" + printable(k) + "' twice");
      key_ = k;
      return true;
    }
    // a tensor's fields
    Entry& e = entry();
    bool* seen = k == "dtype" ? &e.has_dtype : k == "shape" ? &e.has_shape : k == "data_offsets" ? &e.has_offsets : nullptr;
    if (!seen) fail("tensor '" + printable(e.name) + "' has an unknown field '" + printable(k) + "' (fields: dtype, shape, data_offsets)");
    if (*seen) fail("tensor '" + printable(e.name) + "' has the field '" + k + "' twice");
    *seen = true;
    field_ = k;
    return true;
  }
  bool end_object() {
    if (at_ == At::tensor) {
      const Entry& e = entry();
      if (!e.has_dtype || !e.has_shape || !e.has_offsets)
        fail("tensor '" + printable(e.name) + "' lacks " + (!e.has_dtype ? "dtype" : !e.has_shape ? "shape" : "data_offsets"));
      if (e.offsets.size() != 2) fail("tensor '" + printable(e.name) + "': data_offsets must be two numbers [begin, end]");
    }
    at_ = at_ == At::root ? At::done : At::root;
    return true;
  }
  bool start_array(std::size_t) {
    if (at_ == At::tensor && (field_ == "shape" || field_ == "data_offsets")) {
      at_ = At::list;
      return true;
    }
    return scalar("a list");
  }
  bool end_array() {
    at_ = At::tensor;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) {
    // ex.what(): "[json.exception.parse_error.101] parse error at line 1, column 7: syntax error ..."
    std::string what = ex.what();
    const auto bracket = what.find("] ");
    if (bracket != std::string::npos) what = what.substr(bracket + 2);
    fail("the header is not valid JSON: " + printable(what, 200));
  }

 private:
  // A value where the format has none of its kind.
  bool scalar(const std::string& what) {
    switch (at_) {
      case At::start: fail("the header is " + what + ", not a JSON object");
      case At::root:
        fail(key_ == "__metadata__" ? "__metadata__ is " + what + ", not an object of strings"
                                    : "the entry '" + printable(key_) + "' is " + what + ", not an object with dtype, shape and data_offsets");
      case At::metadata: fail("__metadata__'s value for '" + printable(key_) + "' is " + what + ", not a string");
      case At::tensor:
        fail("tensor '" + printable(entry().name) + "': " + field_ + " is " + what +
             (field_ == "dtype" ? ", not a string" : ", not a list of integers"));
      case At::list: fail("tensor '" + printable(entry().name) + "': " + field_ + " holds " + what + ", not an integer");
      case At::done: break;
    }
    fail("unexpected " + what + " after the header's object");
  }
  Entry& entry() { return entries.back(); }
  [[noreturn]] void fail(const std::string& what) const { throw std::runtime_error(source_ + ": not a valid safetensors file: " + what); }

  std::string source_;
  At at_ = At::start;
  std::string key_;    // the current top-level name, or __metadata__'s current key
  std::string field_;  // the current field of a tensor
  std::unordered_set<std::string> names_;
};

uint64_t le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int k = 7; k >= 0; --k) v = (v << 8) | p[k];
  return v;
}

// Throws the one-line error of a safetensors file that breaks a rule of the format.
[[noreturn]] void fail_safetensors(const std::string& source, const std::string& what) {
  throw std::runtime_error(source + ": not a valid safetensors file: " + what);
}

// The header length (the file's first 8 bytes), checked against the limit and the file's size.
uint64_t safetensors_header_length(const uint8_t* data, uint64_t size, const std::string& source) {
  auto fail = [&](const std::string& what) { fail_safetensors(source, what); };
  if (size < 8) fail("it has " + std::to_string(size) + " bytes, fewer than the 8-byte header length");
  const uint64_t n = le64(data);
  if (n > kSafetensorsMaxHeaderBytes)
    fail("the header length " + std::to_string(n) + " is over the limit of " + std::to_string(kSafetensorsMaxHeaderBytes) + " bytes");
  if (n > size - 8)
    fail("the header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(size) + " bytes)");
  return n;
}

// Checks that a tensor's data_offsets lie in the data and span the byte size of its dtype and shape.
void check_entry_extent(const Entry& e, uint64_t data_size, const std::string& source) {
  auto fail = [&](const std::string& what) { fail_safetensors(source, what); };
  const std::string name = "tensor '" + printable(e.name) + "'";
  uint64_t count = 1;
  for (uint64_t d : e.shape) {
    if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) || __builtin_mul_overflow(count, d, &count))
      fail(name + " has the shape " + shape_text(e.shape) + ", whose element count overflows 64 bits");
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(count, e.dtype->size, &bytes))
    fail(name + " has the shape " + shape_text(e.shape) + ", whose byte size overflows 64 bits");
  const uint64_t begin = e.offsets[0], end = e.offsets[1];
  if (begin > end) fail(name + " has data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "] that end before they begin");
  if (end > data_size)
    fail(name + " runs past the end of the file: its data_offsets end at " + std::to_string(end) + ", the data has " +
         std::to_string(data_size) + " bytes");
  if (end - begin != bytes)
    fail(name + " has data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "] spanning " +
         std::to_string(end - begin) + " bytes, but " + e.dtype->name + " " + shape_text(e.shape) + " takes " +
         std::to_string(bytes));
}

// The entries' indices in the order of their data (by begin, then end offset).
std::vector<size_t> entries_in_data_order(const std::vector<Entry>& entries) {
  std::vector<size_t> order(entries.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const auto& x = entries[a].offsets;
    const auto& y = entries[b].offsets;
    return x[0] != y[0] ? x[0] < y[0] : x[1] < y[1];
  });
  return order;
}

// Checks that the tensors' data, in `order`, lies back to back from 0 to the end of the data: no overlap, no gap.
void check_data_back_to_back(const std::vector<Entry>& entries, const std::vector<size_t>& order, uint64_t data_size,
                             const std::string& source) {
  auto fail = [&](const std::string& what) { fail_safetensors(source, what); };
  uint64_t expected = 0;
  const Entry* previous = nullptr;
  for (size_t i : order) {
    const Entry& e = entries[i];
    if (e.offsets[0] < expected)
      fail("the data of tensors '" + printable(previous->name) + "' and '" + printable(e.name) + "' overlap");
    if (e.offsets[0] > expected)
      fail("a gap of " + std::to_string(e.offsets[0] - expected) + " bytes before the data of tensor '" + printable(e.name) + "'");
    expected = e.offsets[1];
    previous = &e;
  }
  if (expected != data_size)
    fail("the tensors' data ends at byte " + std::to_string(expected) + " of " + std::to_string(data_size) +
         " (bytes after the last tensor)");
}

// The tensor of entry `e` over the data at `base`: aliasing it (keeping `keep` alive), or a copy if misaligned.
at::Tensor entry_tensor(const Entry& e, const uint8_t* base, const std::shared_ptr<void>& keep,
                        const std::string& source) {
  std::vector<int64_t> shape(e.shape.begin(), e.shape.end());
  const auto options = at::TensorOptions().dtype(e.dtype->type);
  const uint8_t* p = base + e.offsets[0];
  const uint64_t bytes = e.offsets[1] - e.offsets[0];
  if (e.dtype->type == at::kBool && std::any_of(p, p + bytes, [](uint8_t b) { return b > 1; }))
    fail_safetensors(source, "the BOOL tensor '" + printable(e.name) + "' holds a byte other than 0 or 1");
  at::Tensor t;
  if (bytes == 0) {
    t = torch::empty(shape, options);
  } else if (reinterpret_cast<uintptr_t>(p) % e.dtype->size == 0) {
    t = torch::from_blob(const_cast<uint8_t*>(p), shape, [keep](void*) {}, options);
  } else {  // misaligned for its dtype (another writer's layout): the one copy, into aligned memory
    t = torch::empty(shape, options);
    std::memcpy(t.data_ptr(), p, bytes);
  }
  return t;
}

// Parses and checks the file's bytes [data, data + size); the tensors alias them and keep `keep` alive.
SafetensorsContents parse(const uint8_t* data, uint64_t size, const std::shared_ptr<void>& keep, const std::string& source) {
  const uint64_t n = safetensors_header_length(data, size, source);

  HeaderParser header(source);
  const char* json_begin = reinterpret_cast<const char*>(data + 8);
  nlohmann::json::sax_parse(json_begin, json_begin + n, &header);

  // Each tensor's byte size, then their ranges in order: back to back from 0 to the end of the file.
  const uint64_t data_size = size - 8 - n;
  for (const Entry& e : header.entries) check_entry_extent(e, data_size, source);
  const std::vector<size_t> order = entries_in_data_order(header.entries);
  check_data_back_to_back(header.entries, order, data_size, source);

  SafetensorsContents out;
  out.metadata = std::move(header.metadata);
  out.tensors.reserve(order.size());
  const uint8_t* base = data + 8 + n;
  for (size_t i : order) {
    const Entry& e = header.entries[i];
    out.tensors.emplace_back(e.name, entry_tensor(e, base, keep, source));
  }
  return out;
}

// The whole file, written by one call of `sink` per piece: length, header, then each tensor once.
void emit(const NamedTensors& tensors, const SafetensorsMetadata& metadata,
          const std::function<void(const void*, size_t)>& sink) {
  struct Planned {
    const std::string* name;
    const at::Tensor* tensor;
    const DType* dtype;
  };
  std::vector<Planned> plan;
  std::unordered_set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    if (!t.defined()) throw std::runtime_error("write_safetensors: tensor '" + name + "' is undefined");
    if (name == "__metadata__") throw std::runtime_error("write_safetensors: '__metadata__' is not a tensor name");
    if (!seen.insert(name).second) throw std::runtime_error("write_safetensors: duplicate name '" + name + "'");
    const DType* d = dtype_of(t.scalar_type());
    if (!d)
      throw std::runtime_error("write_safetensors: tensor '" + name + "' has dtype " + std::string(c10::toString(t.scalar_type())) +
                               ", which is not written (written: " + supported_dtypes() + ")");
    plan.push_back({&name, &t, d});
  }
  // Largest elements first: every offset is then a multiple of the element size at it.
  std::stable_sort(plan.begin(), plan.end(), [](const Planned& a, const Planned& b) { return a.dtype->size > b.dtype->size; });

  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (const auto& p : plan) {
    const uint64_t bytes = static_cast<uint64_t>(p.tensor->numel()) * p.dtype->size;
    std::vector<int64_t> shape(p.tensor->sizes().begin(), p.tensor->sizes().end());
    header[*p.name] = {{"dtype", p.dtype->name}, {"shape", shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {  // a name or metadata string that is not UTF-8
    throw std::runtime_error(std::string("write_safetensors: a name or metadata value is not valid UTF-8: ") + e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts at a multiple of 8
  uint8_t length[8];
  for (int k = 0; k < 8; ++k) length[k] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * k));
  sink(length, 8);
  sink(text.data(), text.size());
  for (const auto& p : plan) {
    // One tensor at a time: a model on the GPU is never all on the host at once.
    const at::Tensor c = p.tensor->detach().to(at::kCPU).contiguous();
    if (c.numel() > 0) sink(c.data_ptr(), static_cast<size_t>(c.nbytes()));
  }
}

}  // namespace

SafetensorsContents read_safetensors(const std::string& path) {
  auto fail = [&](const std::string& what) -> void { throw std::runtime_error(path + ": " + what); };
  if (const auto kind = not_a_regular_file(path); !kind.empty()) fail(kind);  // before the open: a FIFO would wait
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(std::string("cannot open the safetensors file: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("is not a regular file");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return parse(reinterpret_cast<const uint8_t*>(""), size, nullptr, path);  // refuses it, naming the size
  }
  // Private and writable: a tensor written to by mistake gets its own page, never the file's.
  void* map = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  const int mmap_errno = errno;
  ::close(fd);
  if (map == MAP_FAILED) fail(std::string("cannot map the safetensors file into memory: ") + std::strerror(mmap_errno));
  std::shared_ptr<void> keep(map, [size](void* p) { ::munmap(p, size); });
  return parse(static_cast<const uint8_t*>(map), size, keep, path);
}

SafetensorsContents safetensors_from_bytes(const std::string& bytes, const std::string& source) {
  auto copy = std::make_shared<std::string>(bytes);
  return parse(reinterpret_cast<const uint8_t*>(copy->data()), copy->size(), copy, source);
}

bool looks_like_safetensors(const std::string& prefix) {
  if (prefix.size() < 9) return false;
  const uint64_t n = le64(reinterpret_cast<const uint8_t*>(prefix.data()));
  return n >= 2 && n <= kSafetensorsMaxHeaderBytes && prefix[8] == '{';
}

std::string safetensors_bytes(const NamedTensors& tensors, const SafetensorsMetadata& metadata) {
  std::string out;
  emit(tensors, metadata, [&out](const void* p, size_t n) { out.append(static_cast<const char*>(p), n); });
  return out;
}

void write_safetensors(const std::string& path, const NamedTensors& tensors, const SafetensorsMetadata& metadata) {
  const std::string tmp = path + ".tmp";
  std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
  if (!f) throw std::runtime_error(path + ": cannot write the safetensors file: " + std::strerror(errno));
  try {
    emit(tensors, metadata, [&](const void* p, size_t n) {
      if (!f.write(static_cast<const char*>(p), static_cast<std::streamsize>(n)))
        throw std::runtime_error(path + ": writing the safetensors file failed: " + std::strerror(errno));
    });
    f.close();
    if (!f) throw std::runtime_error(path + ": writing the safetensors file failed: " + std::strerror(errno));
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
    if (ec) throw std::runtime_error(path + ": cannot rename " + tmp + " to it: " + ec.message());
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    throw;
  }
}

}  // namespace trainer
