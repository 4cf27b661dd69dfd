// Ranks: the run's processes (ranks.h).
#include "trainer/run/ranks.h"

#include <spdlog/spdlog.h>

#include <filesystem>
#include <vector>

#include "trainer/run/from_config.h"

namespace fs = std::filesystem;

namespace trainer {

void Ranks::connect(const torch::Device& device) {
  if (!env_.distributed()) return;
  if (cfg_.train.global_batch % env_.world_size != 0)
    throw ConfigError("train.global_batch: " + std::to_string(cfg_.train.global_batch) +
                      " is not divisible by the world size " + std::to_string(env_.world_size) +
                      " (every rank takes an equal slice of each step's samples)");
  dist_ = std::make_unique<Distributed>(env_, comm_backend(cfg_, device), device, cfg_.dist.timeout_s);
}

void Ranks::set_rank_dir(const std::string& run_dir) {
  rank_dir_ = main_rank() ? run_dir : (fs::path(run_dir) / ("rank" + std::to_string(env_.rank))).string();
}

void Ranks::replicate(models::Model& model, const Optimizer& optimizer) {
  // Every replica starts from rank 0's weights and buffers (the same seed makes them equal already;
  // this makes it a fact, also for init_from files that differ between nodes).
  std::vector<torch::Tensor> state;
  for (auto& p : model->parameters()) state.push_back(p.data());
  for (auto& b : model->buffers()) state.push_back(b);
  dist_->broadcast(state, "the initial model");
  std::vector<torch::Tensor> params;
  for (const auto& slot : optimizer.params()) params.push_back(slot.param);
  grad_sync_ = std::make_unique<GradientSync>(*dist_, params, static_cast<int64_t>(cfg_.dist.bucket_mb * (1 << 20)));
  // Dropout masks differ between ranks, as they would between the samples of one large batch.
  if (env_.rank > 0) torch::manual_seed(cfg_.seed + 1000003ull * static_cast<uint64_t>(env_.rank));
  spdlog::info("distributed: {} gradient buckets of up to {} MiB", grad_sync_->num_buckets(), cfg_.dist.bucket_mb);
}

}  // namespace trainer
