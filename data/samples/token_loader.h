// Token streams for language models: what the loaders read (TokenSource: a trainer.tokens file, which
// is TokenDataset in data/files/token_h5.h, or generated tokens), and the training and evaluation
// loaders.
//
// Training windows. A split of N tokens and a context T hold S = floor((N - 1) / T) - 1 non-overlapping
// window slots (S = 1 when floor((N - 1) / T) = 1). Epoch e draws, from (seed, e) alone, an offset o_e
// uniform in [0, N - 1 - S*T] and a permutation pi_e of the slots; the sample at position p of epoch e
// is the window of T + 1 tokens starting at o_e + pi_e(p) * T: inputs are its first T tokens, targets its
// last T (the inputs shifted by one). An epoch is one pass over the S slots; positions count windows.
// Global batch k covers positions [p, p + G); an epoch ends when fewer than G slots remain (those are
// skipped), so steps_per_epoch() = S / G. With world_size W, rank r takes the contiguous slice
// [r*G/W, (r+1)*G/W) of each global batch.
#pragma once

#include "data/samples/batch.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace data {

/// A stream of tokens the loaders read: a trainer.tokens file (TokenDataset) or generated tokens
/// (SyntheticTokens). read() may be called from several threads at once.
class TokenSource {
 public:
  virtual ~TokenSource() = default;
  /// Tokens in the stream, N.
  virtual int64_t size() const = 0;
  /// Every token is in [0, vocab_size).
  virtual int64_t vocab_size() const = 0;
  /// What messages call the stream: the file's path, or "synthetic tokens".
  virtual const std::string& name() const = 0;
  /// Copies tokens [begin, begin + n) to out. Throws std::out_of_range outside [0, N).
  virtual void read(int64_t begin, int64_t n, int64_t* out) const = 0;
  /// Tokens [begin, begin + n) as an int64 tensor (n).
  torch::Tensor slice(int64_t begin, int64_t n) const;
};

/// `size` tokens generated on demand, each from (seed, position) alone: token k is
/// floor(hi32(x_k) * vocab_size / 2^32), where x_k is output k (from 0) of splitmix64 started at
/// state mix64(hash_key(seed, 0x73796e746f)) (data/pixels/rng.h). Nothing is stored; the same position always
/// gives the same token. The tokens carry nothing to learn: this stream measures speed.
class SyntheticTokens : public TokenSource {
 public:
  /// Throws std::invalid_argument unless size >= 1 and vocab_size is in [1, 2^31).
  SyntheticTokens(int64_t size, int64_t vocab_size, uint64_t seed);
  int64_t size() const override { return size_; }
  int64_t vocab_size() const override { return vocab_; }
  const std::string& name() const override { return name_; }
  void read(int64_t begin, int64_t n, int64_t* out) const override;

 private:
  int64_t size_, vocab_;
  uint64_t state_;  // splitmix64's state before token 0
  std::string name_ = "synthetic tokens";
};

struct TokenLoaderOptions {
  /// Windows (sequences) per global batch over all ranks, G.
  int64_t global_batch = 32;
  /// Tokens per input sequence, T (each window holds T + 1 tokens).
  int64_t context = 128;
  /// Seeds every epoch's offset and permutation.
  uint64_t seed = 0;
  /// This process's rank and the number of data-parallel processes.
  int64_t rank = 0;
  int64_t world_size = 1;
  /// Batches in pinned (page-locked) host memory where CUDA is available, so that their copy to the GPU
  /// is asynchronous (from pageable memory the copy waits for the device: a host sync per tensor).
  bool pin_memory = false;
};

/// The training loader over one split (the windows of the file comment). Reading a window is a copy of
/// T + 1 tokens, so batches are built in next()'s thread (no workers). Call from one thread.
class TokenLoader {
 public:
  /// Validates the options (context >= 1, N >= context + 1, 1 <= G <= S, G >= world_size,
  /// 0 <= rank < world_size) and starts at epoch 0, position 0. Throws std::invalid_argument naming the
  /// option and the numbers.
  TokenLoader(std::shared_ptr<const TokenSource> dataset, TokenLoaderOptions options);

  /// The next batch: images = inputs (B, T) int64, labels = targets (B, T) int64, indices = each
  /// window's first token offset, B = this rank's slice.
  Batch next();
  /// Restarts the stream at window `position` (0 <= position <= S) of epoch `epoch` (>= 0): the
  /// following batches equal those an uninterrupted stream returns from there. A position where no
  /// full batch fits means the next epoch's start. Throws std::invalid_argument outside those ranges.
  void seek(int64_t epoch, int64_t position);
  void seek(const LoaderState& state) { seek(state.epoch, state.position); }
  /// Where the next call to next() starts (normalized: a finished epoch reads as {epoch + 1, 0}).
  LoaderState state() const { return consumed_; }
  /// Global batches in an epoch: S / G.
  int64_t steps_per_epoch() const { return slots_ / opt_.global_batch; }

  /// The batch that starts at (epoch, position); the stream does not move.
  Batch batch_at(int64_t epoch, int64_t position) const;
  /// Window slots per epoch, S.
  int64_t windows_per_epoch() const { return slots_; }
  /// The first token offset of each window of epoch `epoch`, in the epoch's order (size S).
  std::vector<int64_t> epoch_windows(int64_t epoch) const;

  const TokenLoaderOptions& options() const { return opt_; }
  const TokenSource& dataset() const { return *dataset_; }

 private:
  LoaderState normalized(LoaderState s) const;
  const std::vector<int64_t>& cached_windows(int64_t epoch) const;

  std::shared_ptr<const TokenSource> dataset_;
  TokenLoaderOptions opt_;
  int64_t slots_ = 0;
  LoaderState consumed_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> cached_;
};

struct TokenEvalOptions {
  /// Windows per global batch over all ranks.
  int64_t batch = 32;
  /// Tokens per input sequence, T.
  int64_t context = 128;
  int64_t rank = 0;
  int64_t world_size = 1;
};

/// One pass over a split in order (EvalPass, data/samples/batch.h): the floor((N - 1) / T) consecutive
/// non-overlapping windows starting at 0, T, 2T, ... (every token but the last up to T - 1 is a target
/// exactly once), the last global batch partial.
class TokenEvalLoader : public EvalPass {
 public:
  /// Throws std::invalid_argument for batch < 1, context < 1, N < context + 1 or a bad rank.
  TokenEvalLoader(std::shared_ptr<const TokenSource> dataset, TokenEvalOptions options);
  /// The next batch of the pass (fields as TokenLoader's; epoch 0, position = windows before it), or
  /// nullopt once the pass is over (until reset()).
  std::optional<Batch> next() override;
  /// Starts a new pass at window 0.
  void reset() override { next_window_ = 0; }
  /// Global batches in a pass: ceil(windows / batch).
  int64_t num_batches() const override { return (windows_ + opt_.batch - 1) / opt_.batch; }
  /// Windows in a pass: floor((N - 1) / T).
  int64_t num_windows() const { return windows_; }

 private:
  std::shared_ptr<const TokenSource> dataset_;
  TokenEvalOptions opt_;
  int64_t windows_ = 0;
  int64_t next_window_ = 0;
};

}  // namespace data
