#include "models/activation_checkpoint.h"

// The autocast get/set calls differ between LibTorch 1.13 and 2.x; compat.h is the one place that knows.
#include "common/compat.h"
#include "common/rng.h"

#include <utility>
#include <vector>

namespace models {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- autocast state ---------------------------------------------------------------------------------

struct AutocastState {
  bool cpu_enabled = false;
  at::ScalarType cpu_dtype = at::kBFloat16;
  bool cuda_enabled = false;
  at::ScalarType cuda_dtype = at::kHalf;
};

AutocastState capture_autocast() {
  namespace compat = trainer::compat;
  AutocastState s;
  s.cpu_enabled = compat::autocast_enabled(c10::DeviceType::CPU);
  s.cpu_dtype = compat::autocast_dtype(c10::DeviceType::CPU);
  s.cuda_enabled = compat::autocast_enabled(c10::DeviceType::CUDA);
  s.cuda_dtype = compat::autocast_dtype(c10::DeviceType::CUDA);
  return s;
}

void apply_autocast(const AutocastState& s) {
  namespace compat = trainer::compat;
  compat::set_autocast_enabled(c10::DeviceType::CPU, s.cpu_enabled);
  compat::set_autocast_dtype(c10::DeviceType::CPU, s.cpu_dtype);
  compat::set_autocast_enabled(c10::DeviceType::CUDA, s.cuda_enabled);
  compat::set_autocast_dtype(c10::DeviceType::CUDA, s.cuda_dtype);
}

// Turns the autocast weight-cast cache off for a scope. The cache keeps the first low-precision copy
// of a leaf weight until the outermost autocast scope ends: a copy made in the no-grad forward has no
// autograd history and would silently cut the weights out of a later plain forward's graph, and a
// copy made in the recomputation would outlive it. Casting again costs little next to the recompute.
class AutocastCacheOff {
 public:
  AutocastCacheOff() : prev_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~AutocastCacheOff() { at::autocast::set_autocast_cache_enabled(prev_); }
  AutocastCacheOff(const AutocastCacheOff&) = delete;
  AutocastCacheOff& operator=(const AutocastCacheOff&) = delete;

 private:
  bool prev_;
};

// Puts the forward's autocast state in place for the recomputation and the caller's back after it.
class ScopedAutocastState {
 public:
  explicit ScopedAutocastState(const AutocastState& s) : prev_(capture_autocast()) { apply_autocast(s); }
  ~ScopedAutocastState() { apply_autocast(prev_); }
  ScopedAutocastState(const ScopedAutocastState&) = delete;
  ScopedAutocastState& operator=(const ScopedAutocastState&) = delete;

 private:
  AutocastState prev_;
};

// ---- RNG state --------------------------------------------------------------------------------------

using RngState = trainer::GeneratorStates;  // the CPU generator, plus the input's CUDA device's

// Runs the recomputation on the forward's random stream, then puts the caller's stream back: the
// recomputation draws the same dropout masks and consumes nothing from the global generators.
class ScopedRngState {
 public:
  explicit ScopedRngState(const RngState& forward_state)
      : current_(RngState::capture(forward_state.cuda.defined() ? forward_state.cuda_device
                                                                : c10::Device(c10::DeviceType::CPU))) {
    forward_state.restore();
  }
  ~ScopedRngState() { current_.restore(); }
  ScopedRngState(const ScopedRngState&) = delete;
  ScopedRngState& operator=(const ScopedRngState&) = delete;

 private:
  RngState current_;
};

// ---- buffers ------------------------------------------------------------------------------------------

// Restores `owner`'s buffers (BatchNorm running statistics and counters) on scope exit, so the
// recomputation's second update of them is undone.
class BufferSnapshot {
 public:
  explicit BufferSnapshot(std::vector<torch::Tensor> buffers) : buffers_(std::move(buffers)) {
    torch::NoGradGuard no_grad;
    copies_.reserve(buffers_.size());
    for (const auto& b : buffers_) copies_.push_back(b.defined() ? b.clone() : torch::Tensor());
  }
  ~BufferSnapshot() {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < buffers_.size(); ++i) {
      if (buffers_[i].defined()) buffers_[i].copy_(copies_[i]);
    }
  }
  BufferSnapshot(const BufferSnapshot&) = delete;
  BufferSnapshot& operator=(const BufferSnapshot&) = delete;

 private:
  std::vector<torch::Tensor> buffers_;
  std::vector<torch::Tensor> copies_;
};

// ---- the autograd function ------------------------------------------------------------------------

// What backward needs besides the saved input. Held in the autograd context as a capsule, because the
// context only stores IValues.
struct CheckpointState : torch::CustomClassHolder {
  std::function<torch::Tensor(const torch::Tensor&)> fn;
  std::vector<torch::Tensor> params;   // owner's trainable parameters, in the Function's input order
  std::vector<torch::Tensor> buffers;  // owner's buffers (the same tensors, updated in place)
  RngState rng;
  AutocastState autocast;
};

// Inputs: the block input, then owner's trainable parameters (so the output requires grad even when
// the input does not, e.g. the first block, and so the engine accumulates their gradients like any
// leaf's), then the state (not a variable).
struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, at::TensorList params,
                               c10::intrusive_ptr<CheckpointState> state) {
    state->rng = RngState::capture(input.device());
    state->autocast = capture_autocast();
    torch::Tensor out;
    {
      torch::NoGradGuard no_grad;
      AutocastCacheOff cache_off;
      out = state->fn(input);
    }
    TORCH_CHECK(out.defined(), "models::checkpoint: the checkpointed function returned an undefined tensor");
    ctx->save_for_backward({input});
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(ctx->saved_data["state"].toCapsule());
    const size_t num_params = state->params.size();

    torch::Tensor x = saved[0].detach();
    x.requires_grad_(ctx->needs_input_grad(0));

    // Buffers are put back only after the gradients are computed: BatchNorm saves its running
    // statistics for backward, and restoring them earlier would bump their version counters and make
    // the recomputed graph unusable.
    BufferSnapshot buffers(state->buffers);
    torch::Tensor out;
    {
      ScopedRngState rng(state->rng);
      ScopedAutocastState autocast(state->autocast);
      AutocastCacheOff cache_off;
      torch::AutoGradMode grad_on(true);
      out = state->fn(x);
    }

    // Gradients only for what the outer backward asks for (needs_input_grad follows torch::autograd::grad's
    // inputs as well as requires_grad).
    std::vector<torch::Tensor> wrt;
    std::vector<size_t> slot;  // position of each wrt entry in the returned list
    if (x.requires_grad()) {
      wrt.push_back(x);
      slot.push_back(0);
    }
    for (size_t i = 0; i < num_params; ++i) {
      if (ctx->needs_input_grad(1 + i) && state->params[i].requires_grad()) {
        wrt.push_back(state->params[i]);
        slot.push_back(1 + i);
      }
    }
    // One entry per forward argument: input, each parameter, and the (non-variable) state.
    variable_list grads(num_params + 2);
    if (!wrt.empty() && out.requires_grad()) {
      auto computed = torch::autograd::grad({out}, wrt, {grad_outputs[0]}, /*retain_graph=*/false,
                                            /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t k = 0; k < computed.size(); ++k) grads[slot[k]] = computed[k];
    }
    return grads;
  }
};

}  // namespace

torch::Tensor checkpoint(torch::nn::Module& owner,
                         const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                         const torch::Tensor& input) {
  std::vector<torch::Tensor> trainable;
  for (const auto& p : owner.parameters(/*recurse=*/true)) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  if (!torch::GradMode::is_enabled() || (!input.requires_grad() && trainable.empty())) return fn(input);

  auto state = c10::make_intrusive<CheckpointState>();
  state->fn = fn;
  state->params = trainable;
  state->buffers = owner.buffers(/*recurse=*/true);
  return CheckpointFunction::apply(input, at::TensorList(trainable), std::move(state));
}

}  // namespace models
