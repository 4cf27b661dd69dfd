#include "trainer/numerics/generate.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <limits>

#include "common/clock.h"

namespace trainer {

int64_t next_token(const torch::Tensor& logits, const GenerateOptions& o, at::Generator& generator) {
  // On the CPU in float32: one small copy per token (the id is needed on the host anyway, for the stop
  // token and the next input), and the draw is the same on every device.
  auto l = logits.detach().to(torch::kCPU, torch::kFloat).reshape({-1});  // (V)
  if (o.temperature <= 0) return l.argmax().item<int64_t>();
  l = l / o.temperature;
  if (o.top_k > 0 && o.top_k < l.size(0)) {
    const auto kth = std::get<0>(l.topk(o.top_k)).index({o.top_k - 1});  // the k-th largest
    l = l.masked_fill(l < kth, -std::numeric_limits<float>::infinity());
  }
  auto probs = torch::softmax(l, -1);  // (V)
  return torch::multinomial(probs, 1, /*replacement=*/false, generator).item<int64_t>();
}

Generated generate(models::LanguageModelImpl& model, const std::vector<int64_t>& prompt, int64_t num_samples,
                   const GenerateOptions& o) {
  TORCH_CHECK(!prompt.empty(), "generate: the prompt has no tokens");
  const int64_t V = model.vocab_size(), context = model.context();
  for (int64_t id : prompt) TORCH_CHECK(id >= 0 && id < V, "generate: token ", id, " is outside the vocabulary of ", V);
  torch::NoGradGuard no_grad;
  const torch::Device device = model.parameters().front().device();
  auto as_input = [&](const int64_t* ids, int64_t n) {  // (1, n) int64 on the model's device
    return torch::from_blob(const_cast<int64_t*>(ids), {1, n}, torch::kLong).to(device);
  };
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  Generated out;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t s = 0; s < num_samples; ++s) {
    std::vector<int64_t> seq = prompt;
    models::KVCache cache = model.make_cache();
    torch::Tensor logits;  // (1, T, V): the last forward's
    for (int64_t n = 0; n < o.max_new_tokens; ++n) {
      const int64_t len = static_cast<int64_t>(seq.size());
      const int64_t start = std::max<int64_t>(0, len - context);  // the window nanoGPT crops to
      if (!o.kv_cache) {
        logits = model.forward(as_input(seq.data() + start, len - start));
      } else if (start == 0 && cache.length() < len) {
        // The positions not yet cached: the whole prompt first, then the one token drawn last.
        logits = model.forward_cached(as_input(seq.data() + cache.length(), len - cache.length()), cache);
      } else {
        // Past the context the positions shift by one each token: the window is recomputed.
        cache = model.make_cache();
        logits = model.forward_cached(as_input(seq.data() + start, len - start), cache);
      }
      const int64_t id = next_token(logits.select(1, logits.size(1) - 1), o, generator);
      seq.push_back(id);
      if (id == o.stop_token) break;
    }
    out.samples.emplace_back(seq.begin() + static_cast<int64_t>(prompt.size()), seq.end());
    out.new_tokens += static_cast<int64_t>(out.samples.back().size());
  }
  out.seconds = seconds_since(t0);
  return out;
}

}  // namespace trainer
