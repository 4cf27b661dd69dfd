// Ranks: the run's processes (ranks.h).
#include "trainer/run/ranks.h"

#include <spdlog/spdlog.h>

#include <filesystem>
#include <vector>

#include "trainer/run/from_config.h"

namespace fs = std::filesystem;

namespace trainer {

namespace {
int64_t total_numel(const std::vector<torch::Tensor>& params) {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel();
  return n;
}
}  // namespace

void Ranks::connect(const torch::Device& device) {
  if (!env_.distributed()) {
    if (cfg_.dist.shard != ShardMode::kNone)
      spdlog::warn("dist.shard: {} has no effect in a single process (every state is this process's); it applies "
                   "under torchrun with several ranks", mode_name(cfg_.dist.shard));
    return;
  }
  if (cfg_.train.global_batch % env_.world_size != 0)
    throw ConfigError("train.global_batch: " + std::to_string(cfg_.train.global_batch) +
                      " is not divisible by the world size " + std::to_string(env_.world_size) +
                      " (every rank takes an equal slice of each step's samples)");
  dist_ = std::make_unique<Distributed>(env_, comm_backend(cfg_, device), device, cfg_.dist.timeout_s);
}

void Ranks::set_rank_dir(const std::string& run_dir) {
  rank_dir_ = main_rank() ? run_dir : (fs::path(run_dir) / ("rank" + std::to_string(env_.rank))).string();
}

void Ranks::replicate(models::Model& model, Optimizer& optimizer) {
  // Every replica starts from rank 0's weights and buffers (the same seed makes them equal already;
  // this makes it a fact, also for init_from files that differ between nodes).
  std::vector<torch::Tensor> state;
  for (auto& p : model->parameters()) state.push_back(p.data());
  for (auto& b : model->buffers()) state.push_back(b);
  dist_->broadcast(state, "the initial model");
  std::vector<torch::Tensor> params;
  for (const auto& slot : optimizer.params()) params.push_back(slot.param);
  const auto bucket_bytes = static_cast<int64_t>(cfg_.dist.bucket_mb * (1 << 20));
  const bool scatter = cfg_.dist.shard == ShardMode::kGradients;
  grad_sync_ = std::make_unique<GradientSync>(*dist_, params, bucket_bytes, scatter);
  if (cfg_.dist.shard != ShardMode::kNone) {
    try {
      shards_ = std::make_unique<ParamShards>(*dist_, params, bucket_bytes);
    } catch (const std::invalid_argument& e) {
      throw ConfigError(e.what());
    }
    std::vector<ParamSlot> pieces;
    std::vector<size_t> owner;
    for (size_t i = 0; i < shards_->pieces().size(); ++i) {
      const ParamSlot& whole = optimizer.params()[shards_->pieces()[i].param];
      pieces.push_back({whole.name, shards_->views()[i], whole.decay});
      owner.push_back(shards_->pieces()[i].param);
    }
    Distributed* dist = dist_.get();
    optimizer.shard(std::move(pieces), std::move(owner), [dist](std::vector<double>& v) {
      v = dist->all_sum(v, "the optimizer's norms over the ranks' slices");
    });
    spdlog::info("distributed: dist.shard {}: this rank updates {} of {} parameter values ({} pieces)",
                 mode_name(cfg_.dist.shard), shards_->layout().owned(env_.rank), total_numel(params),
                 shards_->pieces().size());
  }
  // Dropout masks differ between ranks, as they would between the samples of one large batch.
  if (env_.rank > 0) torch::manual_seed(cfg_.seed + 1000003ull * static_cast<uint64_t>(env_.rank));
  spdlog::info("distributed: {} gradient buckets of up to {} MiB", grad_sync_->num_buckets(), cfg_.dist.bucket_mb);
}

}  // namespace trainer
