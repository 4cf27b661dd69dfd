// The optimizer's slices in checkpoints (optimizer_shards.h).
#include "trainer/run/optimizer_shards.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "trainer/checkpoint/state_dict.h"
#include "trainer/numerics/quant8.h"

namespace trainer {

namespace {

// A part of a parameter's values: [begin, end) of the flattened parameter of `numel` values.
struct Range {
  int64_t begin = 0, end = 0, numel = 0;
};

// What one saved file holds: its entries by name, and the ranges of the parameters it has values of.
struct SavedSlice {
  std::string name;
  std::map<std::string, torch::Tensor> entries;
  std::map<std::string, Range> ranges;
  /// A whole-tensor optimizer.pt: its entries have their parameters' shapes (else flat pieces).
  std::map<std::string, torch::Tensor> whole;  // parameter name -> the parameter (for its layout)
};

// The prefixes of the state's entries (Optimizer::state()); the int8 scales go with their codes.
const std::vector<std::string>& value_prefixes() {
  static const std::vector<std::string> p{"momentum_buffer.", "exp_avg.", "exp_avg_sq."};
  return p;
}

// This rank's ranges, one per opt.updated() slot.
std::vector<Range> target_ranges(const Optimizer& opt, const ShardLayout* layout, int64_t rank) {
  std::vector<Range> out;
  if (!layout) {
    for (const auto& s : opt.updated()) out.push_back({0, s.param.numel(), s.param.numel()});
    return out;
  }
  for (const ShardPiece& p : layout->pieces(rank))
    out.push_back({p.begin, p.end, opt.params()[p.param].param.numel()});
  return out;
}

// A whole-tensor optimizer.pt (dist.shard none, or one process): one slice covering every parameter.
SavedSlice whole_slice(const NamedTensors& saved, const Optimizer& opt, const std::string& name) {
  SavedSlice s{name, {}, {}, {}};
  for (const auto& [k, v] : saved) s.entries[k] = v;
  for (const auto& p : opt.params()) {
    s.ranges[p.name] = {0, p.param.numel(), p.param.numel()};
    s.whole[p.name] = p.param;
  }
  return s;
}

SavedSlice read_slice(const CheckpointFiles& files, const std::string& dir, int64_t r, int64_t n, int64_t step) {
  const std::string file = optimizer_slice_file(r, n), where = dir + "/" + file;
  const auto it = files.find(file);
  if (it == files.end())
    throw std::runtime_error(where + " is missing: the checkpoint's optimizer.pt says its state is in " +
                             std::to_string(n) + " slices");
  SavedSlice s{where, {}, {}, {}};
  for (auto& [k, v] : tensors_from_bytes(it->second, where)) {
    if (k.rfind("range.", 0) == 0) {
      if (v.numel() != 3 || v.scalar_type() != torch::kLong) throw std::runtime_error(where + ": entry " + k + " is not 3 integers");
      s.ranges[k.substr(6)] = {v[0].item<int64_t>(), v[1].item<int64_t>(), v[2].item<int64_t>()};
    } else {
      s.entries[k] = v;
    }
  }
  const auto slice = s.entries.find("slice"), st = s.entries.find("step");
  if (slice == s.entries.end() || st == s.entries.end() || slice->second.numel() != 2)
    throw std::runtime_error(where + " is not an optimizer slice (no 'slice' or 'step' entry)");
  if (slice->second[0].item<int64_t>() != r || slice->second[1].item<int64_t>() != n || st->second.item<int64_t>() != step)
    throw std::runtime_error(where + " belongs to another checkpoint (slice " + std::to_string(slice->second[0].item<int64_t>()) +
                             " of " + std::to_string(slice->second[1].item<int64_t>()) + " at step " +
                             std::to_string(st->second.item<int64_t>()) + ", expected " + std::to_string(r) + " of " +
                             std::to_string(n) + " at step " + std::to_string(step) + ")");
  return s;
}

// The values of entry prefix + param of a saved slice, flat in the parameter's memory order (shard.h's
// order): int8 codes decoded with their scales; a whole tensor laid out as its parameter first.
torch::Tensor values_of(const SavedSlice& s, const std::string& prefix, const std::string& param) {
  torch::Tensor t = s.entries.at(prefix + param);
  if (t.scalar_type() == torch::kByte) {
    const std::string scale = prefix.substr(0, prefix.size() - 1) + "_absmax." + param;
    const auto it = s.entries.find(scale);
    if (it == s.entries.end()) throw std::runtime_error(s.name + ": int8 entry " + prefix + param + " has no scales (" + scale + ")");
    t = quant8::dequantize(t, it->second, prefix == "exp_avg.");
  }
  const auto whole = s.whole.find(param);
  if (whole == s.whole.end()) return t.reshape({-1});
  const torch::Tensor& p = whole->second;
  return flat_values(torch::empty_strided(p.sizes(), p.strides(), t.options()).copy_(t.reshape(p.sizes())));
}

// Entry `prefix` of the piece `name` over `want`, from every saved slice overlapping it.
torch::Tensor assemble(const std::vector<SavedSlice>& saved, const std::string& prefix, const std::string& name,
                       const Range& want) {
  torch::Tensor out;
  int64_t covered = 0;
  for (const SavedSlice& s : saved) {
    const auto r = s.ranges.find(name);
    if (r == s.ranges.end() || s.entries.count(prefix + name) == 0) continue;
    const int64_t from = std::max(want.begin, r->second.begin), to = std::min(want.end, r->second.end);
    if (from >= to) continue;
    const torch::Tensor v = values_of(s, prefix, name);
    if (v.numel() != r->second.end - r->second.begin)
      throw std::runtime_error(s.name + ": entry " + prefix + name + " holds " + std::to_string(v.numel()) +
                               " values for a range of " + std::to_string(r->second.end - r->second.begin));
    if (!out.defined()) out = torch::zeros({want.end - want.begin}, v.options());
    out.narrow(0, from - want.begin, to - from).copy_(v.narrow(0, from - r->second.begin, to - from));
    covered += to - from;
  }
  if (out.defined() && covered != want.end - want.begin)
    throw std::runtime_error("optimizer state: the saved slices hold " + std::to_string(covered) + " of the " +
                             std::to_string(want.end - want.begin) + " values of " + prefix + name + " this rank needs");
  return out;
}

}  // namespace

std::string optimizer_slice_file(int64_t rank, int64_t n) {
  return "optimizer.slice-" + std::to_string(rank) + "-of-" + std::to_string(n) + ".pt";
}

std::string optimizer_slice_bytes(const Optimizer& opt, const ShardLayout& layout, int64_t rank) {
  NamedTensors mine = opt.state();
  for (const ShardPiece& p : layout.pieces(rank))
    mine.emplace_back("range." + opt.params()[p.param].name,
                      torch::tensor({p.begin, p.end, opt.params()[p.param].param.numel()}, torch::kLong));
  mine.emplace_back("slice", torch::tensor({rank, layout.world()}, torch::kLong));
  return tensors_to_bytes(mine);
}

std::string optimizer_head_bytes(int64_t steps, int64_t slices) {
  return tensors_to_bytes({{"step", torch::tensor(steps, torch::kLong)}, {"slices", torch::tensor(slices, torch::kLong)}});
}

CheckpointFiles sharded_optimizer_files(const Optimizer& opt, const ShardLayout& layout, Distributed& dist) {
  // This rank's file, serialized here; rank 0 receives every rank's bytes (Distributed::gather_bytes).
  const std::string bytes = optimizer_slice_bytes(opt, layout, dist.rank());
  std::vector<std::string> all = dist.gather_bytes(bytes, "the optimizer slices for a checkpoint");
  CheckpointFiles files;
  if (dist.rank() != 0) return files;
  files["optimizer.pt"] = optimizer_head_bytes(opt.steps(), dist.world_size());
  for (int64_t r = 0; r < dist.world_size(); ++r) files[optimizer_slice_file(r, dist.world_size())] = std::move(all[r]);
  return files;
}

std::map<std::string, torch::Tensor> optimizer_state_for(const Optimizer& opt, const ShardLayout* layout, int64_t rank,
                                                         const CheckpointFiles& files, const std::string& ck_path) {
  const NamedTensors head = tensors_from_bytes(files.at("optimizer.pt"), ck_path + "/optimizer.pt");
  std::map<std::string, torch::Tensor> out;
  int64_t slices = 0;
  for (const auto& [k, v] : head) {
    if (k == "step") out["step"] = v;
    if (k == "slices") slices = v.item<int64_t>();
  }
  if (out.count("step") == 0) throw std::runtime_error(ck_path + "/optimizer.pt: missing entry 'step'");
  std::vector<SavedSlice> saved;
  if (slices == 0) saved.push_back(whole_slice(head, opt, ck_path + "/optimizer.pt"));
  for (int64_t r = 0; r < slices; ++r) saved.push_back(read_slice(files, ck_path, r, slices, out["step"].item<int64_t>()));
  const std::vector<Range> want = target_ranges(opt, layout, rank);
  for (size_t i = 0; i < want.size(); ++i) {
    const ParamSlot& slot = opt.updated()[i];
    // A saved slice of exactly these values: its entries as they are (int8 codes and scales included).
    // (A whole tensor into a whole tensor, or a flat piece into the same flat piece: the layouts agree.)
    const SavedSlice* same = nullptr;
    for (const SavedSlice& s : saved) {
      const auto r = s.ranges.find(slot.name);
      const bool whole = s.whole.count(slot.name) > 0;
      if (r != s.ranges.end() && r->second.begin == want[i].begin && r->second.end == want[i].end &&
          whole == (layout == nullptr))
        same = &s;
    }
    for (const std::string& prefix : value_prefixes()) {
      if (same) {
        for (const std::string& k : {prefix + slot.name, prefix.substr(0, prefix.size() - 1) + "_absmax." + slot.name}) {
          const auto it = same->entries.find(k);
          if (it != same->entries.end()) out[k] = it->second;
        }
        continue;
      }
      torch::Tensor v = assemble(saved, prefix, slot.name, want[i]);
      if (v.defined()) out[prefix + slot.name] = shaped_like(v, slot.param);  // a piece: flat as it is
    }
  }
  return out;
}

}  // namespace trainer
