// c10d rendezvous, collectives and the overlapped bucketed gradient all-reduce (see dist.h).
#include "trainer/dist/dist.h"

#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>

#if TRAINER_HAS_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if TRAINER_HAS_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "common/compat.h"
#include "common/log.h"
#include "trainer/dist/shard.h"

namespace trainer {
namespace {

int64_t env_int(const std::function<const char*(const char*)>& get, const char* name, int64_t fallback, int64_t lo,
                int64_t hi) {
  const char* v = get(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  long long x = std::strtoll(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0' || x < lo || x > hi)
    throw std::runtime_error(std::string("distributed: environment variable ") + name + "='" + v +
                             "' is not an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return x;
}

std::string seconds_text(double s) { return std::to_string(static_cast<int64_t>(s + 0.5)) + " s"; }

}  // namespace

DistEnv dist_env_from(const std::function<const char*(const char*)>& get_in) {
  auto get = get_in ? get_in : [](const char* n) -> const char* { return std::getenv(n); };
  DistEnv e;
  e.world_size = env_int(get, "WORLD_SIZE", 1, 1, 1 << 20);
  e.rank = env_int(get, "RANK", 0, 0, e.world_size - 1);
  e.local_rank = env_int(get, "LOCAL_RANK", e.world_size > 1 ? e.rank : 0, 0, e.world_size - 1);
  e.local_world_size = env_int(get, "LOCAL_WORLD_SIZE", e.world_size, 1, e.world_size);
  if (e.local_rank >= e.local_world_size)
    throw std::runtime_error("distributed: LOCAL_RANK " + std::to_string(e.local_rank) + " is not below LOCAL_WORLD_SIZE " +
                             std::to_string(e.local_world_size));
  if (!e.distributed()) return e;
  if (get("RANK") == nullptr)
    throw std::runtime_error("distributed: WORLD_SIZE is " + std::to_string(e.world_size) +
                             " but RANK is not set; launch with torchrun (or set RANK, MASTER_ADDR and MASTER_PORT)");
  const char* addr = get("MASTER_ADDR");
  if (addr == nullptr || *addr == '\0')
    throw std::runtime_error("distributed: WORLD_SIZE is " + std::to_string(e.world_size) +
                             " but MASTER_ADDR is not set; launch with torchrun or set MASTER_ADDR and MASTER_PORT");
  e.master_addr = addr;
  if (get("MASTER_PORT") == nullptr)
    throw std::runtime_error("distributed: MASTER_PORT is not set (the rendezvous port on MASTER_ADDR)");
  e.master_port = env_int(get, "MASTER_PORT", 0, 1, 65535);
  const char* agent = get("TORCHELASTIC_USE_AGENT_STORE");
  e.agent_store = agent != nullptr && std::string(agent) == "True";
  e.restart_count = env_int(get, "TORCHELASTIC_RESTART_COUNT", 0, 0, 1 << 30);
  return e;
}

const char* to_string(CommBackend backend) { return backend == CommBackend::kNccl ? "nccl" : "gloo"; }

CommBackend resolve_backend(std::optional<CommBackend> wanted, const torch::Device& device) {
  const CommBackend b = wanted.value_or(device.is_cuda() ? CommBackend::kNccl : CommBackend::kGloo);
  if (b == CommBackend::kNccl && !device.is_cuda())
    throw std::runtime_error("dist.backend: nccl needs a CUDA device (train.device is " + device.str() + "); use gloo");
#if !TRAINER_HAS_NCCL
  if (b == CommBackend::kNccl)
    throw std::runtime_error("dist.backend: nccl, but this trainer was built without NCCL (a LibTorch with CUDA and "
                             "NCCL headers); use gloo");
#endif
#if !TRAINER_HAS_GLOO
  if (b == CommBackend::kGloo)
    throw std::runtime_error("dist.backend: gloo, but this trainer was built without Gloo headers (Debian: "
                             "libgloo-dev); run scripts/install-deps.sh and rebuild");
#endif
  return b;
}

// ---- the process group --------------------------------------------------------------------------------

struct Distributed::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<compat::C10dBackend> pg;
  double timeout_s = 0;
  std::string where;  // "rank r of W" for messages
};

Distributed::Distributed(const DistEnv& env, CommBackend backend, const torch::Device& device, double timeout_s)
    : impl_(std::make_unique<Impl>()), env_(env), backend_(backend), device_(device) {
  impl_->timeout_s = timeout_s;
  impl_->where = "rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  const std::string at = env.master_addr + ":" + std::to_string(env.master_port);
  try {
    // As Python's env:// does: under torchrun the agent already hosts the store (every rank is a client,
    // and keys get a prefix per restart); otherwise (PyTorchJob, a hand launch) rank 0 hosts it.
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(env.master_port);
    so.isServer = !env.agent_store && env.rank == 0;
    so.numWorkers = static_cast<size_t>(env.world_size);
    so.timeout = timeout;
    so.multiTenant = !env.agent_store;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    impl_->store = env.agent_store
                       ? c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<c10d::PrefixStore>(
                             "/trainer/attempt_" + std::to_string(env.restart_count), tcp))
                       : c10::intrusive_ptr<c10d::Store>(tcp);
  } catch (const std::exception& e) {
    throw std::runtime_error("distributed: " + impl_->where + " could not reach the rendezvous store at " + at +
                             " within " + seconds_text(timeout_s) + ": " + error_message(e).substr(0, 300));
  }
  try {
    if (backend == CommBackend::kGloo) {
#if TRAINER_HAS_GLOO
      auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
      // The interface Gloo talks on: GLOO_SOCKET_IFNAME as in PyTorch; loopback for a job on one host that
      // rendezvoused on loopback (no name resolution needed); else this host's name.
      const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
      if (ifname != nullptr && *ifname != '\0') {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      } else if (env.master_addr.rfind("127.", 0) == 0 || env.master_addr == "localhost") {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      } else {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
      impl_->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(impl_->store, static_cast<int>(env.rank),
                                                              static_cast<int>(env.world_size), opts);
#endif
    } else {
#if TRAINER_HAS_NCCL
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      opts->timeout = timeout;
      impl_->pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(impl_->store, static_cast<int>(env.rank),
                                                              static_cast<int>(env.world_size), opts);
#endif
    }
  } catch (const std::exception& e) {
    throw std::runtime_error("distributed: " + impl_->where + " could not form the " + std::string(to_string(backend)) + " process group (store " +
                             at + ", timeout " + seconds_text(timeout_s) + "): " + error_message(e).substr(0, 300));
  }
  if (!impl_->pg) throw std::runtime_error("distributed: backend '" + std::string(to_string(backend)) + "' is not built in");
  spdlog::info("distributed: {} ({}), store {}{}, timeout {}", impl_->where, to_string(backend), at,
               env.agent_store ? " (torchrun's)" : "", seconds_text(timeout_s));
}

Distributed::~Distributed() = default;

namespace {
// Waits for a collective and turns Gloo's and NCCL's errors (a timeout, a dead peer) into one line that
// says which collective and what to suspect.
void wait_for(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what, const std::string& where,
              double timeout_s) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    const std::string msg = error_message(e);
    throw std::runtime_error("distributed: " + what + " failed on " + where + " (timeout " + seconds_text(timeout_s) +
                             "): " + msg.substr(0, 300) + "; another rank died, stalled or ran a different step");
  }
}
}  // namespace

void Distributed::broadcast(std::vector<torch::Tensor> tensors, const std::string& what) {
  if (tensors.empty()) return;
  c10d::BroadcastOptions o;
  o.rootRank = 0;
  // One collective per tensor keeps it simple; this runs once at start and before evaluations.
  for (auto& t : tensors) {
    std::vector<at::Tensor> v{t.is_contiguous() ? t : t.contiguous()};
    wait_for(impl_->pg->broadcast(v, o), "broadcast of " + what, impl_->where, impl_->timeout_s);
    if (!v[0].is_same(t)) {
      torch::NoGradGuard ng;
      t.copy_(v[0]);
    }
  }
}

namespace {
std::vector<double> reduce_doubles(compat::C10dBackend& pg, const std::vector<double>& values, c10d::ReduceOp op,
                                   const torch::Device& dev, const std::string& what, const std::string& where,
                                   double timeout_s) {
  auto t = torch::tensor(values, torch::dtype(torch::kDouble)).to(dev);
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions o;
  o.reduceOp = op;
  wait_for(pg.allreduce(v, o), what, where, timeout_s);
  auto host = v[0].cpu();
  return std::vector<double>(host.data_ptr<double>(), host.data_ptr<double>() + host.numel());
}
}  // namespace

std::vector<double> Distributed::all_sum(const std::vector<double>& values, const std::string& what) {
  torch::Device dev = backend_ == CommBackend::kNccl ? device_ : torch::Device(torch::kCPU);
  return reduce_doubles(*impl_->pg, values, c10d::ReduceOp::SUM, dev, what, impl_->where, impl_->timeout_s);
}

std::vector<double> Distributed::all_max(const std::vector<double>& values, const std::string& what) {
  torch::Device dev = backend_ == CommBackend::kNccl ? device_ : torch::Device(torch::kCPU);
  return reduce_doubles(*impl_->pg, values, c10d::ReduceOp::MAX, dev, what, impl_->where, impl_->timeout_s);
}

std::vector<torch::Tensor> Distributed::all_gather(const torch::Tensor& t, const std::string& what) {
  torch::Device dev = backend_ == CommBackend::kNccl ? device_ : torch::Device(torch::kCPU);
  auto in = t.contiguous().to(dev);
  std::vector<std::vector<at::Tensor>> out(1);
  for (int64_t r = 0; r < env_.world_size; ++r) out[0].push_back(torch::empty_like(in));
  std::vector<at::Tensor> inputs{in};
  wait_for(impl_->pg->allgather(out, inputs), what, impl_->where, impl_->timeout_s);
  std::vector<torch::Tensor> res;
  for (auto& x : out[0]) res.push_back(x.cpu());
  return res;
}

std::vector<std::string> Distributed::gather_bytes(const std::string& bytes, const std::string& what) {
  const auto lengths = all_gather(torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kLong), what + " (sizes)");
  const bool nccl = backend_ == CommBackend::kNccl;
  // A tensor over a string's bytes; on NCCL a device copy (`back` copies a received one into the string).
  auto over = [&](std::string& s) {
    torch::Tensor t = torch::from_blob(s.data(), {static_cast<int64_t>(s.size())}, torch::kByte);
    return nccl ? t.to(device_) : t;
  };
  std::vector<std::string> out;
  if (env_.rank != 0) {
    std::string& unchanged = const_cast<std::string&>(bytes);  // send reads it only
    std::vector<at::Tensor> t{over(unchanged)};
    wait_for(impl_->pg->send(t, 0, 0), what, impl_->where, impl_->timeout_s);
    return out;
  }
  out.push_back(bytes);
  for (int64_t r = 1; r < env_.world_size; ++r) {
    std::string s(static_cast<size_t>(lengths[static_cast<size_t>(r)].item<int64_t>()), '\0');
    std::vector<at::Tensor> t{over(s)};
    wait_for(impl_->pg->recv(t, static_cast<int>(r), 0), what + " from rank " + std::to_string(r), impl_->where,
             impl_->timeout_s);
    if (nccl) {
      const torch::Tensor host = t[0].cpu();
      std::memcpy(s.data(), host.data_ptr(), s.size());
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::function<void()> Distributed::all_sum_async(torch::Tensor t, const std::string& what) {
  std::vector<at::Tensor> v{t};
  auto work = impl_->pg->allreduce(v);
  return [work, what, where = impl_->where, timeout = impl_->timeout_s] { wait_for(work, what, where, timeout); };
}

std::function<void()> Distributed::reduce_scatter_async(torch::Tensor bucket, torch::Tensor slice,
                                                        const std::string& what) {
  const int64_t n = slice.numel();
  if (bucket.numel() != n * env_.world_size)
    throw std::invalid_argument("reduce_scatter_async: the bucket holds " + std::to_string(bucket.numel()) +
                                " values, not world_size x " + std::to_string(n));
  auto waiter = [what, where = impl_->where, timeout = impl_->timeout_s](c10::intrusive_ptr<c10d::Work> work) {
    return [work, what, where, timeout] { wait_for(work, what, where, timeout); };
  };
  if (backend_ == CommBackend::kNccl || compat::kHasGlooReduceScatter) {
    std::vector<at::Tensor> out{slice};
    std::vector<std::vector<at::Tensor>> in(1);
    for (int64_t r = 0; r < env_.world_size; ++r) in[0].push_back(bucket.narrow(0, r * n, n));
    return waiter(impl_->pg->reduce_scatter(out, in));
  }
  std::vector<at::Tensor> v{bucket};
  auto wait = waiter(impl_->pg->allreduce(v));
  return [wait, bucket, slice, n, rank = env_.rank] {
    wait();
    slice.copy_(bucket.narrow(0, rank * n, n));
  };
}

std::function<void()> Distributed::all_gather_async(torch::Tensor slice, torch::Tensor bucket, const std::string& what) {
  const int64_t n = slice.numel();
  if (bucket.numel() != n * env_.world_size)
    throw std::invalid_argument("all_gather_async: the bucket holds " + std::to_string(bucket.numel()) +
                                " values, not world_size x " + std::to_string(n));
  std::vector<std::vector<at::Tensor>> out(1);
  for (int64_t r = 0; r < env_.world_size; ++r) out[0].push_back(bucket.narrow(0, r * n, n));
  std::vector<at::Tensor> in{slice};
  auto work = impl_->pg->allgather(out, in);
  return [work, what, where = impl_->where, timeout = impl_->timeout_s] { wait_for(work, what, where, timeout); };
}

// ---- gradient buckets ---------------------------------------------------------------------------------

namespace {
// Runs after a parameter's AccumulateGrad: its .grad now holds the whole step's gradient.
struct ReadyHook : torch::autograd::FunctionPostHook {
  explicit ReadyHook(std::function<void()> f) : fn(std::move(f)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    fn();
    return outputs;
  }
  std::function<void()> fn;
};
}  // namespace

GradientSync::GradientSync(Distributed& dist, std::vector<torch::Tensor> params, int64_t bucket_bytes, bool scatter)
    : dist_(dist), params_(std::move(params)), scatter_(scatter) {
  if (bucket_bytes <= 0) throw std::invalid_argument("GradientSync: bucket_bytes must be positive");
  const size_t n = params_.size();
  bucket_of_.assign(n, 0);
  offset_in_bucket_.assign(n, 0);
  ready_.assign(n, 0);
  // Reverse registration order: roughly the order in which backward completes the gradients, so the
  // first bucket fills first and is on the wire while the rest of backward runs. The shards (shard.h)
  // are laid out over the same buckets.
  std::vector<TensorShape> shapes;
  for (const auto& p : params_)
    shapes.push_back({p.numel(), static_cast<int64_t>(p.element_size()),
                      std::string(c10::toString(p.scalar_type())) + "@" + p.device().str()});
  // Scattered, the slices are the shards' (ParamShards: aligned); all-reduced, the buckets are packed.
  const ShardLayout layout(shapes, bucket_bytes, scatter ? dist.world_size() : 1, scatter ? kShardAlign : 1);
  for (size_t g = 0; g < layout.buckets().size(); ++g) {
    const ShardBucket& sb = layout.buckets()[g];
    auto bucket = std::make_unique<Bucket>();
    for (size_t j = 0; j < sb.params.size(); ++j) {
      bucket_of_[sb.params[j]] = g;
      offset_in_bucket_[sb.params[j]] = sb.offsets[j];
    }
    const auto opts = params_[sb.params.front()].options().requires_grad(false);
    if (scatter) slices_.push_back(torch::zeros({sb.slice}, opts));  // the bucket's values: a staging buffer's
    else bucket->buffer = torch::zeros({sb.numel}, opts);
    bucket->params = sb.params;
    buckets_.push_back(std::move(bucket));
  }
  world_ = layout.world();
  if (scatter) {
    staging_.assign(buckets_.size(), -1);
    into_out_.assign(buckets_.size(), 0);
    // The pool starts with a buffer for the largest bucket and one for the next largest.
    std::vector<int64_t> sizes;
    for (const auto& sl : slices_) sizes.push_back(sl.numel());
    std::sort(sizes.rbegin(), sizes.rend());
    for (size_t i = 0; i < std::min<size_t>(2, sizes.size()); ++i) {
      pool_.push_back({sizes[i], torch::zeros({world_ * sizes[i]}, slices_.front().options()), torch::Tensor()});
      free_.push_back(pool_.size() - 1);
    }
  }
  for (size_t k = 0; k < n; ++k) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[k]);
    if (!acc)
      throw std::invalid_argument("GradientSync: parameter " + std::to_string(k) + " is not a leaf that requires grad");
    acc->add_post_hook(std::make_unique<ReadyHook>([this, k] { on_grad_ready(k); }));
    accumulators_.push_back(std::move(acc));
  }
}

GradientSync::~GradientSync() {
  try {
    abandon();
  } catch (...) {
  }
}

int64_t GradientSync::num_buckets() const { return static_cast<int64_t>(buckets_.size()); }

void GradientSync::arm(bool accumulate) {
  std::lock_guard<std::mutex> lock(mu_);
  accumulate_ = accumulate;
  std::fill(ready_.begin(), ready_.end(), 0);
  for (auto& b : buckets_) {
    b->pending = b->params.size();
    b->wait = nullptr;
  }
  next_to_send_ = 0;
  sent_during_backward_ = 0;
  armed_ = true;
}

void GradientSync::on_grad_ready(size_t k) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!armed_ || ready_[k]) return;
  auto& b = *buckets_[bucket_of_[k]];
  if (b.wait) return;  // already sent (cannot happen for a parameter used once per backward)
  const auto& p = params_[k];
  torch::NoGradGuard ng;
  if (scatter_) acquire(bucket_of_[k]);
  const torch::Tensor buffer = scatter_ ? staging_of(bucket_of_[k]) : b.buffer;
  auto slot = shaped_like(buffer.narrow(0, offset_in_bucket_[k], p.numel()), p);
  if (p.grad().defined()) slot.copy_(p.grad());
  else slot.zero_();
  // Sharded gradients: the bucket holds it now; the rank keeps only its slice of the sum.
  if (scatter_) params_[k].mutable_grad() = torch::Tensor();
  ready_[k] = 1;
  --b.pending;
  const size_t before = next_to_send_;
  send_ready_buckets();
  sent_during_backward_ += static_cast<int64_t>(next_to_send_ - before);
}

void GradientSync::send_ready_buckets() {
  // Buckets go out in index order on every rank: collectives must be issued in the same order everywhere.
  while (next_to_send_ < buckets_.size() && buckets_[next_to_send_]->pending == 0) send(next_to_send_++);
}

void GradientSync::send(size_t i) {
  if (scatter_) {
    // The first micro-batch's sums go straight into the slice; a later one's into `out`, added when back
    // (made on first use; abandon() sends into the slice: the step is redone, its contents do not matter).
    Staging& st = pool_[static_cast<size_t>(staging_[i])];
    into_out_[i] = accumulate_ && armed_;
    if (into_out_[i] && !st.out.defined()) st.out = torch::empty({st.slice}, slices_[i].options());
    const torch::Tensor target = into_out_[i] ? st.out.narrow(0, 0, slices_[i].numel()) : slices_[i];
    buckets_[i]->wait = dist_.reduce_scatter_async(staging_of(i), target, "gradient reduce-scatter (bucket " + std::to_string(i) + ")");
    in_flight_.push_back(i);
    return;
  }
  buckets_[i]->wait = dist_.all_sum_async(buckets_[i]->buffer, "gradient all-reduce (bucket " + std::to_string(i) + ")");
}

void GradientSync::wait_all() {
  std::exception_ptr first;
  for (auto& b : buckets_) {
    if (!b->wait) continue;
    try {
      b->wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
    b->wait = nullptr;
  }
  if (first) std::rethrow_exception(first);
}

void GradientSync::finish() {
  if (scatter_) return finish_scatter();
  std::unique_lock<std::mutex> lock(mu_);
  if (!armed_) throw std::logic_error("GradientSync::finish without arm");
  torch::NoGradGuard ng;
  // Parameters backward did not reach (unused in this step) count as zeros, as in DDP's static graph.
  for (size_t k = 0; k < params_.size(); ++k) {
    if (ready_[k]) continue;
    auto& b = *buckets_[bucket_of_[k]];
    auto slot = shaped_like(b.buffer.narrow(0, offset_in_bucket_[k], params_[k].numel()), params_[k]);
    if (params_[k].grad().defined()) slot.copy_(params_[k].grad());
    else slot.zero_();
    ready_[k] = 1;
    --b.pending;
  }
  send_ready_buckets();
  armed_ = false;
  lock.unlock();
  wait_all();
  for (size_t k = 0; k < params_.size(); ++k) {
    auto& p = params_[k];
    auto sum = shaped_like(buckets_[bucket_of_[k]]->buffer.narrow(0, offset_in_bucket_[k], p.numel()), p);
    if (p.grad().defined()) p.mutable_grad().copy_(sum);
    else p.mutable_grad() = sum.clone();
  }
}

void GradientSync::abandon() {
  if (scatter_) return abandon_scatter();
  std::unique_lock<std::mutex> lock(mu_);
  if (!armed_) return;
  // Every bucket not yet sent is sent as it is: the other ranks are sending theirs, and the agreement
  // after this micro-batch discards the result on every rank.
  while (next_to_send_ < buckets_.size()) send(next_to_send_++);
  armed_ = false;
  lock.unlock();
  wait_all();
}

}  // namespace trainer
