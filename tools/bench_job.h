// What the bench's measurements share about the job they run: the device, precision and threads it
// runs with, the option checks, and the fields that describe it at the top of every result.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "tools/bench.h"
#include "trainer/config.h"

namespace trainer::bench {

/// The device a job runs on, as a name with its index ("cuda:0", "cpu").
std::string device_name(const Config& cfg);

/// fp32, or the autocast dtype (bf16, fp16).
std::string precision_of(const Config& cfg);

/// The host threads a one-process run of the job uses.
int threads_of(const Config& cfg);

/// Throws std::invalid_argument for warmup < 0 or steps < 1.
void check_counts(const BenchOptions& opts);

/// schema, implementation, model, sample_shape, global_batch, config_file, overrides, command_line.
nlohmann::json describe_run(const Config& cfg, const BenchOptions& opts);

}  // namespace trainer::bench
