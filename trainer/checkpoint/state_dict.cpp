// State dicts in and out of modules: a module's named tensors, their torch.save archive (the pickle
// written here, read back by state_dict_read.cpp), the checked load into a module, and the optimizer's
// state as bytes.
#include "trainer/checkpoint/state_dict.h"

#include <caffe2/serialize/inline_container.h>

#include <fnmatch.h>

#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

namespace trainer {

using namespace std::string_literals;  // "...\x00..."s keeps the NUL bytes of pickle opcodes

namespace {

void collect_state(const torch::nn::Module& module, const std::string& prefix, NamedTensors& out) {
  // PyTorch's Module.state_dict: own parameters, own buffers, then each child with "child." prepended.
  for (const auto& p : module.named_parameters(/*recurse=*/false))
    if (p.value().defined()) out.emplace_back(prefix + p.key(), p.value());
  for (const auto& b : module.named_buffers(/*recurse=*/false))
    if (b.value().defined()) out.emplace_back(prefix + b.key(), b.value());
  for (const auto& c : module.named_children()) collect_state(*c.value(), prefix + c.key() + ".", out);
}

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

std::string join(const std::vector<std::string>& v) {
  std::string r;
  for (size_t i = 0; i < v.size(); ++i) r += (i ? ", " : "") + v[i];
  return r;
}

void write_whole_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) throw std::runtime_error("save_state_dict: cannot open " + path + " for writing: " + std::strerror(errno));
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  f.close();
  if (!f) throw std::runtime_error("save_state_dict: writing " + path + " failed: " + std::strerror(errno));
}

// ---- writing ---------------------------------------------------------------------------------------
//
// Why not torch::pickle_save of a c10::Dict: LibTorch's pickler tags the dict with
// torch.jit._pickle.restore_type_tag, which Python's torch.load(weights_only=True) rejects, and
// weights_only=True is the default since PyTorch 2.6. The few opcodes below are all that a state dict
// needs, and only use globals the weights-only unpickler allows.

void pickle_str(std::string& p, const std::string& s) {  // BINUNICODE
  p += 'X';
  const uint32_t n = static_cast<uint32_t>(s.size());
  for (int k = 0; k < 4; ++k) p += static_cast<char>((n >> (8 * k)) & 0xff);
  p += s;
}

void pickle_int(std::string& p, int64_t v) {
  if (v >= 0 && v < 256) {  // BININT1
    p += 'K';
    p += static_cast<char>(v);
  } else if (v >= 0 && v < 65536) {  // BININT2
    p += 'M';
    p += static_cast<char>(v & 0xff);
    p += static_cast<char>(v >> 8);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {  // BININT: signed 32-bit
    p += 'J';
    for (int k = 0; k < 4; ++k) p += static_cast<char>((static_cast<uint32_t>(v) >> (8 * k)) & 0xff);
  } else {  // LONG1: 8-byte two's complement
    p += "\x8a\x08";
    for (int k = 0; k < 8; ++k) p += static_cast<char>((static_cast<uint64_t>(v) >> (8 * k)) & 0xff);
  }
}

const char* storage_class(at::ScalarType t, const std::string& name) {
  switch (t) {
    case at::kFloat: return "FloatStorage";
    case at::kDouble: return "DoubleStorage";
    case at::kHalf: return "HalfStorage";
    case at::kBFloat16: return "BFloat16Storage";
    case at::kLong: return "LongStorage";
    case at::kInt: return "IntStorage";
    case at::kShort: return "ShortStorage";
    case at::kChar: return "CharStorage";
    case at::kByte: return "ByteStorage";
    case at::kBool: return "BoolStorage";
    case at::kComplexFloat: return "ComplexFloatStorage";
    case at::kComplexDouble: return "ComplexDoubleStorage";
    default: break;
  }
  TORCH_CHECK(false, "tensors_to_bytes: tensor '", name, "' has dtype ", t, ", which is not saved");
}

}  // namespace

NamedTensors named_state(const torch::nn::Module& module) {
  NamedTensors out;
  collect_state(module, "", out);
  return out;
}

std::string tensors_to_bytes(const NamedTensors& tensors) {
  // Pickle protocol 2, laid out as Python's torch.save(model.state_dict()) lays it out: an OrderedDict
  // of _rebuild_tensor_v2 calls whose storages are the zip records data/<i>.
  std::string pkl = "\x80\x02";
  pkl += "ccollections\nOrderedDict\nq\x00)R"s;  // memo 0: the OrderedDict class
  pkl += "q\x01(";
  std::vector<at::Tensor> storages;
  std::unordered_set<std::string> seen;
  bool rebuild_memoized = false;
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(t.defined(), "tensors_to_bytes: tensor '", name, "' is undefined");
    TORCH_CHECK(seen.insert(name).second, "tensors_to_bytes: duplicate key '", name, "'");
    // Each tensor gets its own contiguous storage, so a view never drags its whole base along.
    at::Tensor c = t.detach().to(at::kCPU).contiguous();
    if (c.storage_offset() != 0 || c.storage().nbytes() != c.nbytes()) c = c.clone();
    pickle_str(pkl, name);
    if (rebuild_memoized) {
      pkl += "h\x02";
    } else {
      pkl += "ctorch._utils\n_rebuild_tensor_v2\nq\x02";  // memo 2
      rebuild_memoized = true;
    }
    pkl += "((";  // args tuple, then the persistent id tuple
    pickle_str(pkl, "storage");
    pkl += std::string("ctorch\n") + storage_class(c.scalar_type(), name) + "\n";
    pickle_str(pkl, std::to_string(storages.size()));
    pickle_str(pkl, "cpu");
    pickle_int(pkl, c.numel());
    pkl += "tQ";     // TUPLE, BINPERSID
    pickle_int(pkl, 0);  // storage offset
    pkl += "(";
    for (auto d : c.sizes()) pickle_int(pkl, d);
    pkl += "t(";
    for (auto d : c.strides()) pickle_int(pkl, d);
    pkl += "t\x89";          // NEWFALSE: requires_grad
    pkl += "h\x00)R"s;        // OrderedDict(): no backward hooks
    pkl += "tR";
    storages.push_back(c);
  }
  pkl += "u.";  // SETITEMS, STOP

  std::string out;
  caffe2::serialize::PyTorchStreamWriter writer([&out](const void* data, size_t n) -> size_t {
    out.append(static_cast<const char*>(data), n);
    return n;
  });
  writer.writeRecord("data.pkl", pkl.data(), pkl.size());
  writer.writeRecord("byteorder", "little", 6);  // PyTorch 2.x reads it; older versions ignore it
  for (size_t i = 0; i < storages.size(); ++i)
    writer.writeRecord("data/" + std::to_string(i), storages[i].data_ptr(), storages[i].nbytes());
  writer.writeEndOfFile();
  return out;
}

std::string state_dict_bytes(const torch::nn::Module& module) { return tensors_to_bytes(named_state(module)); }

void save_state_dict(const torch::nn::Module& module, const std::string& path) {
  write_whole_file(path, state_dict_bytes(module));
}


LoadStateResult load_state_dict(torch::nn::Module& module, const NamedTensors& tensors, bool strict,
                                const std::string& source, const std::vector<std::string>& skip) {
  const NamedTensors own = named_state(module);
  std::unordered_map<std::string, const torch::Tensor*> given;
  std::vector<std::string> duplicates;
  for (const auto& [k, t] : tensors)
    if (!given.emplace(k, &t).second) duplicates.push_back(k);

  LoadStateResult result;
  std::vector<bool> pattern_used(skip.size(), false);
  auto skipped = [&](const std::string& k) {
    bool any = false;
    for (size_t i = 0; i < skip.size(); ++i)
      if (::fnmatch(skip[i].c_str(), k.c_str(), 0) == 0) any = pattern_used[i] = true;
    return any;
  };
  std::vector<std::string> mis_shaped;
  std::unordered_set<std::string> own_names;
  for (const auto& [k, t] : own) {
    own_names.insert(k);
    if (skipped(k)) {
      result.skipped_keys.push_back(k);
      given.erase(k);
      continue;
    }
    auto it = given.find(k);
    if (it == given.end()) result.missing_keys.push_back(k);
    else if (it->second->sizes() != t.sizes())
      mis_shaped.push_back(k + " (module " + shape_str(t.sizes()) + ", file " + shape_str(it->second->sizes()) + ")");
  }
  for (size_t i = 0; i < skip.size(); ++i)
    if (!pattern_used[i])
      throw std::runtime_error("load_state_dict: the skip pattern '" + skip[i] + "' matches no key of the module " +
                               "(loading " + source + "); the module's keys look like " +
                               (own.empty() ? std::string("(none)") : own.front().first + ", " + own.back().first));
  for (const auto& [k, t] : tensors)
    if (!own_names.count(k)) result.unexpected_keys.push_back(k);

  const bool key_error = strict && (!result.missing_keys.empty() || !result.unexpected_keys.empty());
  if (key_error || !mis_shaped.empty() || !duplicates.empty()) {
    std::ostringstream os;
    os << "load_state_dict: " << source << " does not match the module:";
    if (strict && !result.missing_keys.empty())
      os << " missing keys (in the module, not in the file): " << join(result.missing_keys) << ";";
    if (strict && !result.unexpected_keys.empty())
      os << " unexpected keys (in the file, not in the module): " << join(result.unexpected_keys) << ";";
    if (!mis_shaped.empty()) os << " wrong shapes: " << join(mis_shaped) << ";";
    if (!duplicates.empty()) os << " duplicate keys in the file: " << join(duplicates) << ";";
    os << " check that the file was saved from the same architecture"
       << (key_error ? " (or load non-strictly to skip missing and unexpected keys)" : "");
    throw std::runtime_error(os.str());
  }

  torch::NoGradGuard no_grad;
  for (const auto& [k, t] : own) {
    auto it = given.find(k);
    if (it != given.end()) t.copy_(*it->second);  // in place; converts dtype and device
  }
  return result;
}

LoadStateResult load_state_dict(torch::nn::Module& module, const std::string& path, bool strict) {
  return load_state_dict(module, read_tensors(path), strict, path);
}

LoadStateResult load_state_dict_bytes(torch::nn::Module& module, const std::string& bytes, bool strict,
                                      const std::string& source) {
  return load_state_dict(module, tensors_from_bytes(bytes, source), strict, source);
}

std::string optimizer_bytes(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::string out;
  archive.save_to([&out](const void* data, size_t n) -> size_t {
    out.append(static_cast<const char*>(data), n);
    return n;
  });
  return out;
}

void load_optimizer_bytes(torch::optim::Optimizer& optimizer, const std::string& bytes, const std::string& source) {
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(bytes.data(), bytes.size());
    optimizer.load(archive);
  } catch (const c10::Error& e) {
    throw std::runtime_error("load_optimizer_bytes: " + source + " does not fit this optimizer: " +
                             e.what_without_backtrace());
  }
}

}  // namespace trainer
