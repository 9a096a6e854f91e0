#pragma once
// DistributedSampler: which dataset indices each rank reads, epoch by epoch, in a way that
// survives a restart with a different world size.
//
// Model. Each epoch has one global order of the dataset indices: a permutation that depends only
// on (seed, epoch) (identity when shuffle is off), never on the world size. Training consumes
// that order from the front: a step of `batch_size` samples per rank over `world_size` ranks
// consumes the next batch_size * world_size positions, rank r taking positions
// offset + r, offset + r + world_size, ... (interleaved, as PyTorch's DistributedSampler does).
// The state is therefore one number besides the epoch: `offset`, the count of global positions
// already consumed in the epoch. A checkpoint stores it; a run that resumes with another world
// size shards the remaining positions among its own ranks, so that within an epoch no sample is
// seen twice and none is skipped.
//
// Tail. When the remaining positions do not divide evenly among the ranks, kPad repeats
// positions from the front of the epoch's order (every rank gets the same number of samples; a
// few samples are seen twice, at the very end) and kDrop leaves the last few out (fewer than
// world_size samples are skipped). The tail is decided from the remaining positions, so it is
// the same whichever world size consumed the earlier part of the epoch.
//
// Determinism: the permutation uses trun's own generator (SplitMix64 + Fisher-Yates), so it is
// the same on every platform and standard library.
//
// Thread safety: none; a sampler is owned by one training loop. Errors: std::invalid_argument
// for bad arguments or a state that does not fit the dataset.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <trun/export.h>

namespace trun::worker {

enum class TailPolicy { kPad, kDrop };

struct SamplerOptions {
  bool shuffle = true;
  uint64_t seed = 0;
  TailPolicy tail = TailPolicy::kPad;
};

// What a checkpoint keeps of a sampler. `offset` counts global positions consumed in `epoch`.
struct SamplerState {
  uint64_t epoch = 0;
  uint64_t offset = 0;
  uint64_t dataset_size = 0;
  uint64_t seed = 0;
  bool shuffle = true;
  TailPolicy tail = TailPolicy::kPad;
};

class TRUN_API DistributedSampler {
 public:
  // dataset_size >= 1, 0 <= rank < world_size.
  DistributedSampler(uint64_t dataset_size, int rank, int world_size, SamplerOptions options = {});

  // Starts `epoch` from its beginning.
  void set_epoch(uint64_t epoch);
  // Continues from a saved state; the world size may differ from the one that saved it. The
  // dataset size, seed, shuffle and tail policy must match this sampler's.
  void load_state(const SamplerState& state);
  SamplerState state() const;

  uint64_t epoch() const { return epoch_; }
  uint64_t offset() const { return offset_; }
  // Global positions this epoch will consume in total (the tail policy applied).
  uint64_t epoch_length() const;
  // True when the epoch has no samples left for any rank.
  bool epoch_done() const { return offset_ >= epoch_length(); }

  // This rank's next batch: up to `batch_size` indices (fewer at the end of the epoch, the same
  // number on every rank; empty when the epoch is done). Advances the global offset by the
  // number of positions all ranks consumed together.
  std::vector<uint64_t> next_batch(size_t batch_size);
  // The indices this rank would read for the rest of the epoch, without consuming them.
  std::vector<uint64_t> remaining_indices() const;

  // The dataset index at global position `pos` of `epoch` (pos may exceed the dataset size only
  // for padding, and then wraps around).
  uint64_t index_at(uint64_t pos) const;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

 private:
  void build_order();

  uint64_t dataset_size_;
  int rank_;
  int world_size_;
  SamplerOptions options_;
  uint64_t epoch_ = 0;
  uint64_t offset_ = 0;
  std::vector<uint64_t> order_;  // permutation of the current epoch (empty: identity)
};

// Serialized form used by checkpoints: a JSON object
// {"epoch":..,"offset":..,"dataset_size":..,"seed":..,"shuffle":..,"tail":"pad"|"drop"}.
TRUN_API std::string sampler_state_to_json(const SamplerState& state);
// std::invalid_argument naming the field when malformed.
TRUN_API SamplerState sampler_state_from_json(const std::string& json);

}  // namespace trun::worker
