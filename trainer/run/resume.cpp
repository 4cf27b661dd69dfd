// What a checkpoint holds and how a run comes back from one:
//
//   model.pt      the weights, a state dict Python's torch.load reads (trainer/checkpoint/state_dict.h);
//                 with model.lora the adapters alone, the base's fingerprint in state.json (lora.h)
//   optimizer.pt  the optimizer's state tensors; with dist.shard the step count, the state in one
//                 optimizer.slice-<r>-of-<N>.pt per rank (optimizer_shards.h)
//   rng.pt        every rank's generators: "cpu"/"cuda" for rank 0, "cpu.rank<r>"/"cuda.rank<r>" others
//   state.json    the loop's position (step, epoch, position in samples), the ladder, the GradScaler
//   config.yaml   the resolved config, to refuse a resume into a different experiment
//   ema.pt        train.ema_decay: the averaged weights, a state dict of model.pt's names (rank 0's average)
//
// The store (trainer/checkpoint/store.h) writes them atomically; this file decides what goes in.
#include <spdlog/spdlog.h>


#include "common/clock.h"
#include "trainer/checkpoint/state_dict.h"
#include "trainer/run/from_config.h"
#include "trainer/run/lora.h"
#include "trainer/run/optimizer_shards.h"
#include "trainer/run/run.h"

namespace trainer {

nlohmann::json TrainingRun::state_json() const {
  nlohmann::json j;
  progress_.write_state(j);  // step, epoch, position, samples_seen, nonfinite_in_a_row
  j["seed"] = cfg_.seed;
  j["global_batch"] = cfg_.train.global_batch;
  j["micro_batch_config"] = cfg_.train.micro_batch;
  j["controller"] = step_runner_->controller().to_json();
  j["scaler"] = trained_.scaler().state();
  j["eval_micro_batch"] = eval_micro_batch_;
  j["limit_spec"] = memory_.limit().spec();
  j["world_size"] = ranks_.env().world_size;
  if (const ModelEma* ema = trained_.ema())
    j["ema"] = {{"decay", ema->options().decay}, {"warmup", ema->options().warmup}, {"every", ema->options().every}};
  // the real vocabulary: `trainer export --layout hf` drops wte's padding rows
  if (trained_.vocab() > 0) j["vocab_size"] = trained_.vocab();
  if (!trained_.lora_base().is_null()) j["lora_base"] = trained_.lora_base();  // what the adapters were trained on
  return j;
}

std::optional<CheckpointFiles> TrainingRun::serialize_checkpoint() {
  const LiftedCap lifted(memory_.backend());
  // Model and optimizer are replicated; the RNG is each rank's own, so rank 0 gathers them all and
  // writes the one checkpoint (every rank calls this at the same step: the gather is a collective).
  NamedTensors rng;
  const GeneratorStates generators = GeneratorStates::capture(trained_.device());
  if (Distributed* dist = ranks_.dist()) {
    auto cpus = dist->all_gather(generators.cpu, "the RNG gather for a checkpoint");
    auto cudas = trained_.device().is_cuda() ? dist->all_gather(generators.cuda, "the RNG gather for a checkpoint")
                                   : std::vector<torch::Tensor>{};
    for (int64_t r = 0; r < ranks_.env().world_size; ++r) {
      const std::string suffix = r == 0 ? "" : ".rank" + std::to_string(r);
      rng.emplace_back("cpu" + suffix, cpus[r].to(torch::kByte));
      if (!cudas.empty()) rng.emplace_back("cuda" + suffix, cudas[r].to(torch::kByte));
    }
  }
  CheckpointFiles optimizer_files;  // sharded: every rank's slice, gathered by rank 0 (optimizer_shards.h)
  if (ParamShards* shards = ranks_.shards())
    optimizer_files = sharded_optimizer_files(trained_.optimizer(), shards->layout(), *ranks_.dist());
  if (ranks_.dist()) {
    if (!main_rank()) return std::nullopt;
  } else {
    rng.emplace_back("cpu", generators.cpu);
    if (generators.cuda.defined()) rng.emplace_back("cuda", generators.cuda);
  }
  CheckpointFiles files;
  files["model.pt"] = model_file_bytes(*trained_.model());  // with LoRA, the adapters alone
  if (trained_.ema()) files["ema.pt"] = tensors_to_bytes(trained_.ema()->state());
  if (optimizer_files.empty()) files["optimizer.pt"] = tensors_to_bytes(trained_.optimizer().state());
  files.insert(optimizer_files.begin(), optimizer_files.end());
  files["rng.pt"] = tensors_to_bytes(rng);
  files["state.json"] = json_text(state_json(), 2);
  files["config.yaml"] = to_yaml(cfg_);
  return files;
}

std::string TrainingRun::checkpoint_problem(const LoadedCheckpoint& ck) const {
  // Checked before anything is restored, so that an unusable checkpoint falls back to an older one as
  // a corrupt one does: its CRCs only say the files are the ones that were written, not that they are
  // all there (a save by an older build, a folder edited by hand) or that they fit this run's data.
  for (const char* name : {"model.pt", "optimizer.pt", "rng.pt", "state.json", "config.yaml"})
    if (ck.files.count(name) == 0) return std::string(name) + " is missing (an incomplete checkpoint)";
  int64_t epoch = 0, position = 0;
  try {
    Config saved;
    apply_yaml_text(saved, ck.files.at("config.yaml"), ck.path + "/config.yaml");
    const auto st = nlohmann::json::parse(ck.files.at("state.json"));
    // Everything restore_loop() reads, parsed as it parses it.
    if (st.at("step").get<int64_t>() != ck.step)
      return "state.json says step " + st.at("step").dump() + ", the manifest " + std::to_string(ck.step);
    epoch = st.at("epoch").get<int64_t>();
    position = st.at("position").get<int64_t>();
    st.at("samples_seen").get<int64_t>();
    st.at("scaler").get<GradScalerState>();
    st.value("nonfinite_in_a_row", int64_t{0}), st.value("eval_micro_batch", int64_t{0});
    st.value("world_size", int64_t{1});
    if (st.value("micro_batch_config", int64_t{0}) == cfg_.train.micro_batch)
      MicroBatchController::from_json(st.at("controller"));
  } catch (const std::exception& e) {
    return "state.json or config.yaml: " + error_message(e);
  }
  const int64_t n = input_.source().positions_per_epoch();
  if (epoch < 0 || position < 0 || position > n)
    return "state.json's data position (epoch " + std::to_string(epoch) + ", position " + std::to_string(position) +
           ") is outside the training data (positions 0 to " + std::to_string(n) + ")";
  return "";
}

std::optional<LoadedCheckpoint> TrainingRun::find_checkpoint() const {
  std::optional<LoadedCheckpoint> ck;
  auto check = [this](const LoadedCheckpoint& c) { return checkpoint_problem(c); };
  if (!opts_.resume_from.empty()) {
    ck = CheckpointStore::load(opts_.resume_from, check);
  } else if (!opts_.no_resume) {  // --no-resume: setup() made sure the folder was empty
    ck = saver_->store().load_latest(check);
    for (const auto& w : ck ? ck->warnings : std::vector<std::string>{}) spdlog::warn("checkpoint: {}", w);
  }
  if (ranks_.dist() &&
      ranks_.dist()->all_max({ck ? 1.0 : 0.0, ck ? 0.0 : 1.0}, "the resume agreement") == std::vector<double>{1.0, 1.0})
    throw std::runtime_error("resume: some ranks found a checkpoint in " + opts_.run_dir + " and some did not; every rank "
                             "must see the same run folder (shared storage)");
  return ck;
}

void TrainingRun::check_same_experiment(const LoadedCheckpoint& ck) const {
  // A resize may change memory settings, micro-batch or step count; a different model or data would
  // make a different experiment.
  Config saved;
  apply_yaml_text(saved, ck.files.at("config.yaml"), ck.path + "/config.yaml");
  auto same = [&](const std::string& key, const auto& a, const auto& b) {
    if (!(a == b))
      throw std::runtime_error("resume from " + ck.path + " refused: " + key +
                               " differs from the checkpoint's; start a new run folder for a different experiment");
  };
  same("model.name", cfg_.model.name, saved.model.name);
  same("model.lora.rank", cfg_.model.lora.rank, saved.model.lora.rank);
  same("model.lora.targets", lora_options(cfg_).targets, lora_options(saved).targets);
  check_lora_base(nlohmann::json::parse(ck.files.at("state.json")), trained_.lora_base(), "resume from " + ck.path + " refused");
  same("model.num_classes", cfg_.model.num_classes, saved.model.num_classes);
  if (cfg_.model.param_dtype != saved.model.param_dtype)
    spdlog::warn("resume: {} holds {} weights and model.param_dtype is {}: they are converted ({}; the next steps "
                 "differ from a run that kept one dtype)", ck.path, mode_name(saved.model.param_dtype),
                 mode_name(cfg_.model.param_dtype),
                 cfg_.model.param_dtype == ParamDtype::kBfloat16 ? "rounded to nearest" : "exactly");
  same("data.kind", cfg_.data.kind, saved.data.kind);
  same("data.train", cfg_.data.train, saved.data.train);
  same("data.shape", cfg_.data.shape, saved.data.shape);
  if (cfg_.data.kind == DataKind::kSynthetic) same("data.synthetic_size", cfg_.data.synthetic_size, saved.data.synthetic_size);
  same("data.crop_padding", cfg_.data.crop_padding, saved.data.crop_padding);
  if (encoded_image_job(cfg_)) {  // the decoded view and its random crops
    same("data.size", cfg_.data.size, saved.data.size);
    same("data.scale", cfg_.data.scale, saved.data.scale);
    same("data.ratio", cfg_.data.ratio, saved.data.ratio);
    same("data.crop_pct", cfg_.data.crop_pct, saved.data.crop_pct);
  }
  same("data.hflip", cfg_.data.hflip, saved.data.hflip);
  same("data.auto_augment", cfg_.data.auto_augment, saved.data.auto_augment);
  if (cfg_.data.auto_augment == AutoAugment::kRandAugment) {
    same("data.randaugment_ops", cfg_.data.randaugment_ops, saved.data.randaugment_ops);
    same("data.randaugment_magnitude", cfg_.data.randaugment_magnitude, saved.data.randaugment_magnitude);
  }
  same("data.random_erasing", cfg_.data.random_erasing, saved.data.random_erasing);
  same("data.normalize", cfg_.data.normalize, saved.data.normalize);
  same("train.global_batch", cfg_.train.global_batch, saved.train.global_batch);
  same("seed", cfg_.seed, saved.seed);
}

void TrainingRun::restore_tensors(const LoadedCheckpoint& ck) {
  const LiftedCap lifted(memory_.backend());
  load_model_file(*trained_.model(), ck.files.at("model.pt"), ck.path + "/model.pt");
  // This rank's part of the state, whatever number of ranks and dist.shard saved it (optimizer_shards.h).
  const ParamShards* shards = ranks_.shards();
  std::map<std::string, torch::Tensor> opt_state = optimizer_state_for(
      trained_.optimizer(), shards ? &shards->layout() : nullptr, ranks_.env().rank, ck.files, ck.path);
  for (auto& [k, v] : opt_state) v = v.to(trained_.device());
  const std::string converted = trained_.optimizer().load_state(opt_state);
  if (!converted.empty())
    spdlog::warn("resume: {} holds the optimizer's moments in another dtype than optim.state_dtype: converted "
                 "them, {} (the next steps differ from a run that kept one dtype)", ck.path, converted);
  // Each rank's generators: "cpu"/"cuda" are rank 0's, "cpu.rank<r>"/"cuda.rank<r>" the others'. A rank
  // the checkpoint has no state for (the job grew) keeps the stream it was seeded with.
  const int64_t rank = ranks_.env().rank;
  const std::string suffix = rank == 0 ? "" : ".rank" + std::to_string(rank);
  for (auto& [k, v] : tensors_from_bytes(ck.files.at("rng.pt"))) {
    if (k == "cpu" + suffix) set_generator_state(at::detail::getDefaultCPUGenerator(), v);
    else if (k == "cuda" + suffix && trained_.device().is_cuda())
      set_generator_state(at::globalContext().defaultGenerator(trained_.device()), v);
  }
}

void TrainingRun::restore_ema(const LoadedCheckpoint& ck) {
  const bool saved = ck.files.count("ema.pt") > 0;
  ModelEma* ema = trained_.ema();
  if (ema && saved) {
    const LiftedCap lifted(memory_.backend());
    ema->load(tensors_from_bytes(ck.files.at("ema.pt"), ck.path + "/ema.pt"), ck.path + "/ema.pt");
  } else if (ema) {
    ema->set(*trained_.model());
    spdlog::info("resume: {} has no averaged weights (ema.pt); the average (train.ema_decay) starts from its "
                 "weights at step {}", ck.path, ck.step);
  } else if (saved) {
    spdlog::info("resume: train.ema_decay is 0: the averaged weights of {} (ema.pt) are not kept", ck.path);
  }
}

void TrainingRun::restore_loop(const nlohmann::json& st) {
  progress_.restore(st);
  trained_.scaler().load_state(st.at("scaler").get<GradScalerState>());
  // The learned micro-batch survives a restart, unless the user changed train.micro_batch on purpose.
  // With another number of ranks the per-rank batch differs: the learned size is kept where it still
  // fits in the new slice, and the ladder's other state starts afresh.
  if (st.value("micro_batch_config", int64_t{0}) != cfg_.train.micro_batch) return;
  auto learned = MicroBatchController::from_json(st.at("controller"));
  if (st.value("world_size", int64_t{1}) == ranks_.env().world_size) {
    step_runner_->set_controller(learned);
  } else {
    MicroBatchOptions co = micro_batch_options(cfg_, rank_batch());
    co.micro_batch = std::min(learned.micro_batch(), rank_batch());
    step_runner_->set_controller(MicroBatchController(co));
    spdlog::info("resume: the checkpoint was written by {} processes, this job has {}: micro-batch {} per rank",
                 st.value("world_size", int64_t{1}), ranks_.env().world_size, co.micro_batch);
  }
  step_runner_->on_limit_changed(memory_.agreed_limit(), progress_.step());
  eval_micro_batch_ = st.value("eval_micro_batch", cfg_.train.eval_batch);
}

bool TrainingRun::resume() {
  const std::optional<LoadedCheckpoint> ck = find_checkpoint();
  if (!ck) return false;
  check_same_experiment(*ck);
  restore_tensors(*ck);
  restore_ema(*ck);
  restore_loop(nlohmann::json::parse(ck->files.at("state.json")));
  if (ranks_.dist()) {
    // Every rank must have read the same checkpoint (the run folder is shared storage).
    const auto step = static_cast<double>(progress_.step());
    auto a = ranks_.dist()->all_max({step, -step}, "the resume agreement");
    if (a[0] != -a[1])
      throw std::runtime_error("resume: the ranks found different checkpoints (steps " + std::to_string(-a[1]) + " to " +
                               std::to_string(a[0]) + "); every rank must see the same run folder (shared storage)");
  }
  input_.source().seek(progress_.epoch(), progress_.position());
  saver_->resumed_from(ck->path, progress_.step());  // what an exit 4 names until this run saves its own
  const auto& ladder = step_runner_->controller();
  spdlog::info("resumed from {}: step {}, epoch {}, position {} (micro-batch {} x {})", ck->path, progress_.step(),
               progress_.epoch(), progress_.position(), ladder.micro_batch(), ladder.accum_steps());
  if (trackers_.tracker()) trackers_.backfill_tracker(progress_.step(), ranks_.rank_dir());
  trackers_.metrics().event("resume", {{"step", progress_.step()}, {"path", ck->path}, {"epoch", progress_.epoch()},
                                       {"position", progress_.position()}, {"micro_batch", ladder.micro_batch()},
                                       {"checkpoint_created_unix", ck->manifest.value("created_unix", int64_t{0})}});
  return true;
}

}  // namespace trainer
