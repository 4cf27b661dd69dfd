#include "trainer/commands/sample_command.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>

#include <spdlog/spdlog.h>

#include "common/compat.h"
#include "common/files.h"
#include "data/files/token_h5.h"
#include "data/text/tokenizer.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "models/registry.h"
#include "trainer/checkpoint/state_dict.h"
#include "trainer/checkpoint/store.h"
#include "trainer/checkpoint/weights.h"
#include "trainer/hf/families.h"
#include "trainer/memory/resources.h"
#include "trainer/run/from_config.h"
#include "trainer/hf/peft.h"
#include "trainer/run/lora.h"

namespace fs = std::filesystem;

namespace trainer {
namespace {

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error("sample: " + what); }

// The tokenizer's end-of-text id (data::end_of_text_of: GPT-2's and Qwen2's <|endoftext|>, Llama 3's
// <|end_of_text|>), or -1.
int32_t end_of_text_id(const data::Tokenizer& tok) {
  const std::string name = data::end_of_text_of(tok);
  return name.empty() ? -1 : tok.special(name);
}

void check_numbers(const SampleCommand& c) {
  const GenerateOptions& g = c.generate;
  if (g.max_new_tokens < 1) fail("--tokens must be at least 1, got " + std::to_string(g.max_new_tokens));
  if (!(g.temperature >= 0) || !std::isfinite(g.temperature))
    fail("--temperature must be a number >= 0 (0 = greedy), got " + std::to_string(g.temperature));
  if (g.top_k < 0) fail("--top-k must be >= 0 (0 = every token), got " + std::to_string(g.top_k));
  if (c.num_samples < 1) fail("--num-samples must be at least 1, got " + std::to_string(c.num_samples));
  if (c.run_dir.empty() && c.checkpoint.empty() && c.init_from.empty())
    fail("nothing to sample from; give --run-dir DIR, --checkpoint DIR or --init-from FILE");
  if (!c.checkpoint.empty() && !c.init_from.empty())
    fail("give either --checkpoint or --init-from, not both");
}

// What generates: the model with its weights, its config, where the weights came from.
struct Loaded {
  std::shared_ptr<models::LanguageModelImpl> model;
  Config cfg;
  std::string weights;
  std::optional<int64_t> step;
  std::string recorded_tokenizer;  // the run's token file's tokenizer_path ("" = bytes or not known)
};

// The vocabulary the run's model was built with, and the tokenizer its token file records.
int64_t run_vocab(const Config& cfg, std::string& tokenizer_path) {
  std::error_code ec;
  if (cfg.data.kind == DataKind::kTokens) {
    if (!fs::exists(cfg.data.train, ec)) {
      if (cfg.model.vocab_size > 0) return cfg.model.vocab_size;
      fail("the run's token file data.train (" + cfg.data.train +
           ") is not here, and the model's vocabulary is read from it; give --set data.train=FILE, or --set "
           "model.vocab_size=N with --tokenizer FILE");
    }
    check_data_file(cfg, cfg.data.train, /*in_memory=*/false);
    tokenizer_path = data::TokenDataset(cfg.data.train, /*in_memory=*/false).tokenizer_path();
  }
  return vocab_size(cfg);
}

std::shared_ptr<models::LanguageModelImpl> as_language_model(const models::Model& m, const std::string& name) {
  auto lm = std::dynamic_pointer_cast<models::LanguageModelImpl>(m);
  if (!lm) fail("model '" + name + "' is not a language model; only language models sample");
  return lm;
}

void check_language_model(const Config& cfg) {
  if (models::registered_vocab_size(cfg.model.name) == 0)
    fail("model '" + cfg.model.name + "' is not a language model; only language models sample");
}

// A run's checkpoint (its own config), or a weights file with the run's config (--run-dir + --init-from).
Loaded load_from_run(const SampleCommand& c) {
  Loaded l;
  std::optional<LoadedCheckpoint> ck;
  std::error_code ec;
  if (!c.run_dir.empty() && !fs::is_directory(c.run_dir, ec)) fail("run folder '" + c.run_dir + "' does not exist");
  if (!c.checkpoint.empty()) {
    ck = CheckpointStore::load(c.checkpoint);
  } else if (c.init_from.empty()) {
    ck = CheckpointStore(c.run_dir, 0).load_latest();
    if (!ck) fail(c.run_dir + " has no checkpoint to sample from");
  }
  if (ck) {
    apply_yaml_text(l.cfg, ck->file("config.yaml"), ck->path + "/config.yaml");
    l.weights = ck->path;
    l.step = ck->step;
  } else {
    const std::string resolved = c.run_dir + "/resolved_config.yaml";
    if (!fs::exists(resolved, ec)) fail(c.run_dir + " has no resolved_config.yaml to build the model from");
    apply_yaml_file(l.cfg, resolved);
    l.weights = c.init_from;
  }
  for (const auto& o : c.overrides) apply_override(l.cfg, o);
  if (!c.init_from.empty()) {
    // --init-from replaces the run's weights, not its shape: a model.name llama run keeps reading its shape
    // from the config.json of the Hub folder it started from (as eval, export and a resume do).
    if (l.cfg.model.name == "llama" && l.cfg.model.hf_config.empty()) l.cfg.model.hf_config = l.cfg.model.init_from;
    l.cfg.model.init_from = c.init_from;
    l.cfg.model.init_skip.clear();
  }
  validate(l.cfg);
  check_language_model(l.cfg);
  const int64_t vocab = run_vocab(l.cfg, l.recorded_tokenizer);
  torch::manual_seed(l.cfg.seed);
  auto model = build_model(l.cfg, sample_shape(l.cfg), vocab);
  load_run_weights(*model, l.cfg, vocab, ck ? &*ck : nullptr, "model.pt");
  l.model = as_language_model(model, l.cfg.model.name);
  return l;
}

// A weights file (or a Hub folder) alone: the shape from transformers' config.json beside it, GPT-2's or
// the Llama family's (trainer/hf/families.h).
Loaded load_from_file(const SampleCommand& c) {
  Loaded l;
  const std::string json_path = hf::config_json_of(c.init_from);
  std::error_code ec;
  if (!fs::exists(c.init_from, ec)) fail("--init-from " + c.init_from + " does not exist");
  if (!fs::exists(json_path, ec))
    fail("--init-from " + c.init_from + ": the model's shape is read from " + json_path +
         " (transformers' save_pretrained and trainer export --layout hf write it), which is not there; or give "
         "--run-dir DIR to build the model from that run's config");
  const nlohmann::json j = hf::read_config_json(json_path);
  l.cfg = load_config("", c.overrides);  // the built-in job's keys with --set on top: train.threads, train.device
  int64_t vocab = 0;
  if (hf::family_of(j) == "llama") {
    const hf::LlamaConfig arch = hf::llama_from_json(j, json_path);
    for (const auto& note : arch.notes) spdlog::info("model: {}: {}", json_path, note);
    hf::check_llama_weights(arch.options, read_weights(c.init_from).tensors, json_path);
    l.model = std::make_shared<models::LlamaImpl>(arch.options);
    l.cfg.model.name = "llama";
    l.cfg.model.hf_config = json_path;
    vocab = 0;
  } else {
    const models::GPTOptions options = hf::gpt2_from_json(j, json_path);
    l.model = std::make_shared<models::GPTImpl>(options);
    l.cfg.model.name = "gpt2";
    vocab = options.vocab_size();
  }
  const LoadedWeights w = load_weights(*l.model, c.init_from, {}, vocab);
  spdlog::info("model: weights from {} ({}, {} layout)", c.init_from, w.format, w.layout);
  if (!c.lora.empty()) {  // as peft's PeftModel.from_pretrained(base, folder): the folder's own r, alpha, targets
    const hf::PeftAdapter adapter = hf::read_peft_adapter(c.lora);
    try {
      models::add_lora(*l.model, adapter.options);
    } catch (const models::LoraError& e) {
      fail("--lora " + c.lora + ": " + e.what());
    }
    hf::load_peft_adapter(*l.model, adapter, adapter.options, "--lora " + c.lora);
    spdlog::info("model: LoRA adapters from {} (r {}, alpha {})", c.lora, adapter.options.rank, adapter.options.alpha);
  }
  l.cfg.model.context = l.model->context();
  l.weights = c.init_from;
  return l;
}

data::Tokenizer pick_tokenizer(const SampleCommand& c, const Loaded& l, int64_t vocab) {
  if (!c.tokenizer.empty()) return data::Tokenizer::load(c.tokenizer);
  if (!l.recorded_tokenizer.empty()) {
    std::error_code ec;
    if (!fs::exists(l.recorded_tokenizer, ec))
      fail("the run's token file records the tokenizer " + l.recorded_tokenizer + ", which is not there; give --tokenizer FILE");
    return data::Tokenizer::load(l.recorded_tokenizer);
  }
  if (vocab > 256)
    fail("the model's vocabulary is " + std::to_string(vocab) +
         " and no tokenizer is recorded for it (byte tokens are 256); give --tokenizer FILE (e.g. gpt2.tiktoken)");
  return data::Tokenizer::bytes();
}

// Printable text of `ids`: an id the tokenizer does not have (a padded vocabulary's) as U+FFFD.
std::string printable(const data::Tokenizer& tok, const std::vector<int64_t>& ids) {
  std::string bytes;
  std::vector<int32_t> run;
  for (int64_t id : ids) {
    if (id >= 0 && id < tok.vocab_size()) {
      run.push_back(static_cast<int32_t>(id));
      continue;
    }
    bytes += tok.decode(run) + "\xEF\xBF\xBD";
    run.clear();
  }
  return data::replace_invalid_utf8(bytes + tok.decode(run));
}

// The prompt's ids as transformers' tokenizer(prompt) gives them: the post-processor's first token (Llama
// 3's <|begin_of_text|>) where it adds one, then the text with special tokens' texts recognised. An empty
// prompt starts from that first token, else from the end-of-text token. Refused when it is longer than
// the context or holds an id past the model's vocabulary.
std::vector<int64_t> prompt_ids(const std::string& text, const data::Tokenizer& tok, int64_t vocab, int64_t context) {
  std::vector<int64_t> prompt;
  if (tok.bos_id() >= 0) prompt.push_back(tok.bos_id());
  for (int32_t id : tok.encode_with_specials(text)) prompt.push_back(id);
  const int32_t eot = end_of_text_id(tok);
  if (prompt.empty()) {
    if (eot < 0)
      fail("the prompt is empty and the " + tok.name() + " tokenizer has no <|endoftext|> to start from; give --prompt TEXT");
    prompt.push_back(eot);
  }
  if (static_cast<int64_t>(prompt.size()) > context)
    fail("the prompt is " + std::to_string(prompt.size()) + " tokens, longer than the model's context of " +
         std::to_string(context) + "; shorten it");
  for (int64_t id : prompt)
    if (id >= vocab)
      fail("the prompt has token " + std::to_string(id) + ", outside the model's vocabulary of " + std::to_string(vocab) +
           (tok.is_bytes() ? " (byte tokens: a byte value)" : ""));
  return prompt;
}

// The record's n_layer, n_head, n_embd (and a Llama's n_kv_head).
nlohmann::json shape_json(const models::LanguageModelImpl& model) {
  if (const auto* gpt = dynamic_cast<const models::GPTImpl*>(&model))
    return {{"n_layer", gpt->options.n_layer()}, {"n_head", gpt->options.n_head()}, {"n_embd", gpt->options.n_embd()}};
  const auto& o = dynamic_cast<const models::LlamaImpl&>(model).options;
  return {{"n_layer", o.n_layer()}, {"n_head", o.n_head()}, {"n_kv_head", o.kv_heads()}, {"n_embd", o.n_embd()}};
}

}  // namespace

SampleResult run_sample_command(const SampleCommand& cmd) {
  check_numbers(cmd);
  if (!cmd.lora.empty() && (!cmd.run_dir.empty() || !cmd.checkpoint.empty() || cmd.init_from.empty()))
    fail("--lora puts a peft adapter on --init-from's weights alone (a LoRA run's checkpoint holds its own adapters)");
  Loaded l = cmd.run_dir.empty() && cmd.checkpoint.empty() ? load_from_file(cmd) : load_from_run(cmd);
  const torch::Device device = resolve_device(cmd.device.empty() ? l.cfg.train.device : cmd.device);
  apply_cpu_threads(cpu_threads(l.cfg, 1));
  auto& model = *l.model;
  model.to(device);
  model.eval();
  const int64_t vocab = model.vocab_size(), context = model.context();
  const data::Tokenizer tok = pick_tokenizer(cmd, l, vocab);

  GenerateOptions g = cmd.generate;
  const int32_t eot = end_of_text_id(tok);
  g.stop_token = eot;
  const std::vector<int64_t> prompt = prompt_ids(cmd.prompt, tok, vocab, context);

  const Generated out = generate(model, prompt, cmd.num_samples, g);

  SampleResult r;
  nlohmann::json samples = nlohmann::json::array();
  for (const auto& s : out.samples) {
    std::vector<int64_t> shown = prompt;
    // The text shown leaves out the tokens the tokenizer put there itself: the first token, or the
    // end-of-text an empty prompt started from.
    if (!shown.empty() && (shown[0] == tok.bos_id() || (prompt.size() == 1 && shown[0] == eot))) shown.erase(shown.begin());
    shown.insert(shown.end(), s.begin(), s.end());
    if (!s.empty() && s.back() == eot) shown.pop_back();
    r.texts.push_back(printable(tok, shown));
    samples.push_back({{"tokens", s}, {"text", r.texts.back()}});
  }
  char line[256];
  std::snprintf(line, sizeof line, "sample: %lld tokens in %.2f s, %.1f tokens/s (%s, %s, %d threads)",
                static_cast<long long>(out.new_tokens), out.seconds, out.tokens_per_s(),
                g.kv_cache ? "key-value cache" : "no cache", device.str().c_str(), at::get_num_threads());
  r.speed_line = line;
  r.json = {{"schema", "trainer-sample/1"},
            {"weights", l.weights},
            {"step", l.step ? nlohmann::json(*l.step) : nlohmann::json(nullptr)},
            {"model", l.cfg.model.name},
            {"context", context},
            {"vocab_size", vocab},
            {"tokenizer", tok.is_bytes() ? std::string("bytes") : tok.path()},
            {"prompt", data::replace_invalid_utf8(cmd.prompt)},
            {"prompt_tokens", prompt},
            {"max_new_tokens", g.max_new_tokens},
            {"temperature", g.temperature},
            {"top_k", g.top_k},
            {"seed", g.seed},
            {"kv_cache", g.kv_cache},
            {"samples", samples},
            {"new_tokens", out.new_tokens},
            {"seconds", out.seconds},
            {"tokens_per_s", out.tokens_per_s()},
            {"device", device.str()},
            {"threads", at::get_num_threads()},
            {"trainer", TRAINER_VERSION},
            {"torch", compat::torch_version()}};
  r.json.update(shape_json(model));
  if (!cmd.json.empty()) write_file_atomically(cmd.json, r.json.dump(2) + "\n", "sample");
  return r;
}

}  // namespace trainer
