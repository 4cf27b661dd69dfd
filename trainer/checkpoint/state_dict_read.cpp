// Reading torch.save archives: the zip records through LibTorch's PyTorchStreamReader and the subset of
// pickle that torch.save writes for (ordered) dicts of tensors (tensors_from_bytes, read_tensors).
#include "trainer/checkpoint/state_dict.h"

#include "common/files.h"

#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>

#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

namespace trainer {
namespace {

// ---- reading torch.save archives ------------------------------------------------------------------
//
// Why not torch::pickle_load: LibTorch 1.13's unpickler turns `collections.OrderedDict()` into None (it
// only expects OrderedDicts as a tensor's empty backward hooks), so the OrderedDict that
// `torch.save(model.state_dict())` writes at the top level loads as None and the file is unreadable.
// The reader below interprets the small subset of pickle protocol 2-4 that torch.save emits for
// (ordered) dicts of tensors, and reads the storages from the zip records with LibTorch's own
// PyTorchStreamReader.

class StringReadAdapter final : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit StringReadAdapter(const std::string& s) : s_(s) {}
  size_t size() const override { return s_.size(); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= s_.size()) return 0;
    n = std::min<size_t>(n, s_.size() - pos);
    std::memcpy(buf, s_.data() + pos, n);
    return n;
  }

 private:
  const std::string& s_;
};

/// A Python object from the pickle stream, as far as torch.save's state dicts need.
struct PyObj;
using PyPtr = std::shared_ptr<PyObj>;
struct PyObj {
  enum class Kind { None, Bool, Int, Float, Str, Bytes, Tuple, List, Dict, Global, Tensor, Storage };
  Kind kind = Kind::None;
  int64_t i = 0;   // Bool, Int
  double f = 0;    // Float
  std::string s;   // Str, Bytes, Global ("module.name")
  std::vector<PyPtr> items;                       // Tuple, List
  std::vector<std::pair<PyPtr, PyPtr>> entries;   // Dict, in insertion order
  at::Tensor tensor;                              // Tensor; Storage: flat 1-D tensor of the storage
};

PyPtr make(PyObj::Kind k) {
  auto o = std::make_shared<PyObj>();
  o->kind = k;
  return o;
}

const char* kind_name(const PyObj& o) {
  switch (o.kind) {
    case PyObj::Kind::None: return "None";
    case PyObj::Kind::Bool: return "bool";
    case PyObj::Kind::Int: return "int";
    case PyObj::Kind::Float: return "float";
    case PyObj::Kind::Str: return "str";
    case PyObj::Kind::Bytes: return "bytes";
    case PyObj::Kind::Tuple: return "tuple";
    case PyObj::Kind::List: return "list";
    case PyObj::Kind::Dict: return "dict";
    case PyObj::Kind::Global: return "class/function";
    case PyObj::Kind::Tensor: return "tensor";
    case PyObj::Kind::Storage: return "storage";
  }
  return "?";
}

at::ScalarType storage_dtype(const std::string& name, const std::string& source) {
  static const std::map<std::string, at::ScalarType> kTypes = {
      {"torch.FloatStorage", at::kFloat},       {"torch.DoubleStorage", at::kDouble},
      {"torch.HalfStorage", at::kHalf},         {"torch.BFloat16Storage", at::kBFloat16},
      {"torch.LongStorage", at::kLong},         {"torch.IntStorage", at::kInt},
      {"torch.ShortStorage", at::kShort},       {"torch.CharStorage", at::kChar},
      {"torch.ByteStorage", at::kByte},         {"torch.BoolStorage", at::kBool},
      {"torch.ComplexFloatStorage", at::kComplexFloat},
      {"torch.ComplexDoubleStorage", at::kComplexDouble},
      {"torch.UntypedStorage", at::kByte}};
  auto it = kTypes.find(name);
  if (it == kTypes.end())
    throw std::runtime_error(source + ": tensor storage type " + name + " is not supported");
  return it->second;
}

class Unpickler {
 public:
  Unpickler(const std::string& pkl, caffe2::serialize::PyTorchStreamReader& zip, std::string source)
      : p_(pkl), zip_(zip), source_(std::move(source)) {}

  PyPtr parse() {
    while (true) {
      if (pos_ >= p_.size()) fail("the pickle ends without STOP (truncated file?)");
      const size_t at_op = pos_;
      const uint8_t op = u8();
      if (op == '.') {  // STOP
        if (stack_.size() != 1) fail("malformed pickle (stack has " + std::to_string(stack_.size()) + " items at STOP)");
        return stack_.back();
      }
      if (scalar_op(op) || string_op(op) || container_op(op) || object_op(op)) continue;
      std::ostringstream os;
      os << "unsupported pickle opcode 0x" << std::hex << int(op) << std::dec << " at byte " << at_op
         << " (this reader handles what torch.save writes for dicts of tensors)";
      fail(os.str());
    }
  }

 private:
  // One group of opcodes each; false when `op` is not in the group.
  bool scalar_op(uint8_t op) {
    switch (op) {
      case 0x80: u8(); return true;                  // PROTO
      case 0x95: bytes(8); return true;              // FRAME: a size hint only
      case 'N': stack_.push_back(make(PyObj::Kind::None)); return true;
      case 0x88: push_bool(true); return true;       // NEWTRUE
      case 0x89: push_bool(false); return true;      // NEWFALSE
      case 'K': push_int(u8()); return true;         // BININT1
      case 'M': push_int(le(2)); return true;        // BININT2
      case 'J': push_int(static_cast<int32_t>(le(4))); return true;  // BININT
      case 0x8a: {                                   // LONG1: little-endian two's complement
        const size_t n = u8();
        if (n > 8) fail("integer wider than 64 bits");
        uint64_t v = n ? le(n) : 0;
        if (n && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t(0) << (8 * n);
        push_int(static_cast<int64_t>(v));
        return true;
      }
      case 'G': {                                    // BINFLOAT: big-endian double
        uint64_t v = 0;
        for (int k = 0; k < 8; ++k) v = (v << 8) | u8();
        auto o = make(PyObj::Kind::Float);
        std::memcpy(&o->f, &v, 8);
        stack_.push_back(o);
        return true;
      }
      default: return false;
    }
  }

  bool string_op(uint8_t op) {
    switch (op) {
      case 'X': push_str(PyObj::Kind::Str, le(4)); return true;    // BINUNICODE
      case 0x8c: push_str(PyObj::Kind::Str, u8()); return true;    // SHORT_BINUNICODE
      case 0x8d: push_str(PyObj::Kind::Str, le(8)); return true;   // BINUNICODE8
      case 'T': push_str(PyObj::Kind::Str, le(4)); return true;    // BINSTRING (protocol 1 str)
      case 'U': push_str(PyObj::Kind::Str, u8()); return true;     // SHORT_BINSTRING
      case 'B': push_str(PyObj::Kind::Bytes, le(4)); return true;  // BINBYTES
      case 'C': push_str(PyObj::Kind::Bytes, u8()); return true;   // SHORT_BINBYTES
      default: return false;
    }
  }

  bool container_op(uint8_t op) {
    switch (op) {
      case '(': marks_.push_back(stack_.size()); return true;
      case ')': stack_.push_back(make(PyObj::Kind::Tuple)); return true;  // EMPTY_TUPLE
      case 't': { auto t = make(PyObj::Kind::Tuple); t->items = pop_mark(); stack_.push_back(t); return true; }
      case 0x85: case 0x86: case 0x87: {             // TUPLE1..3
        const size_t n = op - 0x84;
        need(n);
        auto t = make(PyObj::Kind::Tuple);
        t->items.assign(stack_.end() - n, stack_.end());
        stack_.resize(stack_.size() - n);
        stack_.push_back(t);
        return true;
      }
      case ']': stack_.push_back(make(PyObj::Kind::List)); return true;
      case '}': stack_.push_back(make(PyObj::Kind::Dict)); return true;
      case 'a': { need(2); auto v = pop(); top(PyObj::Kind::List, "APPEND").items.push_back(v); return true; }
      case 'e': { auto v = pop_mark(); auto& l = top(PyObj::Kind::List, "APPENDS").items; l.insert(l.end(), v.begin(), v.end()); return true; }
      case 's': { need(3); auto v = pop(); auto k = pop(); top(PyObj::Kind::Dict, "SETITEM").entries.emplace_back(k, v); return true; }
      case 'u': {
        auto kv = pop_mark();
        if (kv.size() % 2) fail("SETITEMS with an odd number of items");
        auto& d = top(PyObj::Kind::Dict, "SETITEMS").entries;
        for (size_t k = 0; k < kv.size(); k += 2) d.emplace_back(kv[k], kv[k + 1]);
        return true;
      }
      default: return false;
    }
  }

  bool object_op(uint8_t op) {
    switch (op) {
      case 'q': memo_[u8()] = back(); return true;       // BINPUT
      case 'r': memo_[le(4)] = back(); return true;      // LONG_BINPUT
      case 0x94: memo_[memo_.size()] = back(); return true;  // MEMOIZE
      case 'h': stack_.push_back(memo(u8())); return true;   // BINGET
      case 'j': stack_.push_back(memo(le(4))); return true;  // LONG_BINGET
      case 'c': {                                        // GLOBAL "module\nname\n"
        auto g = make(PyObj::Kind::Global);
        const std::string module = line(), name = line();
        g->s = module + "." + name;
        stack_.push_back(g);
        return true;
      }
      case 0x93: {                                       // STACK_GLOBAL
        need(2);
        auto name = pop(), module = pop();
        auto g = make(PyObj::Kind::Global);
        g->s = module->s + "." + name->s;
        stack_.push_back(g);
        return true;
      }
      case 'Q': { need(1); stack_.push_back(persistent_load(*pop())); return true; }  // BINPERSID
      case 'R': {                                        // REDUCE
        need(2);
        auto args = pop(), fn = pop();
        stack_.push_back(reduce(*fn, *args));
        return true;
      }
      case 'b': need(2); pop(); return true;             // BUILD: OrderedDict._metadata etc.; not needed
      default: return false;
    }
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error(source_ + ": cannot read the torch.save archive: " + what);
  }
  uint8_t u8() {
    if (pos_ >= p_.size()) fail("the pickle is truncated");
    return static_cast<uint8_t>(p_[pos_++]);
  }
  uint64_t le(size_t n) {
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) v |= uint64_t(u8()) << (8 * k);
    return v;
  }
  std::string bytes(uint64_t n) {
    if (n > p_.size() - pos_) fail("the pickle is truncated");
    std::string r = p_.substr(pos_, n);
    pos_ += n;
    return r;
  }
  std::string line() {
    const size_t end = p_.find('\n', pos_);
    if (end == std::string::npos) fail("the pickle is truncated");
    std::string r = p_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return r;
  }
  void need(size_t n) const {
    const size_t floor = marks_.empty() ? 0 : marks_.back();
    if (stack_.size() < floor + n) fail("malformed pickle (stack underflow)");
  }
  PyPtr pop() {
    need(1);
    auto v = stack_.back();
    stack_.pop_back();
    return v;
  }
  const PyPtr& back() const {
    if (stack_.empty()) fail("malformed pickle (memo of an empty stack)");
    return stack_.back();
  }
  PyObj& top(PyObj::Kind k, const char* op) {
    need(1);
    if (stack_.back()->kind != k)
      fail(std::string(op) + " on a " + kind_name(*stack_.back()) + " (only dicts and lists are supported)");
    return *stack_.back();
  }
  std::vector<PyPtr> pop_mark() {
    if (marks_.empty()) fail("malformed pickle (no MARK)");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<PyPtr> r(stack_.begin() + m, stack_.end());
    stack_.resize(m);
    return r;
  }
  PyPtr memo(uint64_t k) const {
    auto it = memo_.find(k);
    if (it == memo_.end()) fail("malformed pickle (memo key " + std::to_string(k) + " unset)");
    return it->second;
  }
  void push_bool(bool b) { auto o = make(PyObj::Kind::Bool); o->i = b; stack_.push_back(o); }
  void push_int(int64_t v) { auto o = make(PyObj::Kind::Int); o->i = v; stack_.push_back(o); }
  void push_str(PyObj::Kind k, uint64_t n) { auto o = make(k); o->s = bytes(n); stack_.push_back(o); }

  static std::vector<int64_t> ints(const PyObj& t, const char* what, const Unpickler& self) {
    if (t.kind != PyObj::Kind::Tuple && t.kind != PyObj::Kind::List) self.fail(std::string(what) + " is not a tuple");
    std::vector<int64_t> r;
    for (const auto& x : t.items) {
      if (x->kind != PyObj::Kind::Int) self.fail(std::string(what) + " holds a non-integer");
      r.push_back(x->i);
    }
    return r;
  }

  // ('storage', storage_type, key, location, numel): the bytes are the zip record data/<key>.
  PyPtr persistent_load(const PyObj& pid) {
    if (pid.kind != PyObj::Kind::Tuple || pid.items.size() < 5 || pid.items[0]->s != "storage" ||
        pid.items[1]->kind != PyObj::Kind::Global || pid.items[2]->kind != PyObj::Kind::Str ||
        pid.items[4]->kind != PyObj::Kind::Int)
      fail("unsupported persistent id (expected a tensor storage)");
    const std::string key = pid.items[2]->s;
    auto cached = storages_.find(key);
    if (cached != storages_.end()) return cached->second;
    const at::ScalarType dtype = storage_dtype(pid.items[1]->s, source_);
    const int64_t numel = pid.items[4]->i;
    const std::string record = "data/" + key;
    if (!zip_.hasRecord(record)) fail("the storage record " + record + " is missing");
    auto rec = zip_.getRecord(record);
    const size_t nbytes = std::get<1>(rec);
    const size_t item = c10::elementSize(dtype);
    if (numel < 0 || static_cast<uint64_t>(numel) > nbytes / item)
      fail("the storage record " + record + " has " + std::to_string(nbytes) + " bytes, too few for " +
           std::to_string(numel) + " elements of " + std::to_string(item) + " bytes");
    // The record's memory stays alive as long as tensors built on it; they are cloned before returning.
    auto holder = std::make_shared<at::DataPtr>(std::move(std::get<0>(rec)));
    auto o = make(PyObj::Kind::Storage);
    o->tensor = torch::from_blob(holder->get(), {numel}, [holder](void*) {}, at::TensorOptions().dtype(dtype));
    storages_[key] = o;
    return o;
  }

  PyPtr reduce(const PyObj& fn, const PyObj& args) {
    if (fn.kind != PyObj::Kind::Global) fail("REDUCE on a " + std::string(kind_name(fn)));
    if (args.kind != PyObj::Kind::Tuple) fail("REDUCE with arguments that are not a tuple");
    const auto& a = args.items;
    const std::string& name = fn.s;
    if (name == "collections.OrderedDict") {
      // OrderedDict() at the top of a state_dict, or a tensor's (empty) backward hooks.
      auto d = make(PyObj::Kind::Dict);
      if (!a.empty()) fail("OrderedDict built from arguments is not supported");
      return d;
    }
    if (name == "torch._utils._rebuild_tensor_v2" || name == "torch._utils._rebuild_tensor") {
      // (storage, storage_offset, size, stride[, requires_grad, backward_hooks[, metadata]])
      if (a.size() < 4 || a[0]->kind != PyObj::Kind::Storage || a[1]->kind != PyObj::Kind::Int)
        fail(name + " with unexpected arguments");
      const auto size = ints(*a[2], "tensor size", *this);
      const auto stride = ints(*a[3], "tensor stride", *this);
      if (size.size() != stride.size()) fail("tensor size and stride differ in length");
      const at::Tensor& storage = a[0]->tensor;
      int64_t last = a[1]->i;  // highest element index touched, to keep as_strided in bounds
      bool empty = false;
      for (size_t d = 0; d < size.size(); ++d) {
        if (size[d] < 0 || stride[d] < 0) fail("negative tensor size or stride");
        if (size[d] == 0) empty = true;
        else last += (size[d] - 1) * stride[d];
      }
      auto t = make(PyObj::Kind::Tensor);
      if (empty) {
        t->tensor = torch::empty(size, storage.options());
      } else {
        if (a[1]->i < 0 || last >= storage.numel()) fail("tensor extends past its storage");
        t->tensor = storage.as_strided(size, stride, a[1]->i).clone(at::MemoryFormat::Contiguous);
      }
      return t;
    }
    if (name == "torch._utils._rebuild_parameter" || name == "torch._utils._rebuild_parameter_with_state") {
      if (a.empty() || a[0]->kind != PyObj::Kind::Tensor) fail(name + " with unexpected arguments");
      return a[0];
    }
    if (name == "torch.jit._pickle.restore_type_tag") {  // LibTorch's typed containers: (obj, type string)
      if (a.empty()) fail(name + " without arguments");
      return a[0];
    }
    fail("unsupported Python object " + name +
         " (only dicts of dense tensors are read; in Python save torch.save(model.state_dict(), path))");
  }

  const std::string& p_;
  caffe2::serialize::PyTorchStreamReader& zip_;
  std::string source_;
  size_t pos_ = 0;
  std::vector<PyPtr> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, PyPtr> memo_;
  std::unordered_map<std::string, PyPtr> storages_;
};

std::string read_whole_file(const std::string& path, const char* what) {
  require_regular_file(path, what);
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(std::string(what) + ": cannot open " + path + ": " + std::strerror(errno));
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) throw std::runtime_error(std::string(what) + ": cannot read " + path);
  return ss.str();
}

}  // namespace

NamedTensors tensors_from_bytes(const std::string& bytes, const std::string& source) {
  if (bytes.size() < 4 || bytes.compare(0, 4, "PK\x03\x04") != 0) {
    if (bytes.size() >= 2 && static_cast<uint8_t>(bytes[0]) == 0x80)
      throw std::runtime_error(source + " is in the legacy (pre-1.6) torch.save format; re-save it in Python "
                               "with torch.save(obj, path), whose zip format is the default since PyTorch 1.6");
    throw std::runtime_error(source + " is not a torch.save archive (no zip header; empty, truncated or another "
                             "format?)");
  }
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> zip;
  std::string pkl;
  try {
    zip = std::make_unique<caffe2::serialize::PyTorchStreamReader>(std::make_shared<StringReadAdapter>(bytes));
    if (!zip->hasRecord("data.pkl")) {
      if (zip->hasRecord("constants.pkl"))
        throw std::runtime_error(source + " is a TorchScript archive (torch.jit.save, or LibTorch torch::save of a "
                                 "module), not a state dict; in Python save torch.save(model.state_dict(), path)");
      throw std::runtime_error(source + " is a zip archive without data.pkl; it was not written by torch.save");
    }
    if (zip->hasRecord("byteorder")) {
      auto rec = zip->getRecord("byteorder");
      const std::string order(static_cast<const char*>(std::get<0>(rec).get()), std::get<1>(rec));
      if (order != "little")
        throw std::runtime_error(source + " was saved with byte order '" + order + "'; only little-endian is read");
    }
    auto rec = zip->getRecord("data.pkl");
    pkl.assign(static_cast<const char*>(std::get<0>(rec).get()), std::get<1>(rec));
  } catch (const c10::Error& e) {
    throw std::runtime_error(source + ": cannot read the torch.save zip archive (corrupt or truncated?): " +
                             e.what_without_backtrace());
  }

  PyPtr root;
  try {
    root = Unpickler(pkl, *zip, source).parse();
  } catch (const c10::Error& e) {
    throw std::runtime_error(source + ": cannot read the torch.save archive: " + e.what_without_backtrace());
  }
  if (root->kind != PyObj::Kind::Dict)
    throw std::runtime_error(source + " holds a " + kind_name(*root) + ", not a dict of tensors; in Python save "
                             "torch.save(model.state_dict(), path)");
  NamedTensors out;
  out.reserve(root->entries.size());
  for (const auto& [k, v] : root->entries) {
    if (k->kind != PyObj::Kind::Str)
      throw std::runtime_error(source + " holds a dict with a " + kind_name(*k) + " key; a state dict has string keys");
    if (v->kind != PyObj::Kind::Tensor)
      throw std::runtime_error(source + " holds a dict whose value for '" + k->s + "' is a " + kind_name(*v) +
                               ", not a tensor; if it is a training checkpoint, save only the weights: "
                               "torch.save(model.state_dict(), path)");
    out.emplace_back(k->s, v->tensor);
  }
  return out;
}

NamedTensors read_tensors(const std::string& path) {
  return tensors_from_bytes(read_whole_file(path, "read_tensors"), path);
}

}  // namespace trainer
