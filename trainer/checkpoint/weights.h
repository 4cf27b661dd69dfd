// Weight files in and out, whichever library wrote them: the two formats (safetensors, torch.save
// archives) and the name layouts of the libraries users bring weights from.
//
//   model.init_from   read_weights -> to_our_layout -> load_state_dict (strict, with model.init_skip)
//   trainer export    our state dict -> from_our_layout -> write_safetensors | tensors_to_bytes
//
// The layouts, per model family (docs/MODELS.md has the full name tables):
//
// | family | ours                               | Hugging Face (hf)                         | timm                         |
// |--------|------------------------------------|-------------------------------------------|------------------------------|
// | GPT    | transformer.h.N.attn.c_attn.weight | the same names (GPT2LMHeadModel), or      | -                            |
// |        | (nn.Linear: out x in)              | without `transformer.` (GPT2Model); the   |                              |
// |        |                                    | c_attn, c_proj, c_fc weights are Conv1D   |                              |
// |        |                                    | (in x out, transposed); lm_head.weight    |                              |
// |        |                                    | tied to wte; attn.bias/masked_bias buffers|                              |
// | Llama  | transformers' own names            | the same names (LlamaForCausalLM, Qwen2-,  | -                            |
// |        | (models/llama.h)                   | MistralForCausalLM); a tied lm_head.weight |                              |
// |        |                                    | equal to model.embed_tokens.weight dropped |                              |
// | ViT    | patch_embed, blocks.N.ln_1,        | -                                         | patch_embed.proj, norm1,     |
// |        | attn.c_attn, attn.c_proj, ln_2,    |                                           | attn.qkv, attn.proj, norm2,  |
// |        | mlp.c_fc, mlp.c_proj, ln_f, head   |                                           | mlp.fc1, mlp.fc2, norm, head |
// | ResNet | torchvision's names                | -                                         | the same names as ours       |
//
// A file's layout is recognised from its names (and, for GPT-2, from the orientation of c_attn.weight,
// [C, 3C] for Conv1D against [3C, C] for nn.Linear), so a user gives only the file.
#pragma once

#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/state_dict.h"

#include <string>
#include <vector>

namespace trainer {

/// A weights file's tensors, whichever its format.
struct WeightsFile {
  NamedTensors tensors;          ///< on the CPU, in the file's dtypes (safetensors: memory-mapped, not copied)
  std::string format;            ///< "safetensors" or "torch.save"
  SafetensorsMetadata metadata;  ///< safetensors' __metadata__ (empty for torch.save)
};

/// Reads `path` as a safetensors file (read_safetensors) or a torch.save archive (read_tensors), told
/// apart by the first bytes, not the file name; or transformers' sharded form, given as its
/// model.safetensors.index.json or as the folder that holds it (a folder with model.safetensors reads that).
/// Throws std::runtime_error naming `path` for a missing or
/// unreadable file, a file of neither format, and every error of the two readers.
WeightsFile read_weights(const std::string& path);

/// Name layouts (see the table above).
enum class Layout { ours, hf, timm };

/// "ours", "hf", "timm".
std::string to_string(Layout layout);
/// The layout named `name` ("ours", "hf", "timm"); throws std::invalid_argument listing them otherwise.
Layout parse_layout(const std::string& name);

/// The model families whose layouts differ, told from a module's own state names (named_state):
/// gpt (transformer.wte.weight), llama (model.embed_tokens.weight: Llama, Qwen2, Mistral), vit (cls_token,
/// pos_embed), resnet (conv1, bn1, fc), other.
enum class Family { gpt, llama, vit, resnet, other };
Family family_of(const NamedTensors& own);

/// A file's tensors under our names.
struct Translated {
  NamedTensors tensors;            ///< our names and orientation; tensors alias the file's where no transpose was needed
  std::string layout;              ///< what was recognised, e.g. "Hugging Face GPT2LMHeadModel (Conv1D weights transposed)"
  std::vector<std::string> notes;  ///< what was dropped or filled in, one line each, for the log
};

/// Recognises the layout of `file` from its names and maps it onto the names of `own` (the module's
/// named_state). What is left to load_state_dict: unknown keys, missing keys and shapes.
/// - GPT: names without `transformer.` get it; Conv1D weights ([in, out]) are transposed to nn.Linear's
///   [out, in]; the causal-mask buffers `*.attn.bias` and `*.attn.masked_bias` are dropped (this model
///   computes its mask); `lm_head.weight` is dropped when it equals `transformer.wte.weight` (tied), and
///   is an error naming it otherwise (this GPT ties its output projection to the token embedding).
/// - ViT: timm's names are renamed as in the table above; what timm has and this ViT has not (fc_norm,
///   layer scale ls1/ls2, register tokens, q/k norms) stays under its timm name, so load_state_dict
///   names it as an unexpected key.
/// - every family: a `*.num_batches_tracked` buffer the file lacks (torchvision's published weights
///   predate it) is filled with 0, as PyTorch's BatchNorm does for such files.
/// Throws std::runtime_error naming `source` and the key for a tied lm_head.weight that differs.
Translated to_our_layout(const NamedTensors& file, const NamedTensors& own, const std::string& source);

/// `own` (a module's named_state, our names) in `layout`'s names and orientation: ours as it is; hf (GPT
/// only) with the Conv1D weights transposed and no lm_head.weight (transformers ties it to wte when it
/// loads); timm (ResNets: the same names; ViT: timm's names). Throws std::invalid_argument for a layout
/// that does not cover the family.
NamedTensors from_our_layout(const NamedTensors& own, Layout layout);

/// What model.init_from did.
struct LoadedWeights {
  std::string format;                      ///< "safetensors" or "torch.save"
  std::string layout;                      ///< Translated::layout
  std::vector<std::string> notes;          ///< Translated::notes
  std::vector<std::string> skipped_keys;   ///< left at their initialization by `skip`
};

/// model.init_from: read_weights(path), to_our_layout, then load_state_dict(module, ..., strict, path,
/// skip): every key of the module must come from the file and every key of the file must have a place
/// in the module, with the same shape, except the keys of the module that match a `skip` pattern
/// (model.init_skip, e.g. "fc.*" for a classifier of another size), which keep their initialization,
/// and the file's keys of the same names, which are ignored. Throws std::runtime_error naming `path`
/// and the keys; nothing is copied then.
/// `vocab`: a GPT's vocabulary when its embedding is padded to more rows (model.vocab_multiple, as
/// nanoGPT pads 50257 to 50304): a file's transformer.wte.weight of exactly `vocab` rows gets the
/// padding rows as zeros, as the padded model keeps them. 0: no padding is added.
LoadedWeights load_weights(torch::nn::Module& module, const std::string& path, const std::vector<std::string>& skip = {},
                           int64_t vocab = 0);

/// `tensors` (our names) with transformer.wte.weight cut to its first `vocab` rows (the padding rows of
/// model.vocab_multiple dropped), for a library that knows only the real vocabulary. Unchanged when
/// there is no such tensor or it has `vocab` rows or fewer.
NamedTensors without_vocab_padding(NamedTensors tensors, int64_t vocab);

}  // namespace trainer
