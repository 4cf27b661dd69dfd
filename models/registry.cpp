#include "models/registry.h"

#include "models/footprint.h"

#include "models/gpt.h"
#include "models/llama.h"
#include "models/plain_cnn.h"
#include "models/resnet.h"
#include "models/vit.h"

#include <functional>
#include <optional>
#include <stdexcept>
#include <utility>

namespace models {
namespace {

// A family: how a name's architecture takes the options (resolve), then what builds it and what counts it
// (models/footprint.h) from the same resolved options.
struct Family {
  std::function<Model(const ModelOptions&)> make;
  std::function<Footprint(const ModelOptions&, const std::vector<int64_t>&, bool)> footprint;
};

template <class Options, class Impl, class Resolve, class Count>
Family family(Resolve resolve, Count count) {
  return {[resolve](const ModelOptions& o) -> Model { return std::make_shared<Impl>(resolve(o)); },
          [resolve, count](const ModelOptions& o, const std::vector<int64_t>& shape, bool fused) {
            return count(resolve(o), shape, fused);
          }};
}

Family resnet(ResNetOptions arch) {
  return family<ResNetOptions, ResNetImpl>(
      [arch](const ModelOptions& o) {
        auto opts = arch;
        opts.num_classes(o.num_classes()).in_channels(o.in_channels()).zero_init_residual(o.zero_init_residual());
        return opts;
      },
      [](const ResNetOptions& opts, const std::vector<int64_t>& shape, bool) { return resnet_footprint(opts, shape); });
}

Family plain_cnn() {
  return family<PlainCnnOptions, PlainCnnImpl>(
      [](const ModelOptions& o) { return PlainCnnOptions().in_channels(o.in_channels()).num_classes(o.num_classes()); },
      [](const PlainCnnOptions& opts, const std::vector<int64_t>& shape, bool) { return plain_cnn_footprint(opts, shape); });
}

// A non-zero option replaces the architecture's value.
void override_if_set(int64_t value, const std::function<void(int64_t)>& set) {
  if (value != 0) set(value);
}

Family gpt(GPTOptions arch) {
  return family<GPTOptions, GPTImpl>(
      [arch](const ModelOptions& o) {
        auto opts = arch;
        override_if_set(o.vocab_size(), [&](int64_t v) { opts.vocab_size(v); });
        override_if_set(o.context(), [&](int64_t v) { opts.context(v); });
        override_if_set(o.n_layer(), [&](int64_t v) { opts.n_layer(v); });
        override_if_set(o.n_head(), [&](int64_t v) { opts.n_head(v); });
        override_if_set(o.n_embd(), [&](int64_t v) { opts.n_embd(v); });
        opts.dropout(o.dropout()).vocab_multiple(o.vocab_multiple()).fused_bias(o.fused_bias());
        return opts;
      },
      gpt_footprint);
}

// A Llama-family model: ModelOptions::llama() whole when set, else `arch` (none: `llama`, which has no shape
// of its own) with the non-zero size options replacing its values. Dropout applies either way; fused_bias
// is GPT's and ignored.
Family llama(std::optional<LlamaOptions> arch) {
  return family<LlamaOptions, LlamaImpl>(
      [arch](const ModelOptions& o) {
        if (o.vocab_multiple() > 1)
          throw std::invalid_argument("model.vocab_multiple is for gpt models; Llama-family models take their "
                                      "vocabulary as it is (set model.vocab_multiple to 1)");
        if (o.llama()) return LlamaOptions(*o.llama()).dropout(o.dropout());
        if (!arch)
          throw std::invalid_argument("model 'llama' takes its shape from a transformers config.json (model.init_from "
                                      "a folder with config.json, or model.hf_config)");
        auto opts = *arch;
        override_if_set(o.vocab_size(), [&](int64_t v) { opts.vocab_size(v); });
        override_if_set(o.context(), [&](int64_t v) { opts.context(v); });
        override_if_set(o.n_layer(), [&](int64_t v) { opts.n_layer(v); });
        override_if_set(o.n_head(), [&](int64_t v) { opts.n_head(v); });
        override_if_set(o.n_embd(), [&](int64_t v) { opts.n_embd(v); });
        override_if_set(o.n_kv_head(), [&](int64_t v) { opts.n_kv_head(v); });
        override_if_set(o.intermediate_size(), [&](int64_t v) { opts.intermediate_size(v); });
        opts.dropout(o.dropout());
        return opts;
      },
      [](const LlamaOptions& opts, const std::vector<int64_t>& shape, bool fused) {
        check(opts);  // as LlamaImpl's constructor: a shape it would refuse is not counted
        return llama_footprint(opts, shape, fused);
      });
}

Family vit(ViTOptions arch) {
  return family<ViTOptions, ViTImpl>(
      [arch](const ModelOptions& o) {
        auto opts = arch;
        opts.num_classes(o.num_classes()).in_channels(o.in_channels()).dropout(o.dropout());
        override_if_set(o.image_size(), [&](int64_t v) { opts.image_size(v); });
        override_if_set(o.patch_size(), [&](int64_t v) { opts.patch_size(v); });
        override_if_set(o.n_layer(), [&](int64_t v) { opts.n_layer(v); });
        override_if_set(o.n_head(), [&](int64_t v) { opts.n_head(v); });
        override_if_set(o.n_embd(), [&](int64_t v) { opts.n_embd(v); });
        return opts;
      },
      vit_footprint);
}

struct Entry {
  std::string name;
  Family family;
  ModelTraits traits;
};

// The traits of each family: images in and classes out, or tokens in and the vocabulary out.
ModelTraits image_model(bool fixed_input_size = false) {
  ModelTraits t;
  t.fixed_input_size = fixed_input_size;
  return t;
}

ModelTraits language_model(int64_t vocab_size, bool pads_vocab, bool shape_from_hub = false) {
  ModelTraits t;
  t.task = Task::kLanguageModel;
  t.vocab_size = vocab_size;
  t.pads_vocab = pads_vocab;
  t.shape_from_hub = shape_from_hub;
  return t;
}

ModelTraits gpt_traits(const GPTOptions& o) { return language_model(o.vocab_size(), /*pads_vocab=*/true); }
ModelTraits llama_traits(const LlamaOptions& o) { return language_model(o.vocab_size(), /*pads_vocab=*/false); }

// The registry: one line per model, in the order model_names() lists them.
const std::vector<Entry>& registry() {
  static const std::vector<Entry> table = {
      {"resnet18", resnet(resnet18()), image_model()},
      {"resnet34", resnet(resnet34()), image_model()},
      {"resnet50", resnet(resnet50()), image_model()},
      {"resnet101", resnet(resnet101()), image_model()},
      {"resnet152", resnet(resnet152()), image_model()},
      {"resnet20", resnet(resnet20()), image_model()},
      {"resnet32", resnet(resnet32()), image_model()},
      {"resnet56", resnet(resnet56()), image_model()},
      {"plain_cnn", plain_cnn(), image_model()},
      {"gpt2", gpt(gpt2()), gpt_traits(gpt2())},
      {"gpt_tiny", gpt(gpt_tiny()), gpt_traits(gpt_tiny())},
      // `llama` has no shape of its own: a config.json's. Its vocabulary is LlamaOptions' default.
      {"llama", llama(std::nullopt), language_model(LlamaOptions().vocab_size(), false, /*shape_from_hub=*/true)},
      {"llama_tiny", llama(llama_tiny()), llama_traits(llama_tiny())},
      {"smollm2_135m", llama(smollm2_135m()), llama_traits(smollm2_135m())},
      {"llama3_2_1b", llama(llama3_2_1b()), llama_traits(llama3_2_1b())},
      {"qwen2_5_0_5b", llama(qwen2_5_0_5b()), llama_traits(qwen2_5_0_5b())},
      {"vit_tiny", vit(vit_tiny()), image_model(/*fixed_input_size=*/true)},
  };
  return table;
}

const Entry& entry(const std::string& name) {
  for (const auto& e : registry()) {
    if (e.name == name) return e;
  }
  std::string known;
  for (const auto& n : model_names()) known += (known.empty() ? "" : ", ") + n;
  throw std::invalid_argument("unknown model '" + name + "'; known models: " + known);
}

}  // namespace

Model create_model(const std::string& name, const ModelOptions& options) { return entry(name).family.make(options); }

Footprint model_footprint(const std::string& name, const ModelOptions& options, const std::vector<int64_t>& sample_shape,
                          bool fused_attention) {
  return entry(name).family.footprint(options, sample_shape, fused_attention);
}

const ModelTraits& model_traits(const std::string& name) { return entry(name).traits; }

int64_t registered_vocab_size(const std::string& name) { return entry(name).traits.vocab_size; }

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const auto& e : registry()) names.push_back(e.name);
  return names;
}

void to_channels_last(torch::nn::Module& module) {
  // set_data swaps the storage under the same tensor object, so the module's (and any optimizer's)
  // references stay valid; autograd is not involved.
  torch::NoGradGuard no_grad;
  auto convert = [](torch::Tensor& t) {
    if (t.defined() && t.dim() == 4) t.set_data(t.contiguous(torch::MemoryFormat::ChannelsLast));
  };
  for (auto& p : module.parameters(/*recurse=*/true)) convert(p);
  for (auto& b : module.buffers(/*recurse=*/true)) convert(b);
}

}  // namespace models
