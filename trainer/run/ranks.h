// The run's processes, one part of TrainingRun (run.h): torchrun's environment (the rank, the world size),
// the process group and the gradient buckets under data parallel (trainer/dist/dist.h; null in a single
// process), and where this rank's own files go. The rank-0 process writes the run folder's shared files.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>

#include "models/model.h"
#include "trainer/config/config.h"
#include "trainer/dist/dist.h"
#include "trainer/dist/shard.h"
#include "trainer/numerics/optim.h"

namespace trainer {

class Ranks {
 public:
  explicit Ranks(const Config& cfg) : cfg_(cfg) {}

  /// torchrun's environment (a single process without it).
  void read_env() { env_ = dist_env_from(); }
  /// Data parallel: checks that every rank takes an equal slice of the global batch, then the rendezvous
  /// and the process group on `device` (nothing in a single process).
  void connect(const torch::Device& device);
  /// The folder this rank's own files go in: `run_dir` (rank 0) or <run_dir>/rank<r>.
  void set_rank_dir(const std::string& run_dir);
  /// Data parallel, after the model is built: every replica starts from rank 0's weights and buffers, the
  /// optimizer's parameters get their gradient buckets, and ranks past 0 draw their own dropout masks.
  /// With dist.shard the optimizer is restricted to this rank's pieces (trainer/dist/shard.h).
  void replicate(models::Model& model, Optimizer& optimizer);

  const DistEnv& env() const { return env_; }
  Distributed* dist() const { return dist_.get(); }            ///< null in a single process
  GradientSync* grad_sync() const { return grad_sync_.get(); }  ///< null in a single process
  ParamShards* shards() const { return shards_.get(); }         ///< null without dist.shard (or one process)
  const std::string& rank_dir() const { return rank_dir_; }
  bool main_rank() const { return env_.rank == 0; }
  int64_t rank_batch() const { return cfg_.train.global_batch / env_.world_size; }  ///< samples per step per rank

 private:
  const Config& cfg_;
  // Data parallel (null in a single process).
  DistEnv env_;
  std::unique_ptr<Distributed> dist_;
  std::unique_ptr<GradientSync> grad_sync_;
  std::unique_ptr<ParamShards> shards_;
  std::string rank_dir_;  // where this rank's own files go: the run folder (rank 0) or <run>/rank<r>
};

}  // namespace trainer
