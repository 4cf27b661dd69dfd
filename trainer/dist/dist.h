// Data-parallel training on LibTorch's own distributed engine (c10d): the rendezvous torchrun and
// Kubernetes' PyTorchJob set up through the environment, the few collectives the loop needs, and the
// bucketed gradient all-reduce that overlaps with backward. docs/DISTRIBUTED.md has the protocol.
//
// Every collective here is blocking and issued in the same order on every rank; the training step
// makes sure of that even when one rank runs out of memory (see GradientSync::abandon and step.cpp).
// A collective that waits longer than the configured timeout throws, naming what it waited for.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace trainer {

/// Where this process sits in a data-parallel job.
struct DistEnv {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;        ///< index on this node (selects the GPU)
  int64_t local_world_size = 1;  ///< processes on this node (they share its CPUs)
  std::string master_addr;       ///< host of the rendezvous store
  int64_t master_port = 0;
  bool agent_store = false;      ///< torchrun's agent hosts the store: every rank is a client of it
  int64_t restart_count = 0;     ///< torchrun's restarts so far (a fresh key prefix per attempt)
  bool distributed() const { return world_size > 1; }
};

/// Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
/// TORCHELASTIC_USE_AGENT_STORE and TORCHELASTIC_RESTART_COUNT through `get` (getenv by default).
/// No WORLD_SIZE (or 1) is a single process. Throws std::runtime_error naming the variable when one is
/// not a number, out of range, or missing for a job of several processes.
DistEnv dist_env_from(const std::function<const char*(const char*)>& get = nullptr);

/// The kind of process group a job runs: c10d's Gloo or NCCL. Its own enum, not the config's dist.backend
/// (trainer/config/config.h, which this folder does not see): that one also says `auto`, which
/// resolve_backend turns into one of these (trainer/run/from_config.h maps the key).
enum class CommBackend { kGloo, kNccl };

/// "gloo", "nccl": c10d's names, for messages.
const char* to_string(CommBackend backend);

/// The backend `wanted` resolves to on `device` (nullopt = auto: nccl for CUDA, gloo for CPU).
/// Throws std::runtime_error when this build lacks it (NCCL without CUDA, or a LibTorch built without
/// it) or when it cannot serve the device (nccl on the CPU).
CommBackend resolve_backend(std::optional<CommBackend> wanted, const torch::Device& device);

/// The process group of one job: rendezvous at construction, then blocking collectives. Not
/// thread-safe: one thread (the training loop) issues them, in the same order on every rank.
class Distributed {
 public:
  /// Rendezvous through a TCP store at env.master_addr:env.master_port (hosted by rank 0, or by torchrun's
  /// agent) and a process group of `backend`. Throws std::runtime_error after
  /// `timeout_s` if the other ranks do not arrive, naming the address.
  Distributed(const DistEnv& env, CommBackend backend, const torch::Device& device, double timeout_s);
  ~Distributed();
  Distributed(const Distributed&) = delete;
  Distributed& operator=(const Distributed&) = delete;

  int64_t rank() const { return env_.rank; }
  int64_t world_size() const { return env_.world_size; }
  const DistEnv& env() const { return env_; }
  CommBackend backend() const { return backend_; }

  /// Overwrites `tensors` (same shapes and dtypes on every rank, on the process group's device) with
  /// rank 0's values.
  void broadcast(std::vector<torch::Tensor> tensors, const std::string& what);
  /// Elementwise sum over ranks. `what` names the collective in a timeout error.
  std::vector<double> all_sum(const std::vector<double>& values, const std::string& what);
  /// Elementwise maximum over ranks.
  std::vector<double> all_max(const std::vector<double>& values, const std::string& what);
  /// Every rank's `t` (same shape and dtype on every rank), indexed by rank. `t` lives on the CPU; it is
  /// moved to the group's device and back.
  std::vector<torch::Tensor> all_gather(const torch::Tensor& t, const std::string& what);
  /// Rank 0 gets every rank's `bytes` (its own first), in rank order; the others get nothing. Through c10d's
  /// send and recv on the CPU, from and into the strings' own memory: nothing is allocated by LibTorch's
  /// allocator (whose cap may be lifted only while the caller runs), so nothing large is left for a
  /// backend's thread to release after the call. NCCL: through device copies.
  std::vector<std::string> gather_bytes(const std::string& bytes, const std::string& what);
  /// Sum over ranks, in place, started now; the returned function waits for it (and throws on a timeout).
  std::function<void()> all_sum_async(torch::Tensor t, const std::string& what);
  /// The sum over ranks of `bucket` (world_size * slice.numel() values, on the group's device), of which
  /// this rank keeps its part, `slice` (values [rank * n, (rank + 1) * n)), started now: c10d's
  /// reduce-scatter, or where Gloo lacks it (compat::kHasGlooReduceScatter) an all-reduce of `bucket`
  /// whose part is copied out when the returned function has waited. `bucket` may be overwritten.
  std::function<void()> reduce_scatter_async(torch::Tensor bucket, torch::Tensor slice, const std::string& what);
  /// Every rank's `slice` into `bucket` (world_size * slice.numel() values, rank r's at r * n): c10d's
  /// all-gather, started now; the returned function waits for it.
  std::function<void()> all_gather_async(torch::Tensor slice, torch::Tensor bucket, const std::string& what);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  DistEnv env_;
  CommBackend backend_;
  torch::Device device_;
};

/// Gradient averaging in buckets, exchanged on the last micro-batch of an optimizer step only, and
/// overlapped with its backward: each parameter's gradient accumulator gets a post hook; when a
/// parameter's gradient is complete it is copied into its bucket, and a bucket whose parameters are all
/// complete is summed across ranks at once, in bucket order, while backward goes on. Parameters are
/// bucketed in reverse registration order (the order backward completes them).
///
/// The loss of every rank is already divided by the whole step's target count (all ranks), so the sum
/// over ranks is the global mean gradient; nothing is divided afterwards.
class GradientSync {
 public:
  /// `params`: the trainable tensors (leaves), the same list in the same order on every rank.
  /// `bucket_bytes` (> 0): the size a bucket fills up to before the next starts (a larger parameter gets a
  /// bucket of its own: bucket_groups, shard.h). The bucket buffers are allocated here, once.
  /// `scatter` (dist.shard: gradients, ZeRO stage 2): each bucket is padded to world * slice values and
  /// reduce-scattered, and no bucket keeps a buffer of its own: a bucket takes a staging buffer from a small
  /// pool when its first gradient arrives (waiting for the oldest bucket on the wire to come back, or
  /// growing the pool when none is), a parameter's gradient is dropped as soon as it is copied in, and the
  /// rank keeps its slices' sums only (slices()): the whole gradient is never held at once.
  GradientSync(Distributed& dist, std::vector<torch::Tensor> params, int64_t bucket_bytes, bool scatter = false);
  ~GradientSync();

  /// The next backward is the step's last: its hooks fill and send the buckets. Scatter: every backward of
  /// the step is armed and finished, and `accumulate` (a micro-batch after the first) adds its sums to
  /// slices() instead of overwriting them.
  void arm(bool accumulate = false);
  /// After that backward: sends what is still pending (a parameter without a gradient counts as zeros),
  /// waits for every bucket and writes the sums into the gradients (scatter: into slices(), the
  /// parameters' gradients dropped). Disarms.
  void finish();
  /// The attempt failed on this rank after arm(): sends every bucket not yet sent (its contents do not
  /// matter: the step is redone on every rank), waits, and disarms, so every rank issued the same
  /// collectives. A no-op when not armed.
  void abandon();

  int64_t num_buckets() const;
  bool scatters() const { return scatter_; }
  /// Scatter: the staging buffers the pool holds: one for the largest bucket and one for the next largest to
  /// start with, more when backward completes buckets out of order (each the size of the bucket it was
  /// made for).
  int64_t staging_buffers() const { return static_cast<int64_t>(pool_.size()); }
  /// Scatter: this rank's slice of each bucket, summed over ranks by the last finish() (ShardLayout's
  /// slices: bucket i's values [rank * slice, (rank + 1) * slice)).
  const std::vector<torch::Tensor>& slices() const { return slices_; }
  /// Buckets sent during backward (before finish) in the last armed pass: the overlap achieved.
  int64_t sent_during_backward() const { return sent_during_backward_; }

 private:
  struct Bucket {
    torch::Tensor buffer;        // flat, the parameters' dtype and device (scatter: none, a staging buffer's)
    std::vector<size_t> params;  // indices into params_
    size_t pending = 0;          // parameters not yet copied in during this pass
    std::function<void()> wait;  // set once sent
  };
  void on_grad_ready(size_t param_index);
  void send_ready_buckets();
  void send(size_t bucket);
  void wait_all();
  // ---- scatter (grad_scatter.cpp) ----
  /// The bucket's staging buffer, taken from the pool (mu_ held): the smallest free one that fits, else one
  /// freed by the buckets on the wire once they are back, else a new one (`may_allocate`), else one a later
  /// unsent bucket holds (abandon(): the largest always exists, so nothing is allocated there).
  void acquire(size_t bucket, bool may_allocate = true);
  /// Waits for the oldest bucket on the wire, adds (or copies) its part into slices_, frees its staging.
  void complete_oldest();
  /// Completes every bucket on the wire, then rethrows the first failure (all are back either way).
  void drain_in_flight();
  torch::Tensor staging_of(size_t bucket) const;  // its world * slice values of its staging buffer
  void finish_scatter();
  void abandon_scatter();

  Distributed& dist_;
  std::vector<torch::Tensor> params_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // kept alive: hooks live on them
  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::vector<size_t> bucket_of_;       // param index -> bucket
  std::vector<int64_t> offset_in_bucket_;
  std::vector<char> ready_;             // param index -> gradient copied in this pass
  size_t next_to_send_ = 0;
  bool armed_ = false;
  bool scatter_ = false;
  std::vector<torch::Tensor> slices_;   // scatter: this rank's summed slice of each bucket
  struct Staging {
    int64_t slice = 0;     // the largest slice it serves
    torch::Tensor buffer;  // world * slice values: a bucket's values
    torch::Tensor out;     // slice values, made for a micro-batch after the first: its sums before they are added
  };
  std::vector<Staging> pool_;           // scatter: the staging buffers
  std::vector<size_t> free_;            // scatter: pool_ indices not held by a bucket
  std::vector<int64_t> staging_;        // scatter: bucket -> pool_ index, -1 for none
  std::vector<size_t> in_flight_;       // scatter: buckets sent and not yet waited for, oldest first
  std::vector<char> into_out_;          // scatter: bucket -> its sums land in its staging's `out` (to be added)
  bool accumulate_ = false;             // scatter: this pass adds to slices_
  int64_t world_ = 1;
  int64_t sent_during_backward_ = 0;
  std::mutex mu_;  // hooks run on the autograd engine's thread (a device thread on CUDA)
};

}  // namespace trainer
