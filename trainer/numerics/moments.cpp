#include "trainer/numerics/moments.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "trainer/numerics/optim.h"
#include "trainer/numerics/quant8.h"

namespace trainer {

namespace {

// One moment of one tensor, as the block loop reads and writes it.
struct MomentView {
  float* f32 = nullptr;          // float32 values, or
  c10::BFloat16* bf16 = nullptr;  // bfloat16 values, or
  uint8_t* codes = nullptr;       // int8 codes, with
  float* absmax = nullptr;        // their scales, and
  const quant8::Codebook* book = nullptr;  // the map they index

  void decode(int64_t begin, int64_t n, float* out) const {
    if (f32) std::copy(f32 + begin, f32 + begin + n, out);
    else if (bf16) for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(bf16[begin + j]);
    else quant8::decode_block(codes + begin, n, *book, absmax[begin / quant8::kBlock], out);
  }
  void encode(int64_t begin, int64_t n, const float* in) const {
    if (f32) std::copy(in, in + n, f32 + begin);
    else if (bf16) for (int64_t j = 0; j < n; ++j) bf16[begin + j] = c10::BFloat16(in[j]);
    else absmax[begin / quant8::kBlock] = quant8::encode_block(in, n, *book, codes + begin);
  }
};

// Runs f over [0, blocks) in ranges of at least 64 blocks, on the caller and on LibTorch's inter-op pool,
// as many at once as train.threads: at::parallel_for runs serially in this project's files, which are not
// compiled with OpenMP (docs/MEMORY.md). Every thread takes the next range until none is left; the caller
// then waits only for the ranges already taken, so that it never waits on a pool that is busy (or on a
// task of the pool it may itself be running on): a task that starts late finds nothing left to do.
void for_blocks(int64_t blocks, const std::function<void(int64_t, int64_t)>& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), blocks / 64);
  if (threads <= 1) return f(0, blocks);
  struct Shared {
    std::function<void(int64_t, int64_t)> f;
    int64_t blocks = 0, per = 0, ranges = 0;
    std::atomic<int64_t> next{0}, running{0};
    std::mutex mutex;
    std::condition_variable idle;
    void work() {
      for (int64_t r; (r = next++) < ranges;) f(r * per, std::min(blocks, (r + 1) * per));
    }
  };
  auto s = std::make_shared<Shared>();
  s->f = f, s->blocks = blocks, s->ranges = threads * 4, s->per = (blocks + s->ranges - 1) / s->ranges;
  for (int64_t t = 1; t < threads; ++t)
    at::launch([s] {
      ++s->running;
      s->work();
      if (--s->running == 0) {
        std::lock_guard<std::mutex> lock(s->mutex);
        s->idle.notify_all();
      }
    });
  s->work();
  std::unique_lock<std::mutex> lock(s->mutex);
  s->idle.wait(lock, [&] { return s->running == 0; });
}

MomentView view_of(torch::Tensor& values, torch::Tensor& absmax, bool is_signed) {
  MomentView v;
  if (values.scalar_type() == torch::kFloat) v.f32 = values.data_ptr<float>();
  else if (values.scalar_type() == torch::kBFloat16) v.bf16 = values.data_ptr<c10::BFloat16>();
  else {
    v.codes = values.data_ptr<uint8_t>();
    v.absmax = absmax.data_ptr<float>();
    v.book = &quant8::codebook(is_signed);
  }
  return v;
}

// Zero state for one parameter in `dtype`: float32 zeros, bfloat16 zeros, or (int8) the code of 0 with
// scales of 1e-12, what quantizing a zero tensor gives. Laid out as the parameter is (its strides): the
// block loop pairs values by their place in memory, and blocks are runs of 256 in memory.
void zero_moment(const torch::Tensor& p, StateDtype dtype, bool is_signed, torch::Tensor& values, torch::Tensor& absmax) {
  const auto like = [&](torch::ScalarType t) { return torch::zeros_like(p, p.options().dtype(t), at::MemoryFormat::Preserve); };
  absmax = torch::Tensor();
  if (dtype == StateDtype::kBfloat16) values = like(torch::kBFloat16);
  else if (dtype == StateDtype::kFloat32 || !quant8::quantizes(p.numel())) values = like(torch::kFloat);
  else {
    const float zero = 0.0f;
    uint8_t code = 0;
    const float scale = quant8::encode_block(&zero, 1, quant8::codebook(is_signed), &code);
    values = like(torch::kUInt8).fill_(static_cast<int64_t>(code));
    absmax = torch::full({p.numel() / quant8::kBlock}, scale, p.options().dtype(torch::kFloat));
  }
}

// The elements of a dense tensor in the order they lie in memory, as a 1-D view.
torch::Tensor in_memory_order(const torch::Tensor& t) { return t.as_strided({t.numel()}, {1}, t.storage_offset()); }

const char* dtype_name(const torch::Tensor& values) {
  return values.scalar_type() == torch::kUInt8 ? "int8" : values.scalar_type() == torch::kBFloat16 ? "bfloat16" : "float32";
}

}  // namespace

void AdamMoments::allocate(const std::vector<ParamSlot>& params) {
  if (m_.size() == params.size()) return;
  for (const auto& s : params) {
    // The block loop (update()) runs for moments in fewer bytes and for bfloat16 weights.
    const bool bf16 = s.param.scalar_type() == torch::kBFloat16;
    if (dtype_ == StateDtype::kFloat32 && !bf16) continue;
    const std::string what = bf16 ? std::string("model.param_dtype: bfloat16") : "optim.state_dtype: " + mode_name(dtype_);
    if (!s.param.device().is_cpu())
      throw std::invalid_argument(what + " runs on the CPU only; '" + s.name + "' is on " + s.param.device().str() +
                                  " (use float32)");
    if (!s.param.is_non_overlapping_and_dense())
      throw std::invalid_argument(what + " needs dense parameters; '" + s.name + "' is a view with gaps (use float32)");
  }
  std::vector<torch::Tensor> m(params.size()), v(params.size()), ma(params.size()), va(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    zero_moment(params[i].param, dtype_, /*is_signed=*/true, m[i], ma[i]);
    zero_moment(params[i].param, dtype_, /*is_signed=*/false, v[i], va[i]);
  }
  m_ = std::move(m), v_ = std::move(v), m_absmax_ = std::move(ma), v_absmax_ = std::move(va);
}

void AdamMoments::clear() { m_.clear(), v_.clear(), m_absmax_.clear(), v_absmax_.clear(); }

void AdamMoments::update(size_t i, const BlockFn& f) {
  const MomentView m = view_of(m_[i], m_absmax_[i], true), v = view_of(v_[i], v_absmax_[i], false);
  const int64_t n = m_[i].numel(), blocks = (n + quant8::kBlock - 1) / quant8::kBlock;
  for_blocks(blocks, [&](int64_t b0, int64_t b1) {
    float mb[quant8::kBlock], vb[quant8::kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * quant8::kBlock, len = std::min(quant8::kBlock, n - begin);
      m.decode(begin, len, mb);
      v.decode(begin, len, vb);
      f(mb, vb, begin, len);
      m.encode(begin, len, mb);
      v.encode(begin, len, vb);
    }
  });
}

std::vector<StateBuffers> AdamMoments::buffers() {
  return {{"exp_avg.", &m_}, {"exp_avg_sq.", &v_}, {"exp_avg_absmax.", &m_absmax_}, {"exp_avg_sq_absmax.", &v_absmax_}};
}

int64_t AdamMoments::bytes() const {
  int64_t total = 0;
  for (const auto* list : {&m_, &v_, &m_absmax_, &v_absmax_})
    for (const auto& t : *list)
      if (t.defined()) total += t.numel() * static_cast<int64_t>(t.element_size());
  return total;
}

int64_t AdamMoments::bytes_for(int64_t numel, StateDtype dtype) {
  if (dtype == StateDtype::kBfloat16) return 2 * numel * 2;
  if (dtype == StateDtype::kFloat32 || !quant8::quantizes(numel)) return 2 * numel * 4;
  return 2 * (numel + numel / quant8::kBlock * 4);  // codes, and a float32 scale per block
}

namespace {

// One saved moment into `values` (and `absmax`), as this state_dtype holds it. Returns the saved dtype's
// name when it differs from ours.
std::string load_moment(const std::map<std::string, torch::Tensor>& state, const std::string& key,
                        const std::string& absmax_key, bool is_signed, torch::Tensor& values, torch::Tensor& absmax) {
  auto it = state.find(key);
  if (it == state.end()) throw std::runtime_error("optimizer state: missing entry '" + key + "'");
  const torch::Tensor& src = it->second;
  if (src.sizes() != values.sizes())
    throw std::runtime_error("optimizer state: '" + key + "' has shape " + c10::str(src.sizes()) + ", the parameter has " +
                             c10::str(values.sizes()));
  torch::Tensor saved_scale;
  if (src.scalar_type() == torch::kUInt8) {
    auto a = state.find(absmax_key);
    if (a == state.end()) throw std::runtime_error("optimizer state: missing entry '" + absmax_key + "' (the scales of '" + key + "')");
    if (a->second.numel() * quant8::kBlock != src.numel())
      throw std::runtime_error("optimizer state: '" + absmax_key + "' has " + std::to_string(a->second.numel()) +
                               " scales for " + std::to_string(src.numel()) + " codes (one per 256)");
    saved_scale = a->second;
  }
  const std::string ours = dtype_name(values), theirs = dtype_name(src);
  torch::NoGradGuard no_grad;
  if (ours == theirs) {
    values.copy_(src);
    if (saved_scale.defined()) absmax.copy_(saved_scale);
    return "";
  }
  // Through float32, laid out as the parameter: int8 codes are blocked in its memory order (a checkpoint's
  // codes, copied into that layout, are back in the order they were blocked in when the layouts agree).
  const bool in_place = src.scalar_type() == torch::kFloat && src.strides() == values.strides();
  torch::Tensor f32 = in_place ? src : torch::empty_like(values, values.options().dtype(torch::kFloat), at::MemoryFormat::Preserve);
  if (in_place) {
    // the saved float32 moment, laid out as the parameter, is read as it is
  } else if (saved_scale.defined()) {
    const torch::Tensor codes = torch::empty_like(values, values.options().dtype(torch::kUInt8), at::MemoryFormat::Preserve).copy_(src);
    in_memory_order(f32).copy_(quant8::dequantize(in_memory_order(codes), saved_scale, is_signed));
  } else {
    f32.copy_(src);
  }
  if (values.scalar_type() == torch::kUInt8) {
    torch::Tensor codes = in_memory_order(values);
    quant8::quantize(in_memory_order(f32), is_signed, codes, absmax);
  } else {
    values.copy_(f32);
  }
  return theirs;
}

}  // namespace

std::string AdamMoments::load(const std::map<std::string, torch::Tensor>& state, const std::vector<ParamSlot>& params) {
  clear();
  allocate(params);
  std::string from;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params[i].name;
    for (const std::string& saved : {load_moment(state, "exp_avg." + name, "exp_avg_absmax." + name, true, m_[i], m_absmax_[i]),
                                     load_moment(state, "exp_avg_sq." + name, "exp_avg_sq_absmax." + name, false, v_[i], v_absmax_[i])})
      if (!saved.empty() && from.empty()) from = saved;
  }
  return from.empty() ? "" : from + " to " + mode_name(dtype_);
}

std::string AdamMoments::convert(StateDtype dtype, const std::vector<ParamSlot>& params) {
  if (m_.empty()) {  // nothing allocated yet: the first step allocates in the new dtype
    dtype_ = dtype;
    return "";
  }
  const std::string from = mode_name(dtype_);
  if (dtype == dtype_) return "";
  for (size_t i = 0; i < params.size(); ++i) {
    if (dtype_name(m_[i]) == std::string(mode_name(dtype)) ||
        (dtype == StateDtype::kInt8 && !quant8::quantizes(params[i].param.numel()) && m_[i].scalar_type() == torch::kFloat))
      continue;  // converted by an earlier call, or a small tensor that int8 keeps in float32
    const std::string& name = params[i].name;
    const std::map<std::string, torch::Tensor> old = {{"exp_avg." + name, m_[i]}, {"exp_avg_absmax." + name, m_absmax_[i]},
                                                      {"exp_avg_sq." + name, v_[i]}, {"exp_avg_sq_absmax." + name, v_absmax_[i]}};
    torch::Tensor m, ma, v, va;
    zero_moment(params[i].param, dtype, /*is_signed=*/true, m, ma);
    zero_moment(params[i].param, dtype, /*is_signed=*/false, v, va);
    load_moment(old, "exp_avg." + name, "exp_avg_absmax." + name, true, m, ma);
    load_moment(old, "exp_avg_sq." + name, "exp_avg_sq_absmax." + name, false, v, va);
    m_[i] = std::move(m), m_absmax_[i] = std::move(ma), v_[i] = std::move(v), v_absmax_[i] = std::move(va);
  }
  dtype_ = dtype;
  return from + " to " + mode_name(dtype);
}

}  // namespace trainer
