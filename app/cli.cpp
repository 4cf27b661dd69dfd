#include "app/cli.h"

#include <cxxopts.hpp>
#include <spdlog/spdlog.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#ifdef TRAINER_WITH_CUDA
#include <cuda_runtime_api.h>  // CUDART_VERSION, for --version
#endif

#include "common/compat.h"
#include "common/log.h"
#include "common/signals.h"
#include "data/files/idx.h"
#include "data/files/image_h5.h"
#include "data/files/token_h5.h"
#include "models/registry.h"
#include "models/summary.h"
#include "tools/bench/bench.h"
#include "tools/compare.h"
#include "tools/convert_images.h"
#include "trainer/checkpoint/state_dict.h"
#include "trainer/commands/eval_command.h"
#include "trainer/commands/export.h"
#include "trainer/commands/sample_command.h"
#include "trainer/config/config.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/resources.h"
#include "trainer/run/from_config.h"
#include "trainer/run/memory_plan.h"
#include "trainer/run/train.h"

namespace fs = std::filesystem;

namespace trainer {
namespace {

// --set values are taken out before cxxopts sees them: it splits list options at commas, which would
// cut `--set data.shape=[3,224,224]` in three. Returns the other arguments.
std::vector<char*> take_sets(int argc, char** argv, std::vector<std::string>& sets) {
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if ((arg == "--set" || arg == "-s") && i + 1 < argc) {
      sets.push_back(argv[++i]);
    } else if (arg.rfind("--set=", 0) == 0) {
      sets.push_back(arg.substr(6));
    } else {
      rest.push_back(argv[i]);
    }
  }
  return rest;
}

// cxxopts 2.x and 3.x name their exception types differently: any parse error becomes one line that
// names the subcommand.
cxxopts::ParseResult parse(cxxopts::Options& o, int argc, char** argv, const std::string& command) {
  try {
    return o.parse(argc, argv);
  } catch (const std::exception& e) {
    throw std::runtime_error(command + ": " + e.what() + " (see trainer " + command + " --help)");
  }
}

int convert_idx_main(int argc, char** argv) {
  cxxopts::Options o("trainer convert-idx", "Convert IDX files (e.g. Fashion-MNIST) to the trainer's HDF5 format");
  o.add_options()("src", "folder with train-images-idx3-ubyte.gz etc.",
                  cxxopts::value<std::string>()->default_value("/usr/share/datasets/fashion-mnist"))(
      "out", "output folder (train.h5, test.h5)", cxxopts::value<std::string>()->default_value("datasets/fmnist"))(
      "h,help", "this help");
  auto a = o.parse(argc, argv);
  if (a.count("help")) {
    std::cout << o.help() << std::endl;
    return kExitOk;
  }
  std::cout << data::convert_idx(a["src"].as<std::string>(), a["out"].as<std::string>()) << std::endl;
  return kExitOk;
}

int convert_images_main(int argc, char** argv) {
  cxxopts::Options o("trainer convert-images",
                     "Convert an ImageFolder tree (SRC/train/<class>/*, SRC/val/<class>/*) to packed image files "
                     "(OUT/train.h5, OUT/val.h5) for data.kind: packed_images");
  o.add_options()("src", "the ImageFolder root", cxxopts::value<std::string>())(
      "out", "output folder", cxxopts::value<std::string>())(
      "max-side", "resize and re-encode images whose longer side is over N (0 = keep)",
      cxxopts::value<int>()->default_value("0"))(
      "threads", "worker threads (0 = the CPUs this container may use)", cxxopts::value<int>()->default_value("0"))(
      "max-pixels", "refuse images whose header claims more than this many pixels",
      cxxopts::value<int64_t>()->default_value("100000000"))("h,help", "this help");
  auto a = parse(o, argc, argv, "convert-images");
  if (a.count("help")) {
    std::cout << o.help() << std::endl;
    return kExitOk;
  }
  for (const char* required : {"src", "out"})
    if (!a.count(required))
      throw std::runtime_error(std::string("convert-images: --") + required + " is required (see trainer convert-images --help)");
  ConvertImagesOptions co;
  co.src = a["src"].as<std::string>();
  co.out = a["out"].as<std::string>();
  co.max_side = a["max-side"].as<int>();
  co.threads = a["threads"].as<int>();
  co.max_pixels = a["max-pixels"].as<int64_t>();
  std::cout << convert_images(co) << std::endl;
  return kExitOk;
}

int convert_text_main(int argc, char** argv) {
  cxxopts::Options o("trainer convert-text",
                     "Convert text files to the trainer's HDF5 token format: bytes (vocabulary 256), or byte-level BPE "
                     "tokens with --tokenizer (GPT-2, Llama 3, Qwen2; each file one document, begun by the tokenizer's "
                     "<|begin_of_text|> where it adds one, ended by its end-of-text token)");
  o.add_options()("src", "text files or folders (comma-separated)",
                  cxxopts::value<std::string>()->default_value("/usr/share/games/fortunes"))(
      "out", "output folder (train.h5, val.h5)", cxxopts::value<std::string>()->default_value("datasets/fortunes"))(
      "val-fraction", "share of the stream's end kept for validation", cxxopts::value<double>()->default_value("0.1"))(
      "tokenizer", "a tiktoken rank file (gpt2.tiktoken) or a Hugging Face tokenizer.json (byte-level BPE: GPT-2, "
      "Llama 3, Qwen2)",
      cxxopts::value<std::string>())(
      "threads", "threads that encode with --tokenizer (0 = the CPUs this container may use)",
      cxxopts::value<int>()->default_value("0"))(
      "end-of-text", "the special token that ends each document (default: the tokenizer's <|endoftext|>, else "
      "<|end_of_text|>)", cxxopts::value<std::string>()->default_value(""))(
      "h,help", "this help");
  auto a = parse(o, argc, argv, "convert-text");
  if (a.count("help")) {
    std::cout << o.help() << std::endl;
    return kExitOk;
  }
  std::vector<std::string> src;
  std::stringstream ss(a["src"].as<std::string>());
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) src.push_back(item);
  data::TextOptions options;
  if (a.count("tokenizer")) options.tokenizer = std::make_shared<const data::Tokenizer>(data::Tokenizer::load(a["tokenizer"].as<std::string>()));
  options.threads = a["threads"].as<int>();
  if (options.threads < 0) throw std::runtime_error("convert-text: --threads must be 0 (the CPUs this container may use) or more");
  if (options.threads == 0) options.threads = std::max(1, usable_cpus());
  options.end_of_text = a["end-of-text"].as<std::string>();
  std::cout << data::convert_text(src, a["out"].as<std::string>(), a["val-fraction"].as<double>(), options).summary() << std::endl;
  return kExitOk;
}

int convert_bin_main(int argc, char** argv) {
  cxxopts::Options o("trainer convert-bin", "Convert nanoGPT's uint16 token files (train.bin, val.bin) to the trainer's "
                                           "HDF5 token format: DIR/train.h5 from train.bin, and so on");
  o.add_options()("src", "raw little-endian uint16 token files (comma-separated)", cxxopts::value<std::string>())(
      "vocab", "the vocabulary (50257 for GPT-2's BPE); every token must be below it", cxxopts::value<int64_t>())(
      "out", "output folder", cxxopts::value<std::string>())("h,help", "this help");
  auto a = parse(o, argc, argv, "convert-bin");
  if (a.count("help")) {
    std::cout << o.help() << std::endl;
    return kExitOk;
  }
  for (const char* required : {"src", "vocab", "out"})
    if (!a.count(required)) throw std::runtime_error(std::string("convert-bin: --") + required + " is required (see trainer convert-bin --help)");
  const fs::path out = a["out"].as<std::string>();
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) throw std::runtime_error("convert-bin: cannot create " + out.string() + " (" + ec.message() + ")");
  std::stringstream ss(a["src"].as<std::string>());
  for (std::string src; std::getline(ss, src, ',');) {
    if (src.empty()) continue;
    const std::string dst = (out / fs::path(src).stem()).string() + ".h5";
    const int64_t n = data::convert_uint16_bin(src, a["vocab"].as<int64_t>(), dst);
    std::cout << "converted " << src << " -> " << dst << ": " << n << " tokens (vocab " << a["vocab"].as<int64_t>()
              << ")" << std::endl;
  }
  return kExitOk;
}

int eval_main(int argc, char** argv) {
  cxxopts::Options o("trainer eval", "Score a run's latest checkpoint, a chosen checkpoint, or model.init_from weights on "
                                     "a split; writes one JSON file and prints one line");
  o.add_options()("run-dir", "score this run's latest checkpoint", cxxopts::value<std::string>()->default_value(""))(
      "checkpoint", "score this checkpoint folder", cxxopts::value<std::string>()->default_value(""))(
      "c,config", "config (default: the checkpoint's own; without a checkpoint, the weights are model.init_from)",
      cxxopts::value<std::string>()->default_value(""))(
      "split", "test (data.test), train (data.train) or a file", cxxopts::value<std::string>()->default_value("test"))(
      "out", "the JSON file (default: <run-dir>/eval.json, else ./eval.json)",
      cxxopts::value<std::string>()->default_value(""))(
      "weights", "ema (the checkpoint's averaged weights, train.ema_decay) | raw (the trained weights) | auto (ema "
      "where the checkpoint has them, else raw)", cxxopts::value<std::string>()->default_value("auto"))(
      "h,help", "this help");
  EvalCommand cmd;
  std::vector<char*> rest = take_sets(argc, argv, cmd.overrides);
  auto a = parse(o, static_cast<int>(rest.size()), rest.data(), "eval");
  if (a.count("help")) {
    std::cout << o.help() << "\n  -s, --set key=value  override a config key (repeatable)" << std::endl;
    return kExitOk;
  }
  cmd.run_dir = a["run-dir"].as<std::string>();
  cmd.checkpoint = a["checkpoint"].as<std::string>();
  cmd.config_path = a["config"].as<std::string>();
  cmd.split = a["split"].as<std::string>();
  cmd.out = a["out"].as<std::string>();
  cmd.weights = a["weights"].as<std::string>();
  try {
    std::cout << run_eval_command(cmd).second << std::endl;
  } catch (const std::exception& e) {
    if (!is_oom_error(e)) throw;
    std::cerr << "error: eval: out of memory even at an evaluation micro-batch of 1 (raise memory.limit)" << std::endl;
    return kExitOomGaveUp;
  }
  return kExitOk;
}

int sample_main(int argc, char** argv) {
  cxxopts::Options o("trainer sample", "Generate text from a GPT: a run's latest checkpoint, a chosen checkpoint, or a "
                                       "weights file (transformers' GPT-2 safetensors); prints the samples, the speed "
                                       "to stderr");
  o.add_options()("run-dir", "the run: its latest checkpoint and its config", cxxopts::value<std::string>()->default_value(""))(
      "checkpoint", "this checkpoint folder", cxxopts::value<std::string>()->default_value(""))(
      "init-from", "weights file (safetensors or torch.save); the shape from --run-dir's config or config.json beside it",
      cxxopts::value<std::string>()->default_value(""))(
      "lora", "a peft LoRA adapter folder (adapter_config.json, adapter_model.safetensors) on --init-from's weights",
      cxxopts::value<std::string>()->default_value(""))(
      "tokenizer", "tokenizer file (gpt2.tiktoken, tokenizer.json); default: the run's token files', else bytes",
      cxxopts::value<std::string>()->default_value(""))(
      "prompt", "the text to continue", cxxopts::value<std::string>())(
      "tokens", "new tokens per sample", cxxopts::value<int64_t>()->default_value("256"))(
      "temperature", "divides the logits; 0 = greedy", cxxopts::value<double>()->default_value("0.8"))(
      "top-k", "sample among the k most likely tokens (0 = all)", cxxopts::value<int64_t>()->default_value("200"))(
      "seed", "the sampling generator's seed", cxxopts::value<uint64_t>()->default_value("1337"))(
      "num-samples", "samples to draw", cxxopts::value<int64_t>()->default_value("1"))(
      "no-kv-cache", "run the whole window for every token instead of one position (to compare speeds)")(
      "device", "cpu | cuda | cuda:N | auto (default: the run's train.device)", cxxopts::value<std::string>()->default_value(""))(
      "json", "also write the samples' tokens and the speed to this JSON file", cxxopts::value<std::string>()->default_value(""))(
      "h,help", "this help");
  SampleCommand cmd;
  std::vector<char*> rest = take_sets(argc, argv, cmd.overrides);
  auto a = parse(o, static_cast<int>(rest.size()), rest.data(), "sample");
  if (a.count("help")) {
    std::cout << o.help() << "\n  -s, --set key=value  override a key of the run's config (repeatable)" << std::endl;
    return kExitOk;
  }
  if (!a.unmatched().empty()) throw std::runtime_error("sample: unexpected argument '" + a.unmatched()[0] + "' (see trainer sample --help)");
  if (!a.count("prompt")) throw std::runtime_error("sample: --prompt is required (see trainer sample --help)");
  setup_logging("", "info");  // stderr: stdout carries the samples only
  cmd.run_dir = a["run-dir"].as<std::string>();
  cmd.checkpoint = a["checkpoint"].as<std::string>();
  cmd.init_from = a["init-from"].as<std::string>();
  cmd.lora = a["lora"].as<std::string>();
  cmd.tokenizer = a["tokenizer"].as<std::string>();
  cmd.prompt = a["prompt"].as<std::string>();
  cmd.device = a["device"].as<std::string>();
  cmd.json = a["json"].as<std::string>();
  cmd.num_samples = a["num-samples"].as<int64_t>();
  cmd.generate.max_new_tokens = a["tokens"].as<int64_t>();
  cmd.generate.temperature = a["temperature"].as<double>();
  cmd.generate.top_k = a["top-k"].as<int64_t>();
  cmd.generate.seed = a["seed"].as<uint64_t>();
  cmd.generate.kv_cache = a.count("no-kv-cache") == 0;
  const SampleResult r = run_sample_command(cmd);
  for (const auto& text : r.texts) std::cout << text << "\n---------------" << std::endl;
  std::cerr << r.speed_line << std::endl;
  return kExitOk;
}

int export_main(int argc, char** argv) {
  cxxopts::Options o("trainer export", "Write a run's latest (or a given) checkpoint's weights as a file Python loads: a "
                                       "torch.save state dict or safetensors, with our names or those of transformers or timm");
  o.add_options()("run-dir", "run folder", cxxopts::value<std::string>())(
      "checkpoint", "a checkpoint folder (default: the run's latest)", cxxopts::value<std::string>()->default_value(""))(
      "out", "output file, or an existing folder (model.safetensors / model.pt in it)", cxxopts::value<std::string>())(
      "format", "pt (torch.save) | safetensors (default: safetensors for an --out ending in .safetensors, else pt)",
      cxxopts::value<std::string>()->default_value(""))(
      "layout", "ours | hf (transformers' GPT2LMHeadModel or LlamaForCausalLM, with config.json beside the file) | timm "
      "(ResNet-18..152, ViT) | peft (a LoRA run's adapters: --out is a folder for PeftModel.from_pretrained)",
      cxxopts::value<std::string>()->default_value("ours"))(
      "merge", "a LoRA run: the model with its adapters merged into the weights (layout hf or ours)")(
      "weights", "ema (the averaged weights, train.ema_decay) | raw (the trained weights) | auto (ema where the "
      "checkpoint has them, else raw)", cxxopts::value<std::string>()->default_value("auto"))("h,help", "this help");
  auto a = o.parse(argc, argv);
  if (a.count("help") || !a.count("out") || (!a.count("run-dir") && a["checkpoint"].as<std::string>().empty())) {
    std::cout << o.help() << std::endl;
    return a.count("help") ? kExitOk : kExitBadInput;
  }
  std::string run_dir = a.count("run-dir") ? a["run-dir"].as<std::string>() : "";
  ExportOptions options;
  options.format = a["format"].as<std::string>();
  options.layout = a["layout"].as<std::string>();
  options.weights = a["weights"].as<std::string>();
  options.merge = a.count("merge") > 0;
  const ExportResult r = export_weights(run_dir, a["checkpoint"].as<std::string>(), a["out"].as<std::string>(), options);
  std::cout << "wrote " << r.weights << (r.config.empty() ? "" : " and " + r.config) << " from " << r.checkpoint
            << (r.weight_set == "ema" ? " (averaged weights)" : "") << "\n"
            << "load it in Python with: " << r.how_to_load << std::endl;
  return kExitOk;
}

int plan_main(int argc, char** argv) {
  cxxopts::Options o("trainer plan", "The memory a job will need, counted from its config and its model's shape before "
                                     "anything is allocated: weights, gradients, optimizer state, EMA, batches, activations "
                                     "per sample, and the rung it will run on under memory.limit; exit 0 when it fits, 3 "
                                     "when it does not (naming the settings that would)");
  o.add_options()("c,config", "YAML config (default: the built-in job)", cxxopts::value<std::string>()->default_value(""))(
      "json", "also write the plan to this JSON file", cxxopts::value<std::string>()->default_value(""))(
      "h,help", "this help");
  std::vector<std::string> sets;
  std::vector<char*> rest = take_sets(argc, argv, sets);
  auto a = parse(o, static_cast<int>(rest.size()), rest.data(), "plan");
  if (a.count("help")) {
    std::cout << o.help() << "\n  -s, --set key=value  override a config key (repeatable)" << std::endl;
    return kExitOk;
  }
  if (!a.unmatched().empty()) throw std::runtime_error("plan: unexpected argument '" + a.unmatched()[0] + "' (see trainer plan --help)");
  const Config cfg = load_config(a["config"].as<std::string>(), sets);
  const PlanReport report = plan_report(cfg);
  const std::string json = a["json"].as<std::string>();
  if (!json.empty()) {
    std::ofstream out(json);
    out << plan_report_json(report).dump(2) << "\n";
    if (!out) throw std::runtime_error("plan: cannot write " + json);
  }
  std::cout << render_plan_report(report) << std::flush;
  return report.plan.fits ? kExitOk : kExitOomGaveUp;
}

// A dry run checks the config and the model, not the data: a training file that does not exist yet is
// a warning, and the summary is made as for synthetic data (data.shape, or the model's vocabulary).
void dry_run(const Config& cfg) {
  const bool tokens = token_job(cfg);  // also checks that the data kind fits the model
  Config assumed = cfg;
  std::error_code ec;
  if (cfg.data.kind != DataKind::kSynthetic && !fs::exists(cfg.data.train, ec)) {
    assumed.data.kind = DataKind::kSynthetic;
    std::ostringstream what;
    if (tokens) what << "model.vocab_size " << vocab_size(assumed);
    else what << "data.shape [" << cfg.data.shape[0] << ", " << cfg.data.shape[1] << ", " << cfg.data.shape[2] << "]";
    std::cerr << "warning: data.train '" << cfg.data.train << "' does not exist; the model summary assumes "
              << what.str() << std::endl;
  }
  const auto shape = sample_shape(assumed);
  auto model = build_model(assumed, shape, tokens ? vocab_size(assumed) : 0);
  const std::string summary = models::summarize(*model, shape);  // before any output: it may throw
  std::cout << "# resolved config\n" << to_yaml(cfg) << "\n";
  std::cout << "# model\n" << summary << "\n";
  std::cout << "# memory\n" << describe_memory_limit(cfg) << "\n\n";
  std::cout << "# memory plan (trainer plan)\n" << render_plan_report(plan_report(assumed)) << std::flush;
}

}  // namespace

int cli_main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "convert-idx") return convert_idx_main(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "convert-text") return convert_text_main(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "convert-images") return convert_images_main(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "convert-bin") return convert_bin_main(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "eval") return eval_main(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "export") return export_main(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "sample") return sample_main(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "compare") return compare_main(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "bench") return bench_main(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "plan") return plan_main(argc - 1, argv + 1);

  cxxopts::Options o("trainer", "Train ResNets (and Transformers) on LibTorch; backs off instead of dying when memory runs out.\n"
                                "Subcommands: trainer convert-idx --help, trainer convert-images --help, trainer convert-text --help,\n"
                                "trainer convert-bin --help, trainer eval --help, trainer sample --help, trainer export --help, trainer compare --help,\n"
                                "trainer bench --help, trainer plan --help");
  o.add_options()("c,config", "YAML config (default: the built-in ResNet-20 / Fashion-MNIST job)",
                  cxxopts::value<std::string>()->default_value(""))(
      "s,set", "override a key: --set train.global_batch=256 (repeatable)", cxxopts::value<std::string>())(
      "run-dir", "run folder (default: runs/<config name>)", cxxopts::value<std::string>()->default_value(""))(
      "resume", "resume from this checkpoint folder (no fallback)", cxxopts::value<std::string>()->default_value(""))(
      "no-resume", "start fresh; refuse a run folder that already has checkpoints")(
      "wait-for-run-dir", "when another trainer holds the run folder, wait up to this many seconds for it to let go "
      "(then resume from what it saved); default: refuse at once, exit 2",
      cxxopts::value<double>()->default_value("0"))(
      "dry-run", "print the resolved config and a model summary, then exit")(
      "list-keys", "print every config key (a key with a fixed set of values: with them)")("version", "print versions")("h,help", "this help");
  std::vector<std::string> sets;
  std::vector<char*> rest = take_sets(argc, argv, sets);
  int rest_argc = static_cast<int>(rest.size());
  cxxopts::ParseResult a;
  try {
    a = o.parse(rest_argc, rest.data());
  } catch (const std::exception& e) {  // cxxopts 2.x and 3.x name their exception types differently
    throw std::runtime_error(std::string("command line: ") + e.what() + " (see trainer --help)");
  }
  if (a.count("help")) {
    std::cout << o.help() << std::endl;
    return kExitOk;
  }
  if (a.count("version")) {
    std::cout << "trainer " << TRAINER_VERSION << ", LibTorch " << compat::torch_version()
#ifdef TRAINER_WITH_CUDA
              << " with CUDA " << CUDART_VERSION / 1000 << "." << CUDART_VERSION % 1000 / 10
#endif
              << std::endl;
    return kExitOk;
  }
  if (a.count("list-keys")) {
    for (const auto& k : config_keys()) {  // a mode key with the names it takes: "data.kind: hdf5 | ..."
      std::string names;
      for (const auto& n : config_key_modes(k)) names += (names.empty() ? ": " : " | ") + n;
      std::cout << k << names << "\n";
    }
    return kExitOk;
  }
  if (!a.unmatched().empty()) throw std::runtime_error("command line: unexpected argument '" + a.unmatched()[0] + "'");
  std::string config_path = a["config"].as<std::string>();
  Config cfg = load_config(config_path, sets);
  if (a.count("dry-run")) {
    dry_run(cfg);
    return kExitOk;
  }
  RunOptions ro;
  ro.run_dir = a["run-dir"].as<std::string>();
  if (ro.run_dir.empty())
    ro.run_dir = "runs/" + (config_path.empty() ? std::string("default") : fs::path(config_path).stem().string());
  ro.resume_from = a["resume"].as<std::string>();
  ro.no_resume = a.count("no-resume") > 0;
  ro.config_file = config_path;
  ro.wait_for_run_dir_s = a["wait-for-run-dir"].as<double>();
  if (!(ro.wait_for_run_dir_s >= 0) || !std::isfinite(ro.wait_for_run_dir_s))
    throw std::runtime_error("command line: --wait-for-run-dir must be a number of seconds >= 0, got " +
                             std::to_string(ro.wait_for_run_dir_s));
  return train(cfg, ro);
}

}  // namespace trainer
