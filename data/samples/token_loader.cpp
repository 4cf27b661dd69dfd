#include "data/samples/token_loader.h"

#include "data/pixels/rng.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace data {
namespace {

// ---- random numbers -------------------------------------------------------------------------------------
// splitmix64 (data/pixels/rng.h): the window order depends only on (seed, epoch), not on torch's global
// generator, the thread, or the library version. This `below` (modulo rejection) predates rng.h's and
// stays: it fixes every token run's window order, and bench/reference.py repeats it.

class Rng {
 public:
  explicit Rng(uint64_t state) : state_(state) {}
  uint64_t next() { return mix64(state_ += 0x9e3779b97f4a7c15ULL); }
  // Uniform in [0, n) without modulo bias: reject the top partial copy of [0, n).
  uint64_t below(uint64_t n) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t r;
    do r = next();
    while (r >= limit);
    return r % n;
  }

 private:
  uint64_t state_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Sources

torch::Tensor TokenSource::slice(int64_t begin, int64_t n) const {
  auto t = torch::empty({n}, torch::kLong);
  read(begin, n, t.data_ptr<int64_t>());
  return t;
}

SyntheticTokens::SyntheticTokens(int64_t size, int64_t vocab_size, uint64_t seed)
    : size_(size), vocab_(vocab_size), state_(mix64(hash_key(seed, 0x73796e746fULL /* "synto" */))) {
  if (size < 1 || vocab_size < 1 || vocab_size > INT32_MAX) {
    throw std::invalid_argument("synthetic tokens: need size >= 1 and vocab_size in [1, 2^31), got size " +
                                std::to_string(size) + ", vocab_size " + std::to_string(vocab_size));
  }
}

void SyntheticTokens::read(int64_t begin, int64_t n, int64_t* out) const {
  if (begin < 0 || n < 0 || begin + n > size_) {
    throw std::out_of_range("synthetic tokens: tokens [" + std::to_string(begin) + ", " + std::to_string(begin + n) +
                            ") are outside [0, " + std::to_string(size_) + ")");
  }
  // Output k of splitmix64 is mix64(state + (k + 1) * golden): any position is one mix away.
  const auto v = static_cast<uint64_t>(vocab_);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t x = mix64(state_ + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(begin + i + 1));
    out[i] = static_cast<int64_t>(((x >> 32) * v) >> 32);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Loaders

namespace {

// Reads the windows starting at `starts` into a batch: inputs (B, T) and targets (B, T) shifted by one,
// in pinned memory if `pinned`.
void fill_windows(const TokenSource& ds, const std::vector<int64_t>& starts, int64_t T, Batch& b,
                  bool pinned = false) {
  const int64_t B = static_cast<int64_t>(starts.size());
  auto w = torch::empty({B, T + 1}, torch::kLong);  // (B, T + 1)
  int64_t* p = w.data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i) ds.read(starts[i], T + 1, p + i * (T + 1));
  const auto options = torch::TensorOptions().dtype(torch::kLong).pinned_memory(pinned);
  b.images = torch::empty({B, T}, options).copy_(w.slice(1, 0, T));      // (B, T)
  b.labels = torch::empty({B, T}, options).copy_(w.slice(1, 1, T + 1));  // (B, T)
  b.indices = starts;
}

// Rank r's slice [r*g/W, (r+1)*g/W) of a global batch of g samples.
std::pair<int64_t, int64_t> rank_slice(int64_t g, int64_t rank, int64_t world) {
  return {rank * g / world, (rank + 1) * g / world};
}

void check_rank(const char* who, int64_t rank, int64_t world) {
  if (world < 1 || rank < 0 || rank >= world) {
    throw std::invalid_argument(std::string(who) + ": rank must be in [0, world_size) with world_size >= 1, got rank " +
                                std::to_string(rank) + ", world_size " + std::to_string(world));
  }
}

void check_context(const char* who, const TokenSource& ds, int64_t T) {
  if (T < 1) throw std::invalid_argument(std::string(who) + ": context must be >= 1, got " + std::to_string(T));
  if (ds.size() < T + 1) {
    throw std::invalid_argument(std::string(who) + ": '" + ds.name() + "' has " + std::to_string(ds.size()) +
                                " tokens, fewer than context + 1 = " + std::to_string(T + 1));
  }
}

}  // namespace

TokenLoader::TokenLoader(std::shared_ptr<const TokenSource> dataset, TokenLoaderOptions options)
    : dataset_(std::move(dataset)), opt_(options) {
  TORCH_CHECK(dataset_, "TokenLoader: no dataset");
  opt_.pin_memory = opt_.pin_memory && torch::cuda::is_available();  // decided once, not per batch
  check_context("token loader", *dataset_, opt_.context);
  check_rank("token loader", opt_.rank, opt_.world_size);
  const int64_t full = (dataset_->size() - 1) / opt_.context;
  // One slot fewer than fit at offset 0 leaves at least T tokens of slack, so every epoch's offset can
  // shift the windows anywhere within a context length.
  slots_ = full >= 2 ? full - 1 : 1;
  const int64_t G = opt_.global_batch;
  if (G < 1 || G > slots_ || G < opt_.world_size) {
    throw std::invalid_argument("token loader: global_batch must be in [max(1, world_size), windows per epoch], got " +
                                std::to_string(G) + " with world_size " + std::to_string(opt_.world_size) + " and " +
                                std::to_string(slots_) + " windows of " + std::to_string(opt_.context) + " tokens in '" +
                                dataset_->name() + "'");
  }
}

std::vector<int64_t> TokenLoader::epoch_windows(int64_t epoch) const {
  const int64_t T = opt_.context, S = slots_;
  Rng rng(mix64(mix64(opt_.seed) + 0x9e3779b97f4a7c15ULL * (static_cast<uint64_t>(epoch) + 1)) ^ 0x746f6b656e73ULL);
  const int64_t max_offset = dataset_->size() - 1 - S * T;
  const int64_t offset = static_cast<int64_t>(rng.below(static_cast<uint64_t>(max_offset) + 1));
  std::vector<int64_t> starts(S);
  for (int64_t s = 0; s < S; ++s) starts[s] = s;
  for (int64_t i = S - 1; i > 0; --i) std::swap(starts[i], starts[rng.below(static_cast<uint64_t>(i) + 1)]);  // Fisher-Yates
  for (auto& s : starts) s = offset + s * T;
  return starts;
}

const std::vector<int64_t>& TokenLoader::cached_windows(int64_t epoch) const {
  if (cached_epoch_ != epoch) {
    cached_ = epoch_windows(epoch);
    cached_epoch_ = epoch;
  }
  return cached_;
}

LoaderState TokenLoader::normalized(LoaderState s) const {
  if (s.position + opt_.global_batch > slots_) return {s.epoch + 1, 0};
  return s;
}

Batch TokenLoader::batch_at(int64_t epoch, int64_t position) const {
  const auto s = normalized({epoch, position});
  const auto& order = cached_windows(s.epoch);
  const auto [lo, hi] = rank_slice(opt_.global_batch, opt_.rank, opt_.world_size);
  std::vector<int64_t> starts(order.begin() + s.position + lo, order.begin() + s.position + hi);
  Batch b;
  fill_windows(*dataset_, starts, opt_.context, b, opt_.pin_memory);
  b.epoch = s.epoch;
  b.position = s.position;
  b.global_size = opt_.global_batch;
  return b;
}

Batch TokenLoader::next() {
  Batch b = batch_at(consumed_.epoch, consumed_.position);
  consumed_ = normalized({b.epoch, b.position + opt_.global_batch});
  return b;
}

void TokenLoader::seek(int64_t epoch, int64_t position) {
  if (epoch < 0 || position < 0 || position > slots_) {
    throw std::invalid_argument("token loader: seek needs epoch >= 0 and position in [0, " + std::to_string(slots_) +
                                "], got epoch " + std::to_string(epoch) + ", position " + std::to_string(position));
  }
  consumed_ = normalized({epoch, position});
}

TokenEvalLoader::TokenEvalLoader(std::shared_ptr<const TokenSource> dataset, TokenEvalOptions options)
    : dataset_(std::move(dataset)), opt_(options) {
  TORCH_CHECK(dataset_, "TokenEvalLoader: no dataset");
  check_context("token evaluation loader", *dataset_, opt_.context);
  check_rank("token evaluation loader", opt_.rank, opt_.world_size);
  if (opt_.batch < 1) throw std::invalid_argument("token evaluation loader: batch must be >= 1, got " + std::to_string(opt_.batch));
  windows_ = (dataset_->size() - 1) / opt_.context;
}

std::optional<Batch> TokenEvalLoader::next() {
  if (next_window_ >= windows_) return std::nullopt;
  const int64_t g = std::min(opt_.batch, windows_ - next_window_);
  const auto [lo, hi] = rank_slice(g, opt_.rank, opt_.world_size);
  std::vector<int64_t> starts;
  for (int64_t j = next_window_ + lo; j < next_window_ + hi; ++j) starts.push_back(j * opt_.context);
  Batch b;
  fill_windows(*dataset_, starts, opt_.context, b);
  b.epoch = 0;
  b.position = next_window_;
  b.global_size = g;
  next_window_ += g;
  return b;
}

}  // namespace data
