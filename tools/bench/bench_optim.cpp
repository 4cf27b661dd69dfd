// `trainer bench --optimizer`: the optimizer's update alone, on the job's model.
#include "tools/bench/bench.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include "tools/bench/bench_job.h"
#include "tools/bench/host_info.h"
#include "trainer/memory/resources.h"
#include "trainer/numerics/optim.h"
#include "trainer/run/from_config.h"

using nlohmann::json;

namespace trainer {

using namespace bench;

json bench_optimizer(const Config& cfg_in, const BenchOptions& opts) {
  check_counts(opts);
  Config cfg = cfg_in;
  validate(cfg);
  const std::string device_text = device_name(cfg);
  const torch::Device device(device_text);
  const int threads = threads_of(cfg);
  apply_cpu_threads(threads);
  const bool tokens = token_job(cfg);
  const auto shape = sample_shape(cfg);
  torch::manual_seed(cfg.seed);
  auto model = build_model(cfg, shape, tokens ? vocab_size(cfg) : 0);
  model->to(device);
  std::vector<ParamSlot> slots = param_slots(*model, cfg.optim.decay_norm_and_bias);
  Optimizer optimizer(slots, cfg.optim);
  optimizer.allocate_state();
  // One gradient per parameter, kept aside: every step consumes its gradients (they become the
  // denominators), so each gets a fresh copy of the same values, outside the timing.
  std::vector<torch::Tensor> grads;
  int64_t parameters = 0;
  for (auto& s : slots) {
    grads.push_back(torch::randn_like(s.param) * 1e-3);
    s.param.mutable_grad() = torch::zeros_like(s.param);
    parameters += s.param.numel();
  }
  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  };
  std::vector<double> times;
  for (int64_t i = 0; i < opts.warmup + opts.steps; ++i) {
    {
      torch::NoGradGuard no_grad;
      for (size_t k = 0; k < slots.size(); ++k) slots[k].param.grad().copy_(grads[k]);
    }
    sync();
    const auto t0 = std::chrono::steady_clock::now();
    optimizer.step(cfg.optim.lr);
    sync();
    if (i >= opts.warmup) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];

  json j = describe_run(cfg, opts.config_path, opts.overrides, opts.command_line);
  j["mode"] = "optimizer";
  j["optimizer"] = mode_name(cfg.optim.name);
  j["state_dtype"] = mode_name(cfg.optim.state_dtype);
  j["implementation_used"] = optimizer.implementation();
  j["device"] = device_text;
  j["threads"] = threads;
  j["parameters"] = parameters;
  j["tensors"] = slots.size();
  j["state_bytes"] = optimizer.state_bytes();
  j["state_bytes_per_parameter"] = static_cast<double>(optimizer.state_bytes()) / static_cast<double>(parameters);
  j["warmup_steps"] = opts.warmup;
  j["timed_steps"] = opts.steps;
  j["step_s"] = times;
  j["step_s_median"] = median;
  j["ns_per_parameter"] = median * 1e9 / static_cast<double>(parameters);
  json tensors = json::array();
  for (const auto& s : slots) tensors.push_back({{"shape", s.param.sizes().vec()}, {"decay", s.decay}});
  j["param_shapes"] = tensors;
  j["config_yaml"] = to_yaml(cfg);
  j.update(bench_environment(device_text));
  return j;
}

}  // namespace trainer
