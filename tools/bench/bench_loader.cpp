// `trainer bench --loader-only`: the training data pipeline alone.
#include "tools/bench/bench.h"

#include <chrono>
#include <memory>

#include "data/files/image_h5.h"
#include "data/files/token_h5.h"
#include "data/samples/dataset.h"
#include "data/samples/loader.h"
#include "tools/bench/bench_job.h"
#include "tools/bench/host_info.h"
#include "trainer/memory/backend.h"
#include "trainer/memory/resources.h"
#include "trainer/run/from_config.h"

using nlohmann::json;

namespace trainer {

using namespace bench;

namespace {

// The fields of every loader result; the environment is read after the measurement.
json loader_result(const Config& cfg, const BenchOptions& opts, double sps, int64_t workers, int64_t prefetch,
                   int threads) {
  json j = describe_run(cfg, opts.config_path, opts.overrides, opts.command_line);
  j["mode"] = "loader";
  j["samples_per_s"] = sps;
  j["batches"] = opts.steps;
  j["warmup_batches"] = opts.warmup;
  j["workers"] = workers;
  j["prefetch"] = prefetch;
  j["threads"] = threads;
  j["config_yaml"] = to_yaml(cfg);
  j.update(bench_environment(device_name(cfg)));
  return j;
}

json bench_token_loader(const Config& cfg, const BenchOptions& opts, int threads) {
  // The token loader has no workers: next() cuts the windows in the caller's thread, as in training.
  std::shared_ptr<data::TokenSource> tds;
  if (cfg.data.kind == DataKind::kSynthetic) {
    tds = synthetic_tokens(cfg);
  } else {
    check_data_file(cfg, cfg.data.train, cfg.data.in_memory);
    tds = std::make_shared<data::TokenDataset>(cfg.data.train, cfg.data.in_memory);
  }
  data::TokenLoaderOptions to;
  to.global_batch = cfg.train.global_batch;
  to.context = cfg.model.context;
  to.seed = cfg.seed;
  data::TokenLoader loader(tds, to);
  for (int64_t i = 0; i < opts.warmup; ++i) loader.next();
  const auto t0 = std::chrono::steady_clock::now();
  int64_t samples = 0;
  for (int64_t i = 0; i < opts.steps; ++i) samples += loader.next().images.size(0);
  const double sps =
      static_cast<double>(samples) / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  json j = loader_result(cfg, opts, sps, /*workers=*/0, /*prefetch=*/0, threads);
  j["tokens_per_s"] = sps * static_cast<double>(cfg.model.context);
  return j;
}

json bench_image_loader(const Config& cfg, const BenchOptions& opts, int threads, bool pin_memory) {
  std::shared_ptr<data::ImageDataset> ds;
  const bool encoded = encoded_image_job(cfg);
  const int64_t workers = cfg.data.workers > 0 ? cfg.data.workers : threads;
  if (encoded) {
    ds = encoded_image_dataset(cfg, cfg.data.train, /*train=*/true, nullptr, static_cast<int>(workers));
  } else if (cfg.data.kind == DataKind::kSynthetic) {
    ds = std::make_shared<data::SyntheticImageDataset>(cfg.data.synthetic_size, cfg.data.shape[0], cfg.data.shape[1],
                                                       cfg.data.shape[2], cfg.model.num_classes, cfg.seed);
  } else {
    check_data_file(cfg, cfg.data.train, cfg.data.in_memory);
    ds = std::make_shared<data::ImageH5Dataset>(cfg.data.train, cfg.data.in_memory);
  }
  // The same options as the training loop's loader (trainer/run/setup.cpp).
  data::LoaderOptions lo = image_loader_options(cfg, workers);
  lo.pin_memory = pin_memory;
  lo.uint8_batches = uint8_image_batches(cfg, torch::Device(pin_memory ? torch::kCUDA : torch::kCPU));
  data::Loader loader(ds, lo);
  for (int64_t i = 0; i < opts.warmup; ++i) loader.next();
  // CPU seconds of the whole process (the workers are its threads) over the timed batches, plus the one
  // batch measure_loader_throughput takes first: a slight overstatement, never an understatement.
  double cpu0 = process_cpu_seconds();
  const double sps = data::measure_loader_throughput(loader, static_cast<int>(opts.steps));
  const double cpu_seconds = process_cpu_seconds() - cpu0;
  const std::string dtype = loader.next().images.scalar_type() == torch::kUInt8 ? "uint8 NHWC" : "float32 NCHW";
  double eval_sps = 0, eval_cpu_seconds = 0;
  if (encoded) {
    // The eval transform (resize + center crop) on the same files, in the same loader.
    data::Loader eval_loader(encoded_image_dataset(cfg, cfg.data.train, /*train=*/false, &ds->meta(), 1), lo);
    for (int64_t i = 0; i < opts.warmup; ++i) eval_loader.next();
    cpu0 = process_cpu_seconds();
    eval_sps = data::measure_loader_throughput(eval_loader, static_cast<int>(opts.steps));
    eval_cpu_seconds = process_cpu_seconds() - cpu0;
  }

  json j = loader_result(cfg, opts, sps, lo.workers, lo.prefetch, threads);
  j["augment"] = {{"crop_padding", lo.augment.random_crop_padding},
                  {"hflip", lo.augment.hflip},
                  {"normalize", lo.augment.normalize},
                  {"pin_memory", loader.pinned()}};
  j["batch_dtype"] = dtype;
  j["cpu_seconds"] = cpu_seconds;
  if (encoded) {
    j["eval_samples_per_s"] = eval_sps;
    j["eval_cpu_seconds"] = eval_cpu_seconds;
    j["transform"] = {{"size", cfg.data.size}, {"scale", cfg.data.scale}, {"ratio", cfg.data.ratio}, {"hflip", cfg.data.hflip},
                      {"crop_pct", cfg.data.crop_pct}, {"crop_padding", cfg.data.crop_padding}};
  }
  return j;
}

}  // namespace

json bench_loader(const Config& cfg_in, const BenchOptions& opts) {
  check_counts(opts);
  Config cfg = cfg_in;
  validate(cfg);
  const std::string device = device_name(cfg);
  const int threads = threads_of(cfg);
  apply_cpu_threads(threads);
  // On the CPU the training loop's batches come from the capped allocator; measure with it too.
  std::unique_ptr<MemoryBackend> memory;
  if (device == "cpu") memory = make_memory_backend(torch::Device(torch::kCPU));
  if (token_job(cfg)) return bench_token_loader(cfg, opts, threads);
  return bench_image_loader(cfg, opts, threads, /*pin_memory=*/device != "cpu");
}

}  // namespace trainer
