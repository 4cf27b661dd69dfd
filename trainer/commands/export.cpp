#include "trainer/commands/export.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>

#include "common/files.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "models/lora.h"
#include "models/registry.h"
#include "models/vit.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/state_dict.h"
#include "trainer/checkpoint/store.h"
#include "trainer/checkpoint/weights.h"
#include "trainer/commands/eval_command.h"
#include "trainer/config/config.h"
#include "trainer/hf/families.h"
#include "trainer/hf/peft.h"
#include "trainer/run/from_config.h"
#include "trainer/run/lora.h"

namespace fs = std::filesystem;

namespace trainer {
namespace {

// The ResNets timm and torchvision have under the same names (not the CIFAR ones).
bool imagenet_resnet(const std::string& model) {
  return model == "resnet18" || model == "resnet34" || model == "resnet50" || model == "resnet101" || model == "resnet152";
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

const torch::Tensor& tensor(const NamedTensors& tensors, const std::string& name) {
  for (const auto& [k, t] : tensors)
    if (k == name) return t;
  throw std::runtime_error("export: the checkpoint's weights have no " + name);
}

int64_t count_blocks(const NamedTensors& tensors, const std::string& prefix) {
  int64_t n = 0;
  while (std::any_of(tensors.begin(), tensors.end(),
                     [&](const auto& kv) { return kv.first.rfind(prefix + std::to_string(n) + ".", 0) == 0; }))
    ++n;
  return n;
}

// Heads are not in the weights' shapes: they are the registered architecture's (no config key sets them).
int64_t registered_heads(const std::string& name) {
  const models::Model m = models::create_model(name, models::ModelOptions().vocab_size(8).context(8).n_layer(1).num_classes(1));
  if (auto* gpt = dynamic_cast<models::GPTImpl*>(m.get())) return gpt->options.n_head();
  if (auto* vit = dynamic_cast<models::ViTImpl*>(m.get())) return vit->options.n_head();
  throw std::runtime_error("export: model '" + name + "' has no attention heads");
}


// transformers' GPT2Config for our GPT (trainer/hf/families.h): the sizes from the weights, the heads
// from the registered architecture.
nlohmann::json gpt2_config(const NamedTensors& tensors, const Config& cfg) {
  const auto& wte = tensor(tensors, "transformer.wte.weight");
  return hf::gpt2_to_json(models::GPTOptions()
                              .vocab_size(wte.size(0))
                              .context(tensor(tensors, "transformer.wpe.weight").size(0))
                              .n_embd(wte.size(1))
                              .n_layer(count_blocks(tensors, "transformer.h."))
                              .n_head(registered_heads(cfg.model.name))
                              .dropout(cfg.model.dropout));
}

// The Llama-family architecture of a run: model.name llama's config.json, or the registered shape (built
// with one small layer and model.context, for its heads, head size, norm and rotary settings) with the sizes of the weights.
models::LlamaOptions llama_architecture(const NamedTensors& tensors, const Config& cfg) {
  if (const auto arch = hf_architecture(cfg)) return *arch;
  const models::Model m = models::create_model(
      cfg.model.name, models::ModelOptions().vocab_size(8).n_layer(1).intermediate_size(8).context(cfg.model.context));
  models::LlamaOptions o = dynamic_cast<const models::LlamaImpl&>(*m).options;
  const auto& embed = tensor(tensors, "model.embed_tokens.weight");
  const auto has = [&](const std::string& name) {
    return std::any_of(tensors.begin(), tensors.end(), [&](const auto& kv) { return kv.first == name; });
  };
  o.vocab_size(embed.size(0)).n_embd(embed.size(1)).n_layer(count_blocks(tensors, "model.layers."))
      .intermediate_size(tensor(tensors, "model.layers.0.mlp.gate_proj.weight").size(0))
      .tie_embeddings(!has("lm_head.weight")).qkv_bias(has("model.layers.0.self_attn.q_proj.bias"))
      .dropout(cfg.model.dropout);
  return o;
}

// config.json for the hf layout, by family.
nlohmann::json hf_config_json(const NamedTensors& tensors, const Config& cfg) {
  if (family_of(tensors) == Family::llama) return hf::llama_to_json(llama_architecture(tensors, cfg));
  return gpt2_config(tensors, cfg);
}

std::string py_quote(const std::string& s) {
  std::string r = "'";
  for (char c : s) r += (c == '\'' || c == '\\') ? std::string("\\") + c : std::string(1, c);
  return r + "'";
}

// The output format: --format, or else from the output's name; checked to be known and to fit the name.
std::string export_format(const ExportOptions& options, const std::string& out) {
  std::string format = options.format;
  if (format.empty()) format = ends_with(out, ".safetensors") ? "safetensors" : "pt";
  if (format != "pt" && format != "safetensors")
    throw std::invalid_argument("export: --format '" + format + "' is not one of: pt, safetensors");
  if (format == "pt" && ends_with(out, ".safetensors"))
    throw std::invalid_argument("export: --format pt would write a torch.save archive into " + out +
                                "; use --format safetensors, or another file name");
  return format;
}

// The checkpoint to export: `checkpoint`, or else the latest one of `run_dir` that has its weights.
LoadedCheckpoint export_checkpoint(const std::string& run_dir, const std::string& checkpoint) {
  std::optional<LoadedCheckpoint> ck;
  // Only the weights (and the config, to know the model) are read: a checkpoint without them falls back
  // like a corrupt one.
  auto check = [](const LoadedCheckpoint& c) {
    return c.files.count("model.pt") ? "" : "model.pt is missing";
  };
  if (!checkpoint.empty()) ck = CheckpointStore::load(checkpoint, check);
  else ck = CheckpointStore(run_dir, 0).load_latest(check);
  if (!ck) throw std::runtime_error(run_dir + ": no checkpoint to export");
  return std::move(*ck);
}

// The checkpoint's weights in our layout, without a GPT's vocabulary padding when they go to the hf layout.
NamedTensors our_weights(const LoadedCheckpoint& ck, const std::string& file, Layout layout) {
  NamedTensors ours = tensors_from_bytes(ck.file(file), ck.path + "/" + file);
  // Transformers knows only the real vocabulary: a GPT padded by model.vocab_multiple loses its padding
  // rows (zeros, never a token) in the hf layout; in ours it keeps them, to resume or fine-tune as it was.
  if (layout == Layout::hf && ck.files.count("state.json")) {
    const auto state = nlohmann::json::parse(ck.file("state.json"), nullptr, /*allow_exceptions=*/false);
    if (state.is_object() && state.contains("vocab_size") && state["vocab_size"].is_number_integer())
      ours = without_vocab_padding(std::move(ours), state["vocab_size"].get<int64_t>());
  }
  return ours;
}

// Writes config.json beside `file` (layout hf) and sets r.config and r.how_to_load (from_pretrained of the folder).
void write_hf_config(const std::string& file, const std::string& format, const NamedTensors& ours, const Config& cfg,
                     ExportResult& r) {
  const fs::path folder = fs::path(file).parent_path();
  r.config = (folder / "config.json").string();
  const nlohmann::json config = hf_config_json(ours, cfg);
  write_file_atomically(r.config, config.dump(2) + "\n", "export");
  const std::string expected = format == "safetensors" ? "model.safetensors" : "pytorch_model.bin";
  const std::string cls = "transformers." + config["architectures"][0].get<std::string>();
  r.how_to_load = fs::path(file).filename() == expected
                      ? cls + ".from_pretrained(" + py_quote(folder.empty() ? "." : folder.string()) + ")"
                      : "rename the file to " + expected + ", then " + cls + ".from_pretrained(<its folder>)";
}

// The timm call that builds our ViT's architecture and loads `file` into it.
std::string timm_vit_how_to_load(const NamedTensors& ours, const std::string& model, const std::string& file) {
  const auto& patch = tensor(ours, "patch_embed.weight");  // (C, in_chans, p, p)
  const int64_t p = patch.size(2), tokens = tensor(ours, "pos_embed").size(1);
  const auto side = static_cast<int64_t>(std::lround(std::sqrt(static_cast<double>(tokens - 1))));
  return "timm.create_model('vit_tiny_patch16_224', img_size=" + std::to_string(side * p) +
         ", patch_size=" + std::to_string(p) + ", in_chans=" + std::to_string(patch.size(1)) +
         ", embed_dim=" + std::to_string(patch.size(0)) + ", depth=" + std::to_string(count_blocks(ours, "blocks.")) +
         ", num_heads=" + std::to_string(registered_heads(model)) +
         ", num_classes=" + std::to_string(tensor(ours, "head.weight").size(0)) +
         ", act_layer='gelu_tanh', norm_layer=functools.partial(torch.nn.LayerNorm, eps=1e-5), checkpoint_path=" +
         py_quote(file) + ")";
}

// --layout peft: a LoRA run's adapters as peft's adapter folder (trainer/hf/peft.h).
ExportResult export_peft(const LoadedCheckpoint& ck, const Config& cfg, const std::string& source, const std::string& out,
                         const std::string& weight_set) {
  hf::write_peft_adapter(tensors_from_bytes(ck.file(source), ck.path + "/" + source), lora_options(cfg), out,
                         cfg.model.init_from, cfg.model.name.rfind("gpt", 0) == 0);
  ExportResult r;
  r.checkpoint = ck.path;
  r.weights = (fs::path(out) / "adapter_model.safetensors").string();
  r.config = (fs::path(out) / "adapter_config.json").string();
  r.weight_set = weight_set;
  const std::string base = cfg.model.init_from.empty() ? "<the base model>" : py_quote(cfg.model.init_from);
  r.how_to_load = "peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(" + base + "), " +
                  py_quote(out) + ")";
  return r;
}

// --merge: the run's model rebuilt (its base, its adapters), each adapter merged into its layer's weight.
NamedTensors merged_weights(const LoadedCheckpoint& ck, const Config& cfg, const std::string& source, Layout layout) {
  int64_t vocab = 0;
  const auto state = nlohmann::json::parse(ck.file("state.json"), nullptr, /*allow_exceptions=*/false);
  if (state.is_object() && state.contains("vocab_size") && state["vocab_size"].is_number_integer())
    vocab = state["vocab_size"].get<int64_t>();
  torch::manual_seed(cfg.seed);
  models::Model model = build_model(cfg, sample_shape(cfg), vocab);
  load_run_weights(*model, cfg, vocab, &ck, source);
  NamedTensors merged = models::merged_state(*model);
  return layout == Layout::hf && vocab > 0 ? without_vocab_padding(std::move(merged), vocab) : merged;
}

}  // namespace

ExportResult export_lora_adapter(const std::string& run_dir, const std::string& checkpoint, const std::string& out,
                                 const ExportOptions& options) {
  const LoadedCheckpoint ck = export_checkpoint(run_dir, checkpoint);
  Config cfg;
  if (ck.files.count("config.yaml")) apply_yaml_text(cfg, ck.files.at("config.yaml"), ck.path + "/config.yaml");
  if (cfg.model.lora.rank == 0)
    throw std::invalid_argument("export: --layout peft writes LoRA adapters, and " + ck.path +
                                " is of a run without model.lora; use --layout hf or ours");
  if (options.merge) throw std::invalid_argument("export: --merge writes a whole model: use it with --layout hf or ours");
  if (!options.format.empty() && options.format != "safetensors")
    throw std::invalid_argument("export: --layout peft writes safetensors (adapter_model.safetensors), not --format " +
                                options.format);
  const std::string source = weights_file(options.weights, ck.files.count("ema.pt") > 0, "export: " + ck.path);
  return export_peft(ck, cfg, source, out, source == "ema.pt" ? "ema" : "raw");
}

ExportResult export_weights(const std::string& run_dir, const std::string& checkpoint, const std::string& out,
                            const ExportOptions& options) {
  if (options.layout == "peft") return export_lora_adapter(run_dir, checkpoint, out, options);
  const Layout layout = parse_layout(options.layout);
  const std::string format = export_format(options, out);

  std::error_code ec;
  std::string file = out;
  if (fs::is_directory(out, ec))
    file = (fs::path(out) / (format == "safetensors" ? "model.safetensors" : layout == Layout::hf ? "pytorch_model.bin" : "model.pt")).string();

  const LoadedCheckpoint ck = export_checkpoint(run_dir, checkpoint);
  const std::string source = weights_file(options.weights, ck.files.count("ema.pt") > 0, "export: " + ck.path);
  ExportResult r;
  r.checkpoint = ck.path;
  r.weights = file;
  r.weight_set = source == "ema.pt" ? "ema" : "raw";
  Config cfg;
  if (ck.files.count("config.yaml")) apply_yaml_text(cfg, ck.files.at("config.yaml"), ck.path + "/config.yaml");
  const bool lora = cfg.model.lora.rank > 0;
  // A LoRA checkpoint's model.pt is its adapters: layout ours writes them as they are (our names).
  if (lora && !options.merge && layout != Layout::ours)
    throw std::invalid_argument("export: " + ck.path + " holds LoRA adapters, not a whole model: --layout peft writes "
                                "them for peft, --merge writes the model with them merged");
  if (!lora && options.merge)
    throw std::invalid_argument("export: --merge merges LoRA adapters, and " + ck.path + " is of a run without model.lora");
  if (format == "pt" && layout == Layout::ours && !options.merge) {
    // model.pt (and ema.pt) is already a state dict that torch.load reads, with our names: copied as it is.
    write_file_atomically(file, ck.file(source), "export");
    r.how_to_load = "torch.load(" + py_quote(file) + ")";
    return r;
  }

  const NamedTensors ours = options.merge ? merged_weights(ck, cfg, source, layout) : our_weights(ck, source, layout);
  const std::string& model = cfg.model.name;
  NamedTensors mapped;
  try {
    mapped = from_our_layout(ours, layout);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("export: model '" + model + "': " + e.what());
  }
  const Family family = family_of(ours);
  if (layout == Layout::timm && family == Family::resnet && !imagenet_resnet(model))
    throw std::invalid_argument("export: timm has no " + model + " (a CIFAR ResNet with option A shortcuts); use --layout ours");

  if (format == "safetensors") {
    // {"format": "pt"}: what transformers and timm write, and what transformers checks before it loads.
    write_safetensors(file, mapped,
                      {{"format", "pt"}, {"trainer.model", model}, {"trainer.layout", to_string(layout)},
                       {"trainer.step", std::to_string(ck.step)}, {"trainer.weights", r.weight_set}});
  } else {
    write_file_atomically(file, tensors_to_bytes(mapped), "export");
  }

  const std::string load = format == "safetensors" ? "safetensors.torch.load_file(" + py_quote(file) + ")"
                                                   : "torch.load(" + py_quote(file) + ")";
  if (layout == Layout::hf) {
    write_hf_config(file, format, ours, cfg, r);
  } else if (layout == Layout::timm && family == Family::resnet) {
    const auto& conv1 = tensor(ours, "conv1.weight");
    r.how_to_load = "timm.create_model(" + py_quote(model) + ", num_classes=" + std::to_string(tensor(ours, "fc.weight").size(0)) +
                    ", in_chans=" + std::to_string(conv1.size(1)) + ", checkpoint_path=" + py_quote(file) + ")";
  } else if (layout == Layout::timm) {  // ViT
    r.how_to_load = timm_vit_how_to_load(ours, model, file);
  } else if (imagenet_resnet(model)) {
    r.how_to_load = "torchvision.models." + model + "(num_classes=" + std::to_string(tensor(ours, "fc.weight").size(0)) +
                    ").load_state_dict(" + load + ")";
  } else {
    r.how_to_load = load;
  }
  return r;
}

}  // namespace trainer
