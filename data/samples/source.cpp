#include "data/samples/source.h"

#include <stdexcept>

namespace data {

std::vector<int64_t> ImageTrainingSource::sample_shape() const {
  const auto sh = loader_.dataset().sample_shape();
  return {sh[0], sh[1], sh[2]};
}

ImageEvalSource::ImageEvalSource(std::shared_ptr<const ImageDataset> dataset) : dataset_(std::move(dataset)) {
  if (!dataset_) throw std::invalid_argument("image evaluation source: no dataset");
}

std::unique_ptr<EvalPass> ImageEvalSource::pass(const EvalPassOptions& p) const {
  EvalOptions o;
  o.batch = p.batch;
  o.workers = p.workers;
  o.normalize = p.normalize;
  o.pin_memory = p.pin_memory;
  o.rank = p.rank;
  o.world_size = p.world_size;
  return std::make_unique<EvalLoader>(dataset_, o);
}

TokenEvalSource::TokenEvalSource(std::shared_ptr<const TokenSource> dataset) : dataset_(std::move(dataset)) {
  if (!dataset_) throw std::invalid_argument("token evaluation source: no dataset");
}

std::unique_ptr<EvalPass> TokenEvalSource::pass(const EvalPassOptions& p) const {
  TokenEvalOptions o;
  o.batch = p.batch;
  o.context = p.context;
  o.rank = p.rank;
  o.world_size = p.world_size;
  return std::make_unique<TokenEvalLoader>(dataset_, o);
}

}  // namespace data
