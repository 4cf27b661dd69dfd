// What a measurement ran on: the host, this process and the GPU, read from /proc, getrusage and CUDA.
// bench_environment() (tools/bench/bench.h) puts them into every result.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace trainer::bench {

/// The "model name" of /proc/cpuinfo ("" if there is none).
std::string cpu_model();

/// The BLAS libraries mapped into this process (from /proc/self/maps, comma-separated).
std::string loaded_blas();

/// The load average over 1, 5 and 15 minutes (empty if it cannot be read).
std::vector<double> load_avg();

/// The minor page faults of this process so far.
int64_t minor_page_faults();

/// The CPU seconds of this process so far, user + system, all its threads.
double process_cpu_seconds();

}  // namespace trainer::bench
