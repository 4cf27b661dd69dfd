// Trackers: what observes the run (trackers.h).
#include "trainer/run/trackers.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "common/compat.h"
#include "common/signals.h"
#include "common/versions.h"
#include "trainer/track/build_info.h"
#include "trainer/track/mlflow_client.h"

namespace fs = std::filesystem;

namespace trainer {

void Trackers::setup_observers(const Ranks& ranks) {
  if (cfg_.log.tensorboard && ranks.main_rank()) tensorboard_ = std::make_unique<TensorboardWriter>(opts_.run_dir);
  metrics_.set_observer([this](const nlohmann::json& j) {
    telemetry_.observe(j);
    if (tensorboard_) tensorboard_->observe(j);
    if (tracker_) tracker_->observe(j);
  });
  memory_report_ = std::make_unique<MemoryReporter>(ranks.rank_dir(), &telemetry_);
  if (cfg_.log.http_port > 0) {
    // One endpoint per process: the ranks on one node serve on consecutive ports.
    http_ = std::make_unique<HttpServer>(telemetry_, cfg_.log.http_host,
                                         static_cast<int>(cfg_.log.http_port + ranks.env().local_rank));
    spdlog::info("http: serving /metrics /healthz /readyz /memory on {}", http_->url());
  }
  main_rank_ = ranks.main_rank();
  write_resolved_config();
  spdlog::info("trainer {} (LibTorch {}), run folder {}", TRAINER_VERSION, compat::torch_version(), opts_.run_dir);
  if (!ranks.dist()) return;
  const DistEnv& env = ranks.env();
  spdlog::info("distributed: rank {} of {} (local {} of {}), {} samples of each global batch of {}", env.rank,
               env.world_size, env.local_rank, env.local_world_size, ranks.rank_batch(), cfg_.train.global_batch);
  telemetry_.set_info("rank", std::to_string(env.rank));
  telemetry_.set_info("world_size", std::to_string(env.world_size));
}

void Trackers::write_resolved_config() const {
  if (!main_rank_) return;
  std::ofstream out(fs::path(opts_.run_dir) / "resolved_config.yaml");
  out << to_yaml(cfg_);
}

void Trackers::set_changed_setting(const std::string& key, const std::string& from, const std::string& to) {
  // Before the run is tracked (the plan's choice at start): a param beside the config's. Mid-run, where
  // MLflow refuses a param's new value: a tag of the same name, which a later change replaces.
  changed_["memory.state.changed." + key] = from + " -> " + to;
  if (tracker_) tracker_->set_tags({{"memory.state.changed." + key, from + " -> " + to}});
  write_resolved_config();
}

void Trackers::setup_resources(const torch::Device& device) {
  resources_ = std::make_unique<ResourceMonitor>(device.is_cuda() ? std::max<int>(0, device.index()) : -1);
  telemetry_.set_gpu(resources_->gpu());  // UUID, GPU_I_ID: the labels of the DCGM exporter's series
  telemetry_.set_info("device", device.str());
  telemetry_.set_info("model", cfg_.model.name);
  telemetry_.set_info("version", TRAINER_VERSION);
}

void Trackers::setup_tracking(const torch::Device& device, const Ranks& ranks) {
  std::string uri = cfg_.log.mlflow;
  if (uri == "off") return;
  const char* env_uri = std::getenv("MLFLOW_TRACKING_URI");
  const char* source = "log.mlflow";
  if (uri.empty() && env_uri != nullptr && *env_uri != 0) {
    uri = env_uri;
    source = "MLFLOW_TRACKING_URI";
  }
  if (uri.empty()) return;
  // A tracker that cannot be reached is a warning, never a reason to stop a job (docs/OPERATIONS.md).
  if (const std::string why = track::check_tracking_uri(uri); !why.empty()) {
    spdlog::warn("mlflow: {} {}; this run is not tracked", source, why);
    return;
  }
  track::TrackerOptions o;
  o.uri = uri;
  o.experiment = !cfg_.log.mlflow_experiment.empty() ? cfg_.log.mlflow_experiment
                 : opts_.config_file.empty()          ? "resnet20_fmnist"  // the built-in job's config
                                                      : fs::path(opts_.config_file).stem().string();
  o.run_dir = opts_.run_dir;
  o.run_name = fs::absolute(opts_.run_dir).lexically_normal().filename().string();
  if (o.run_name.empty()) o.run_name = fs::absolute(opts_.run_dir).lexically_normal().parent_path().filename().string();
  o.params = track::params_of_yaml(to_yaml(cfg_));
  for (const auto& [key, change] : changed_) o.params[key] = change;
  o.tags = {{"mlflow.source.name", "trainer"},
            {"mlflow.source.type", "JOB"},
            {"mlflow.source.git.commit", track::build_commit()},
            {"trainer.version", TRAINER_VERSION},
            {"trainer.libtorch", compat::torch_version()},
            {"trainer.host", track::host_name()},
            {"trainer.device", device.str()},
            {"trainer.model", cfg_.model.name},
            {"trainer.world_size", std::to_string(ranks.env().world_size)},
            {"trainer.config", opts_.config_file.empty() ? "built-in" : opts_.config_file},
            {"trainer.run_dir", fs::absolute(opts_.run_dir).lexically_normal().string()}};
  if (const char* user = std::getenv("USER"); user != nullptr) o.tags["mlflow.user"] = user;
  if (const std::string v = cuda_runtime_version(); !v.empty()) o.tags["trainer.cuda"] = v;
  if (const std::string v = cudnn_version(); !v.empty()) o.tags["trainer.cudnn"] = v;
  const GpuIdentity& gpu = resources_->gpu();  // what the DCGM exporter's series are labelled with
  if (!gpu.uuid.empty()) o.tags["trainer.gpu_uuid"] = gpu.uuid;
  if (!gpu.mig_uuid.empty()) o.tags["trainer.mig_uuid"] = gpu.mig_uuid;
  tracker_ = std::make_unique<track::MlflowTracker>(std::move(o));
}

void Trackers::backfill_tracker(int64_t upto, const std::string& rank_dir) {
  std::ifstream in((fs::path(rank_dir) / "metrics.jsonl").string());
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer() || j["step"].get<int64_t>() > upto)
      continue;
    if (j.contains("event") && j["event"] != "eval") continue;  // step lines and evaluations only
    tracker_->observe(j);
  }
}

void Trackers::observe_resources(int64_t step, MemoryBackend& memory) {
  telemetry_.set_memory(device_memory_of(memory));
  if (step % cfg_.log.every == 0) {
    ResourceSample rs = resources_->sample(&memory);
    telemetry_.set_gpu_utilization(rs.gpu_percent);
    spdlog::info("{}", ResourceMonitor::format(rs));
  }
  if (take_memory_report_request() || telemetry_.take_memory_report_request()) {
    MemoryReport rep = memory_report_->write(step, memory, "request");
    spdlog::info("{}\n{}", rep.path.empty() ? rep.write_error : "memory report: " + rep.path, rep.text);
  }
}

}  // namespace trainer
