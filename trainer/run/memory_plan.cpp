#include "trainer/run/memory_plan.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "models/attention.h"
#include "models/footprint.h"
#include "trainer/dist/dist.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/resources.h"
#include "trainer/numerics/moments.h"
#include "trainer/run/from_config.h"
#include "trainer/run/lora.h"

namespace trainer {
namespace {

std::string count(int64_t n) {
  std::ostringstream s;
  if (n >= 1000000000) s.precision(3), s << static_cast<double>(n) / 1e9 << " B";
  else if (n >= 1000000) s.precision(3), s << static_cast<double>(n) / 1e6 << " M";
  else s << n;
  return s.str();
}

// The optimizer's state: SGD's momentum buffer (float32), or AdamW's and LAMB's two moments in
// optim.state_dtype, tensor by tensor (a small tensor's int8 moments stay float32).
PlanLine optimizer_line(const Config& cfg, const std::vector<int64_t>& trained) {
  const auto& o = cfg.optim;
  int64_t count = 0;
  for (int64_t n : trained) count += n;
  if (o.name == OptimKind::kSgd) {
    if (o.momentum == 0) return {"optimizer state", 0, "SGD without momentum keeps none"};
    return {"optimizer state", count * 4, "SGD's momentum buffer, float32"};
  }
  int64_t bytes = 0;
  for (int64_t n : trained) bytes += AdamMoments::bytes_for(n, o.state_dtype);
  return {"optimizer state", bytes, std::string(mode_name(o.name)) + "'s two moments, " + mode_name(o.state_dtype)};
}

// The element counts of the tensors the optimizer updates: every parameter, or with model.lora each adapted
// layer's A (r x in) and B (out x r).
std::vector<int64_t> trained_tensors(const Config& cfg, const models::Footprint& f) {
  if (cfg.model.lora.rank == 0) return f.parameters;
  const models::LoraOptions o = lora_options(cfg);
  std::vector<int64_t> adapters;
  for (const auto& l : f.linears) {
    if (std::find(o.targets.begin(), o.targets.end(), l.name) == o.targets.end()) continue;
    adapters.push_back(o.rank * l.in);
    adapters.push_back(l.out * o.rank);
  }
  return adapters;
}

}  // namespace

PlanJob plan_job(const Config& cfg, int64_t cap) {
  const bool tokens = token_job(cfg);
  const auto shape = sample_shape(cfg);
  const int64_t vocab = tokens ? vocab_size(cfg) : 0;
  const bool cuda = cuda_job(cfg);
  const models::Footprint f = models::model_footprint(cfg.model.name, model_options(cfg, shape, vocab), shape,
                                                      models::fused_attention_available());
  const int64_t params = f.parameter_count();
  const bool bf16 = cfg.model.param_dtype == ParamDtype::kBfloat16;
  const int64_t weight = bf16 ? 2 : 4;  // bytes of a weight, of its gradient
  PlanJob job;
  job.cap = cap;
  // With LoRA the trained tensors are the adapters, float32 beside the frozen base whatever its dtype.
  const bool lora = cfg.model.lora.rank > 0;
  const std::vector<int64_t> trained = trained_tensors(cfg, f);
  int64_t trained_count = 0, largest_trained = 0;
  for (int64_t n : trained) trained_count += n, largest_trained = std::max(largest_trained, n);
  const int64_t grad = lora ? 4 : weight;  // bytes of a gradient
  job.fixed.push_back({"weights", (params + f.buffers) * weight,
                       count(params) + " parameters" + (f.buffers ? " and " + count(f.buffers) + " buffer values" : "") +
                           ", " + mode_name(cfg.model.param_dtype) + (lora ? " (frozen)" : "")});
  if (lora) job.fixed.push_back({"LoRA adapters", trained_count * 4, count(trained_count) + " parameters, float32"});
  PlanLine state = optimizer_line(cfg, trained);
  const int64_t world = dist_env_from().world_size;
  if (cfg.dist.shard != ShardMode::kNone && world > 1 && state.bytes > 0) {
    // This rank's slice of every bucket: 1/world of the values, rounded up (ShardLayout pads each bucket).
    state.bytes = (state.bytes + world - 1) / world;
    state.how += "; this rank's 1/" + std::to_string(world) + " (dist.shard " + mode_name(cfg.dist.shard) + ")";
  }
  job.fixed.push_back(state);
  if (cfg.train.ema_decay > 0)
    job.fixed.push_back({"EMA", ((lora ? trained_count : params) + f.buffers) * 4,
                         "the averaged weights (train.ema_decay), float32"});
  if (cfg.amp.enabled)
    job.fixed.push_back({"autocast weights", params * 2,
                         std::string("the weights cast to ") + mode_name(cfg.amp.dtype) + " for the forward pass, kept for backward"});
  job.gradient_bytes = trained_count * grad;
  // The largest gradient as backward makes it, and a tied weight's second one before the two are summed.
  job.largest_gradient_bytes = lora ? largest_trained * grad : (f.largest_parameter() + f.tied) * weight;

  // One sample as the loader hands it over: int64 tokens and targets; float32 (or uint8) pixels and a label.
  int64_t sample_bytes = 0;
  if (tokens) {
    sample_bytes = 2 * shape.at(0) * 8;
  } else {
    const int64_t pixels = shape.at(0) * shape.at(1) * shape.at(2);
    sample_bytes = pixels * (uint8_image_batches(cfg, torch::Device(cuda ? torch::kCUDA : torch::kCPU)) ? 1 : 4) + 8;
  }
  const DistEnv env = dist_env_from();
  job.rank_batch = std::max<int64_t>(1, cfg.train.global_batch / std::max<int64_t>(1, env.world_size));
  if (!cuda) {  // the loader's batches are tensors under the CPU cap; on CUDA they are host memory
    const int64_t batches = cfg.data.prefetch + 1;
    job.fixed.push_back({"batches in flight", batches * job.rank_batch * sample_bytes,
                         std::to_string(batches) + " batches of " + std::to_string(job.rank_batch) +
                             " samples (data.prefetch + the step's)"});
  }
  // Activations per sample: 16-bit under autocast or with bfloat16 weights, but what stays float32 (the
  // loss's log-probabilities).
  const double element = cfg.amp.enabled || bf16 ? 2.0 : 4.0;
  auto activation_bytes = [&](double kept) {
    return element * (kept - f.saved_float32) + 4.0 * f.saved_float32 + element * f.transient;
  };
  const double on_device = cuda ? static_cast<double>(sample_bytes) : 0.0;
  job.per_sample_bytes = activation_bytes(f.saved) + on_device;
  job.per_sample_checkpointed_bytes = activation_bytes(f.saved_checkpointed) + on_device;
  const MicroBatchOptions mb = micro_batch_options(cfg, job.rank_batch);
  job.micro_batch = cfg.train.micro_batch < 0 ? 0 : mb.micro_batch;
  job.min_micro_batch = mb.min_micro_batch;
  job.checkpointing = mb.checkpointing;
  job.ladder_checkpointing = mb.allow_checkpointing;
  return job;
}

int64_t planned_cap(const Config& cfg) {
  const std::string spec = memory_limit_spec(cfg);
  if (spec.empty() || spec == "none") return 0;
  if (spec != "auto") return parse_bytes(spec);
  const bool cuda = cuda_job(cfg);
  const AutoLimitOptions o = auto_limit_options(cfg, cuda);
  if (cuda) {
    if (!torch::cuda::is_available()) return 0;
    auto backend = make_memory_backend(resolve_device(cfg.train.device));
    return static_cast<int64_t>(std::floor(static_cast<double>(backend->free_bytes()) * (1 - o.margin)));
  }
  return smaller_auto_cpu_limit(read_memory_bounds(o.system_root), host_rss_bytes(), 0, o.reserve_bytes, o.margin).cap;
}

PlanReport plan_report(const Config& cfg) { return plan_report(cfg, planned_cap(cfg)); }

PlanReport plan_report(const Config& cfg, int64_t cap) {
  PlanReport r;
  r.cap_line = describe_memory_limit(cfg);
  if (cap == 0 && memory_limit_spec(cfg) == "auto" && cuda_job(cfg) && !torch::cuda::is_available())
    r.cap_line += " (no GPU here: the plan has no cap; --set memory.limit=SIZE plans under one)";
  r.job = plan_job(cfg, cap);
  r.plan = plan_memory(r.job);
  const auto shape = sample_shape(cfg);
  std::ostringstream m;
  m << cfg.model.name << ", samples [";
  for (size_t i = 0; i < shape.size(); ++i) m << (i ? ", " : "") << shape[i];
  m << "], " << precision_of(cfg) << (models::fused_attention_available() ? "" : ", plain attention");
  r.model = m.str();
  if (r.plan.fits || cfg.optim.name == OptimKind::kSgd) return r;
  // The settings that change how the numbers are stored, not what is trained, least change first: the
  // moments in bfloat16, in int8, then the weights in bfloat16 too (with int8 moments and stochastic
  // rounding), where the config allows that (AdamW on the CPU in one process, without autocast or an EMA).
  const auto add = [&](const Config& alt, const std::string& setting) {
    PlanAlternative a;
    a.setting = setting;
    a.state_dtype = alt.optim.state_dtype;
    a.param_dtype = alt.model.param_dtype;
    a.job = plan_job(alt, cap);
    a.plan = plan_memory(a.job);
    r.alternatives.push_back(std::move(a));
  };
  for (StateDtype d : {StateDtype::kBfloat16, StateDtype::kInt8}) {
    if (static_cast<int>(d) <= static_cast<int>(cfg.optim.state_dtype)) continue;
    Config alt = cfg;
    alt.optim.state_dtype = d;
    add(alt, std::string("optim.state_dtype: ") + mode_name(d));
  }
  if (cfg.model.param_dtype == ParamDtype::kFloat32 && !cuda_job(cfg) && dist_env_from().world_size <= 1) {
    Config alt = cfg;
    alt.model.param_dtype = ParamDtype::kBfloat16;
    alt.optim.state_dtype = StateDtype::kInt8;
    alt.optim.stochastic_rounding = true;
    try {
      validate(alt);
      add(alt, "model.param_dtype: bfloat16 (optim.state_dtype: int8, optim.stochastic_rounding: true)");
    } catch (const ConfigError&) {
      // not a setting this job can take (another optimizer, CUDA, autocast, an EMA)
    }
  }
  return r;
}

std::string render_plan_report(const PlanReport& r) {
  std::ostringstream s;
  s << "model: " << r.model << "\n" << r.cap_line << "\n" << render_plan(r.job, r.plan);
  for (const auto& a : r.alternatives)
    s << "  " << a.setting << ": " << (a.plan.fits ? "fits, " : "does not fit either, ") << a.plan.rung << ", peak "
      << format_bytes(a.plan.peak_bytes) << "\n";
  return s.str();
}

nlohmann::json plan_report_json(const PlanReport& r) {
  auto j = plan_to_json(r.job, r.plan);
  j["model"] = r.model;
  j["cap_line"] = r.cap_line;
  auto alts = nlohmann::json::array();
  for (const auto& a : r.alternatives)
    alts.push_back({{"setting", a.setting}, {"fits", a.plan.fits}, {"peak_bytes", a.plan.peak_bytes}, {"rung", a.plan.rung}});
  j["alternatives"] = alts;
  return j;
}

}  // namespace trainer
