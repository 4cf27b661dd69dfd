// Weights in and out of the trainer, in the formats Python's PyTorch reads and writes.
//
//   C++ -> Python   save_state_dict(model, "w.pt")          then  torch.load("w.pt") -> dict name -> tensor
//   Python -> C++   torch.save(model.state_dict(), "w.pt")  then  load_state_dict(model, "w.pt")
//
// Names are PyTorch's dotted state_dict keys (`conv1.weight`, `bn1.running_mean`, `layer1.0.downsample.0.bias`),
// so a model whose submodules carry the reference names exchanges weights with torchvision by name.
#pragma once

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace trainer {

/// Ordered (name, tensor) pairs, as in a Python state_dict.
using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

/// Parameters and buffers of `module` with their dotted names, in PyTorch's state_dict order: a pre-order
/// walk of the module tree where each module contributes its own parameters (registration order), then
/// its own buffers, then its children. Undefined tensors (e.g. a disabled bias) are skipped. The tensors
/// alias the module's storage (no copy).
NamedTensors named_state(const torch::nn::Module& module);

/// Serializes `tensors` as Python's `torch.save(model.state_dict(), path)` would: a zip archive holding
/// an OrderedDict name -> tensor in the given order. Python's `torch.load` reads it, also with
/// `weights_only=True` (the default since PyTorch 2.6). Tensors are detached, copied to the CPU and
/// saved contiguous, each with its own storage (a view does not drag its base along).
std::string tensors_to_bytes(const NamedTensors& tensors);

/// `tensors_to_bytes(named_state(module))`: the module's state dict as bytes (for checkpoints).
std::string state_dict_bytes(const torch::nn::Module& module);

/// Writes `state_dict_bytes(module)` to `path` (not atomically: checkpoints go through CheckpointStore).
/// Throws std::runtime_error naming `path` if it cannot be written.
void save_state_dict(const torch::nn::Module& module, const std::string& path);

/// Reads a torch.save zip archive whose top-level object is a dict (or OrderedDict) str -> tensor, as
/// written by Python's `torch.save(model.state_dict(), path)` (PyTorch >= 1.6 default format) or by
/// `tensors_to_bytes`. Tensors come back on the CPU in their saved dtype, in the file's key order.
/// Throws std::runtime_error naming `source` for: not a zip archive (legacy pre-1.6 format, TorchScript
/// archives), a top-level object that is not a dict, non-string keys, non-tensor values, and pickle
/// contents outside the subset torch.save uses for tensors.
NamedTensors tensors_from_bytes(const std::string& bytes, const std::string& source = "<memory>");

/// `tensors_from_bytes` of the file at `path`; a missing or unreadable file is an error naming `path`.
NamedTensors read_tensors(const std::string& path);

/// What a non-strict load skipped.
struct LoadStateResult {
  std::vector<std::string> missing_keys;     ///< in the module, not in the file (left unchanged)
  std::vector<std::string> unexpected_keys;  ///< in the file, not in the module (ignored)
  std::vector<std::string> skipped_keys;     ///< in the module, matched by a `skip` pattern (left unchanged)
};

/// Copies `tensors` into `module`'s parameters and buffers by name, in place (under NoGradGuard, so
/// optimizer references stay valid), converting dtype and device to the module's. Shapes must match
/// exactly. With `strict`, missing or unexpected keys are errors too. All problems are reported in ONE
/// std::runtime_error naming `source` and listing missing keys, unexpected keys and each mis-shaped key
/// with its expected and found shape; nothing is copied when it throws. This is the one place where a
/// file's shapes are checked against the module's.
///
/// `skip`: glob patterns (fnmatch: `*` any text, dots included; `?` one character) over the module's
/// names, e.g. "fc.*" or "head.*": a module key that matches one keeps its value, is neither missing
/// nor shape-checked, and a file key of the same name is ignored (a classifier of another size when
/// fine-tuning). A pattern that matches no key of the module is an error naming it (a typo would
/// otherwise load everything silently).
LoadStateResult load_state_dict(torch::nn::Module& module, const NamedTensors& tensors, bool strict = true,
                                const std::string& source = "<memory>", const std::vector<std::string>& skip = {});

/// `load_state_dict(module, read_tensors(path), strict, path)`.
LoadStateResult load_state_dict(torch::nn::Module& module, const std::string& path, bool strict = true);

/// `load_state_dict(module, tensors_from_bytes(bytes, source), strict, source)`.
LoadStateResult load_state_dict_bytes(torch::nn::Module& module, const std::string& bytes, bool strict = true,
                                      const std::string& source = "<memory>");

/// An optimizer's full state (hyper-parameters per group and per-parameter buffers such as momentum) as
/// bytes, through LibTorch's serialize::OutputArchive. This is LibTorch's own format, not Python's.
std::string optimizer_bytes(const torch::optim::Optimizer& optimizer);

/// Restores what `optimizer_bytes` wrote into an optimizer built over the same parameters, in the same
/// order. Throws std::runtime_error naming `source` on a format or parameter-count mismatch.
void load_optimizer_bytes(torch::optim::Optimizer& optimizer, const std::string& bytes,
                          const std::string& source = "<memory>");

}  // namespace trainer
