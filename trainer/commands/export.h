// `trainer export`: a checkpoint's weights as a file that Python's libraries load with no code of ours.
//
//   --format pt           torch.save archive (torch.load)                  [the default for other names]
//   --format safetensors  safetensors (safetensors.torch.load_file)        [the default for *.safetensors]
//   --layout ours         our names: torchvision's for ResNets, nanoGPT's for GPT (nn.Linear weights)
//   --layout hf           GPT only: transformers' GPT2LMHeadModel (Conv1D weights transposed) and a
//                         config.json beside the file: GPT2LMHeadModel.from_pretrained(folder)
//   --layout timm         ResNet-18/34/50/101/152 (the same names) and ViT (timm's names):
//                         timm.create_model(name, ..., checkpoint_path=file)
//   --layout peft         a LoRA run's adapters as peft's folder: adapter_config.json and adapter_model.safetensors,
//                         which peft.PeftModel.from_pretrained(base, folder) loads (trainer/hf/peft.h)
//   --merge               a LoRA run's model with its adapters merged (W + B A alpha / r), as peft's
//                         merge_and_unload, written in layout hf or ours
//   --weights auto        the averaged weights (ema.pt) where the checkpoint has them (train.ema_decay), else
//                         the trained weights (model.pt); --weights ema or raw chooses
#pragma once

#include <string>

namespace trainer {

struct ExportOptions {
  /// "pt" | "safetensors"; "" = from the output's name (*.safetensors: safetensors, else pt).
  std::string format;
  /// "ours" | "hf" | "timm" (trainer/checkpoint/weights.h) | "peft" (a LoRA run's adapters: `out` is a folder).
  std::string layout = "ours";
  /// "ema" | "raw" | "auto" (ema where the checkpoint has ema.pt, else raw): eval_command.h's weights_file.
  std::string weights = "auto";
  /// A LoRA run (model.lora): each adapter merged into its layer's weight, the whole model written (layout
  /// ours or hf); without it a LoRA checkpoint exports its adapters (layout peft, or ours: our names).
  bool merge = false;
};

struct ExportResult {
  std::string checkpoint;   ///< the checkpoint folder read
  std::string weight_set;   ///< "ema" (its ema.pt) or "raw" (its model.pt)
  std::string weights;      ///< the weights file written
  std::string config;       ///< the config.json written beside it (layout hf), else ""
  std::string how_to_load;  ///< one line of Python that loads the file
};

/// Writes the model weights of a checkpoint (`checkpoint`, or the latest valid one of `run_dir`) to `out`
/// (a file, or an existing folder: then model.safetensors, model.pt, or for hf with pt pytorch_model.bin
/// inside it), through a temporary file renamed into place. Throws std::invalid_argument for a format or
/// layout that is not known or does not fit the model (hf for a ResNet, timm for a GPT or a CIFAR
/// ResNet), std::runtime_error naming the path for a checkpoint that cannot be read or a file that
/// cannot be written.
/// --layout peft: the adapters of a LoRA run's checkpoint as peft's folder `out` (created if missing).
ExportResult export_lora_adapter(const std::string& run_dir, const std::string& checkpoint, const std::string& out,
                                 const ExportOptions& options);

ExportResult export_weights(const std::string& run_dir, const std::string& checkpoint, const std::string& out,
                            const ExportOptions& options = {});

}  // namespace trainer
