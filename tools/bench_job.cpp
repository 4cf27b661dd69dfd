#include "tools/bench_job.h"

#include <torch/torch.h>

#include <stdexcept>

#include "trainer/from_config.h"

using nlohmann::json;

namespace trainer::bench {

std::string device_name(const Config& cfg) {
  torch::Device d = resolve_device(cfg.train.device);
  if (d.is_cuda() && !d.has_index()) d = torch::Device(torch::kCUDA, 0);
  return d.str();
}

std::string precision_of(const Config& cfg) { return cfg.amp.enabled ? cfg.amp.dtype : "fp32"; }

int threads_of(const Config& cfg) { return cpu_threads(cfg, /*local_world_size=*/1); }

void check_counts(const BenchOptions& opts) {
  if (opts.warmup < 0)
    throw std::invalid_argument("bench: --warmup must be >= 0, got " + std::to_string(opts.warmup));
  if (opts.steps < 1) throw std::invalid_argument("bench: --steps must be >= 1, got " + std::to_string(opts.steps));
}

json describe_run(const Config& cfg, const BenchOptions& opts) {
  json j;
  j["schema"] = kBenchSchema;
  j["implementation"] = "trainer";
  j["model"] = cfg.model.name;
  j["sample_shape"] = sample_shape(cfg);
  j["global_batch"] = cfg.train.global_batch;
  j["config_file"] = opts.config_path;
  j["overrides"] = opts.overrides;
  j["command_line"] = opts.command_line;
  return j;
}

}  // namespace trainer::bench
