// The safetensors format: weights as a JSON header and raw little-endian tensors, with no code in the file
// (the default format of the Hugging Face Hub, transformers and timm).
//
//   bytes 0..7      N, the header's length: unsigned 64-bit little-endian
//   bytes 8..8+N    the header: a JSON object  {"NAME": {"dtype": "F32", "shape": [2, 3],
//                   "data_offsets": [BEGIN, END]}, ..., "__metadata__": {"KEY": "VALUE", ...}}
//                   (optional __metadata__ of strings; the writer pads it with spaces to a multiple of 8)
//   bytes 8+N..     the data: tensor NAME is the bytes [BEGIN, END) of this part, C order
//
//   C++ -> Python   write_safetensors("w.safetensors", tensors)   then  safetensors.torch.load_file(...)
//   Python -> C++   safetensors.torch.save_file(sd, "w.safetensors")  then  read_safetensors(...)
//
// Reading is strict: a file is refused, with one line that names it and the rule it breaks, when its
// header length runs past the file or over kSafetensorsMaxHeaderBytes (100 MB, the reference
// implementation's limit), its header is not UTF-8 JSON or not an object, a name appears twice, a dtype
// is unknown, a shape's element count or byte size overflows 64 bits, a tensor's offsets disagree with
// its dtype and shape, the tensors' byte ranges overlap, leave a gap or do not end exactly at the end of
// the file, or a BOOL holds a byte other than 0 or 1.
#pragma once

#include "trainer/checkpoint/state_dict.h"

#include <cstdint>
#include <map>
#include <string>

namespace trainer {

/// The largest header read (bytes of JSON), as the reference implementation (`safetensors` 0.4+).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

/// The header's `__metadata__`: string keys to string values (transformers writes {"format": "pt"}).
using SafetensorsMetadata = std::map<std::string, std::string>;

/// What a safetensors file holds.
struct SafetensorsContents {
  /// Tensors in the order of their data in the file, on the CPU, in the file's dtype: F64, F32, F16,
  /// BF16, I64, I32, I16, I8, U8, BOOL (kDouble ... kBool). Read from a file they alias its memory
  /// mapping (private, copy-on-write: writing to a tensor never changes the file); the mapping lives as
  /// long as any tensor does. A tensor whose offset in the file is not a multiple of its element size is
  /// the one exception: it is copied once into aligned memory.
  NamedTensors tensors;
  SafetensorsMetadata metadata;
};

/// Reads the safetensors file at `path` through a read-only memory mapping; no tensor is copied
/// (see SafetensorsContents). Throws std::runtime_error naming `path` and the problem for a file that
/// cannot be opened or mapped and for every malformed or hostile header (see the top of this file).
/// The file must not be truncated by another process while its tensors are in use (the mapping would
/// then fault, as for any memory-mapped reader).
SafetensorsContents read_safetensors(const std::string& path);

/// The same checks on bytes in memory (`source` names them in errors). The tensors alias one copy of
/// `bytes` that they keep alive.
SafetensorsContents safetensors_from_bytes(const std::string& bytes, const std::string& source = "<memory>");

/// Whether `prefix` (a file's first bytes, at least 9 of them) looks like a safetensors file: a header
/// length within the limit followed by '{'. Used to tell safetensors from torch.save archives ("PK").
bool looks_like_safetensors(const std::string& prefix);

/// The file that write_safetensors writes, as bytes (for tests and small files).
std::string safetensors_bytes(const NamedTensors& tensors, const SafetensorsMetadata& metadata = {});

/// Writes `tensors` (detached, moved to the CPU, made contiguous) and `metadata` as a safetensors file,
/// streaming each tensor's bytes once, into `path` + ".tmp" then renamed over `path`, so a failed write
/// never leaves a truncated file under the final name. Tensors are laid out by element size, largest
/// first (8-byte, then 4, 2, 1), in the given order within a size, so that every tensor's data is
/// aligned to its element size; the header is padded with spaces to a multiple of 8 bytes. Throws
/// std::runtime_error naming the tensor for a dtype outside the ten above or a duplicate name, and
/// naming `path` for a file that cannot be written.
void write_safetensors(const std::string& path, const NamedTensors& tensors, const SafetensorsMetadata& metadata = {});

}  // namespace trainer
