// What a run reads, images or tokens behind one face each: the training source (the loader's stream)
// and the evaluation source (a split scored in one pass). Both kinds return data::Batch and keep their
// place in samples (images) or windows (tokens), so the run, its resume and its OOM retries do not care
// which it reads; what only one kind has (an image split's classes and mean/std, a token stream's
// vocabulary) is on that kind's class.
#pragma once

#include "data/samples/batch.h"
#include "data/samples/dataset.h"
#include "data/samples/loader.h"
#include "data/samples/token_loader.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace data {

/// The training stream: the image loader (Loader) or the token loader (TokenLoader).
class TrainingSource {
 public:
  virtual ~TrainingSource() = default;
  virtual Batch next() = 0;
  virtual void seek(int64_t epoch, int64_t position) = 0;
  virtual LoaderState state() const = 0;
  virtual int64_t steps_per_epoch() const = 0;
  virtual int64_t positions_per_epoch() const = 0;  // seek() takes positions 0..this
  /// One sample of the model's input: (C, H, W), or (T) tokens.
  virtual std::vector<int64_t> sample_shape() const = 0;
  /// A language model's token stream (else images to classify).
  virtual bool tokens() const = 0;
};

/// Images through Loader (data/samples/loader.h); positions are samples.
class ImageTrainingSource : public TrainingSource {
 public:
  ImageTrainingSource(std::shared_ptr<const ImageDataset> dataset, LoaderOptions options)
      : loader_(std::move(dataset), options) {}
  Batch next() override { return loader_.next(); }
  void seek(int64_t epoch, int64_t position) override { loader_.seek(epoch, position); }
  LoaderState state() const override { return loader_.state(); }
  int64_t steps_per_epoch() const override { return loader_.steps_per_epoch(); }
  int64_t positions_per_epoch() const override { return loader_.samples_per_epoch(); }
  std::vector<int64_t> sample_shape() const override;
  bool tokens() const override { return false; }
  /// The classes and the per-channel mean/std of the training split.
  const ImageMeta& meta() const { return loader_.dataset().meta(); }
  const ImageDataset& dataset() const { return loader_.dataset(); }

 private:
  Loader loader_;
};

/// A token stream through TokenLoader (data/samples/token_loader.h); positions are windows.
class TokenTrainingSource : public TrainingSource {
 public:
  TokenTrainingSource(std::shared_ptr<const TokenSource> dataset, TokenLoaderOptions options)
      : loader_(std::move(dataset), options) {}
  Batch next() override { return loader_.next(); }
  void seek(int64_t epoch, int64_t position) override { loader_.seek(epoch, position); }
  LoaderState state() const override { return loader_.state(); }
  int64_t steps_per_epoch() const override { return loader_.steps_per_epoch(); }
  int64_t positions_per_epoch() const override { return loader_.windows_per_epoch(); }
  std::vector<int64_t> sample_shape() const override { return {loader_.options().context}; }
  bool tokens() const override { return true; }
  /// Every token of the stream is below it.
  int64_t vocab_size() const { return loader_.dataset().vocab_size(); }
  const TokenSource& dataset() const { return loader_.dataset(); }

 private:
  TokenLoader loader_;
};

/// How an evaluation pass reads its split: what EvalOptions and TokenEvalOptions take, for either kind.
struct EvalPassOptions {
  int64_t batch = 500;      ///< samples (images or windows) per batch, over all ranks
  int64_t rank = 0, world_size = 1;
  int64_t workers = 1;      ///< images: the loader's threads
  bool normalize = true;    ///< images: with the split's own mean and std (AugmentOptions::normalize)
  bool pin_memory = false;  ///< images: page-locked batches (CUDA)
  int64_t context = 0;      ///< tokens: tokens per window
};

/// What a split to evaluate is: images or a token stream. Each evaluation reads it through a pass of
/// its own (EvalPass, data/samples/batch.h), opened when it starts and dropped when it ends: between
/// evaluations nothing is read and no loader thread runs.
class EvalSource {
 public:
  virtual ~EvalSource() = default;
  /// A pass from the split's first sample. Throws std::invalid_argument for options the split cannot
  /// take, as the loaders' constructors do.
  virtual std::unique_ptr<EvalPass> pass(const EvalPassOptions& options) const = 0;
  /// Token windows (else images).
  virtual bool tokens() const = 0;
};

/// An image split, read by EvalLoader.
class ImageEvalSource : public EvalSource {
 public:
  explicit ImageEvalSource(std::shared_ptr<const ImageDataset> dataset);
  std::unique_ptr<EvalPass> pass(const EvalPassOptions& options) const override;
  bool tokens() const override { return false; }
  const std::shared_ptr<const ImageDataset>& dataset() const { return dataset_; }

 private:
  std::shared_ptr<const ImageDataset> dataset_;
};

/// A token split, read by TokenEvalLoader.
class TokenEvalSource : public EvalSource {
 public:
  explicit TokenEvalSource(std::shared_ptr<const TokenSource> dataset);
  std::unique_ptr<EvalPass> pass(const EvalPassOptions& options) const override;
  bool tokens() const override { return true; }
  const std::shared_ptr<const TokenSource>& dataset() const { return dataset_; }

 private:
  std::shared_ptr<const TokenSource> dataset_;
};

}  // namespace data
