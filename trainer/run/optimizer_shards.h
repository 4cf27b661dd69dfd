// The optimizer's state in a checkpoint when the ranks shard it (dist.shard: trainer/dist/shard.h), and
// the state a rank loads from any checkpoint, whatever number of ranks and whatever dist.shard wrote it.
//
//   optimizer.pt                 "step", and with slices "slices": how many files follow
//   optimizer.slice-<r>-of-<N>.pt   rank r's state: its pieces' entries ("exp_avg.<param>", flat, the
//                                values [begin, end) of the flattened parameter), "range.<param>" = [begin,
//                                end, numel] for each, "step", and "slice" = [r, N]
//
// Rank 0 gathers the slices and writes them in the one checkpoint the store commits atomically (one
// manifest, one CRC per file): a checkpoint never holds the slices of a save some rank did not finish.
// A rank loading state assembles each of its pieces from the saved slices that overlap it; where a saved
// slice covers exactly the same values its entries are taken as they are (bit for bit, int8 codes and
// scales included), otherwise int8 codes are decoded to float32 first and Optimizer::load_state encodes
// them again (the warning says so).
#pragma once

#include <torch/torch.h>

#include <map>
#include <string>

#include "trainer/checkpoint/store.h"
#include "trainer/dist/dist.h"
#include "trainer/dist/shard.h"
#include "trainer/numerics/optim.h"

namespace trainer {

/// The slice file of rank r of n.
std::string optimizer_slice_file(int64_t rank, int64_t n);

/// Rank `rank`'s slice file: opt.state() (its pieces, laid out by `layout`) with their ranges.
std::string optimizer_slice_bytes(const Optimizer& opt, const ShardLayout& layout, int64_t rank);
/// optimizer.pt of a sharded checkpoint: the step count and the number of slice files.
std::string optimizer_head_bytes(int64_t steps, int64_t slices);

/// The optimizer's files for a checkpoint of a sharded run: every rank calls it (the gather is a
/// collective); rank 0 gets optimizer.pt and every slice file, the others nothing.
CheckpointFiles sharded_optimizer_files(const Optimizer& opt, const ShardLayout& layout, Distributed& dist);

/// The entries Optimizer::load_state needs for opt.updated() (this rank's pieces, or the whole
/// parameters) from a checkpoint's files. Throws std::runtime_error naming a slice file that is missing,
/// unreadable, of another step or another number of slices, or that lacks a piece's values.
std::map<std::string, torch::Tensor> optimizer_state_for(const Optimizer& opt, const ShardLayout* layout, int64_t rank,
                                                         const CheckpointFiles& files, const std::string& ck_path);

}  // namespace trainer
