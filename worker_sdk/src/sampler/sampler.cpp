#include "trun/sampler.h"

#include <nlohmann/json.hpp>

#include <stdexcept>

#include "base/splitmix64.h"

namespace trun::worker {

namespace {

const char* tail_name(TailPolicy t) { return t == TailPolicy::kPad ? "pad" : "drop"; }

}  // namespace

DistributedSampler::DistributedSampler(uint64_t dataset_size, int rank, int world_size,
                                       SamplerOptions options)
    : dataset_size_(dataset_size), rank_(rank), world_size_(world_size), options_(options) {
  if (dataset_size == 0) throw std::invalid_argument("DistributedSampler: dataset_size is 0");
  if (world_size < 1)
    throw std::invalid_argument("DistributedSampler: world_size must be >= 1, got " +
                                std::to_string(world_size));
  if (rank < 0 || rank >= world_size)
    throw std::invalid_argument("DistributedSampler: rank " + std::to_string(rank) +
                                " is outside [0, " + std::to_string(world_size) + ")");
  build_order();
}

void DistributedSampler::build_order() {
  order_.clear();
  if (!options_.shuffle) return;
  order_.resize(dataset_size_);
  for (uint64_t i = 0; i < dataset_size_; ++i) order_[i] = i;
  // The stream depends on (seed, epoch) only.
  base::SplitMix64 rng{options_.seed ^ (0xD1B54A32D192ED03ull * (epoch_ + 1))};
  for (uint64_t i = dataset_size_ - 1; i > 0; --i) std::swap(order_[i], order_[rng.below(i + 1)]);
}

void DistributedSampler::set_epoch(uint64_t epoch) {
  epoch_ = epoch;
  offset_ = 0;
  build_order();
}

void DistributedSampler::load_state(const SamplerState& s) {
  auto mismatch = [](const char* what, const std::string& saved, const std::string& now) {
    return std::invalid_argument("DistributedSampler::load_state: the saved " + std::string(what) +
                                 " (" + saved + ") differs from this sampler's (" + now + ")");
  };
  if (s.dataset_size != dataset_size_)
    throw mismatch("dataset_size", std::to_string(s.dataset_size), std::to_string(dataset_size_));
  if (s.seed != options_.seed)
    throw mismatch("seed", std::to_string(s.seed), std::to_string(options_.seed));
  if (s.shuffle != options_.shuffle)
    throw mismatch("shuffle", s.shuffle ? "true" : "false", options_.shuffle ? "true" : "false");
  if (s.tail != options_.tail)
    throw mismatch("tail policy", tail_name(s.tail), tail_name(options_.tail));
  // Padding can carry the offset past the dataset size by less than one step of the old world;
  // anything further is not a state this sampler wrote.
  if (s.offset > 2 * dataset_size_ + 1)
    throw std::invalid_argument("DistributedSampler::load_state: offset " +
                                std::to_string(s.offset) + " is impossible for a dataset of " +
                                std::to_string(dataset_size_));
  set_epoch(s.epoch);
  offset_ = s.offset;
}

SamplerState DistributedSampler::state() const {
  SamplerState s;
  s.epoch = epoch_;
  s.offset = offset_;
  s.dataset_size = dataset_size_;
  s.seed = options_.seed;
  s.shuffle = options_.shuffle;
  s.tail = options_.tail;
  return s;
}

uint64_t DistributedSampler::epoch_length() const {
  if (offset_ >= dataset_size_) return offset_;  // the tail was consumed already
  const uint64_t w = static_cast<uint64_t>(world_size_);
  const uint64_t rest = dataset_size_ - offset_;
  const uint64_t even = options_.tail == TailPolicy::kPad ? (rest + w - 1) / w * w : rest / w * w;
  return offset_ + even;
}

uint64_t DistributedSampler::index_at(uint64_t pos) const {
  const uint64_t p = pos % dataset_size_;
  return order_.empty() ? p : order_[p];
}

std::vector<uint64_t> DistributedSampler::next_batch(size_t batch_size) {
  if (batch_size == 0) throw std::invalid_argument("DistributedSampler::next_batch: batch_size 0");
  const uint64_t w = static_cast<uint64_t>(world_size_);
  const uint64_t len = epoch_length();
  const uint64_t per_rank =
      offset_ >= len ? 0 : std::min<uint64_t>(batch_size, (len - offset_) / w);
  std::vector<uint64_t> out;
  out.reserve(per_rank);
  for (uint64_t k = 0; k < per_rank; ++k) out.push_back(index_at(offset_ + k * w + rank_));
  offset_ += per_rank * w;
  return out;
}

std::vector<uint64_t> DistributedSampler::remaining_indices() const {
  const uint64_t w = static_cast<uint64_t>(world_size_);
  std::vector<uint64_t> out;
  for (uint64_t pos = offset_ + rank_; pos < epoch_length(); pos += w) out.push_back(index_at(pos));
  return out;
}

std::string sampler_state_to_json(const SamplerState& s) {
  nlohmann::json j = {{"epoch", s.epoch}, {"offset", s.offset},   {"dataset_size", s.dataset_size},
                      {"seed", s.seed},   {"shuffle", s.shuffle}, {"tail", tail_name(s.tail)}};
  return j.dump();
}

SamplerState sampler_state_from_json(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(std::string("sampler state: not JSON: ") + e.what());
  }
  if (!j.is_object()) throw std::invalid_argument("sampler state: expected a JSON object");
  auto u64 = [&](const char* key) -> uint64_t {
    if (!j.contains(key) || !j[key].is_number_unsigned())
      throw std::invalid_argument(std::string("sampler state: field '") + key +
                                  "' missing or not an unsigned integer");
    return j[key].get<uint64_t>();
  };
  SamplerState s;
  s.epoch = u64("epoch");
  s.offset = u64("offset");
  s.dataset_size = u64("dataset_size");
  s.seed = u64("seed");
  if (!j.contains("shuffle") || !j["shuffle"].is_boolean())
    throw std::invalid_argument("sampler state: field 'shuffle' missing or not a boolean");
  s.shuffle = j["shuffle"].get<bool>();
  const std::string tail =
      j.contains("tail") && j["tail"].is_string() ? j["tail"].get<std::string>() : "";
  if (tail == "pad")
    s.tail = TailPolicy::kPad;
  else if (tail == "drop")
    s.tail = TailPolicy::kDrop;
  else
    throw std::invalid_argument("sampler state: field 'tail' must be \"pad\" or \"drop\", got '" +
                                tail + "'");
  return s;
}

}  // namespace trun::worker
