#pragma once
// Checkpoint contents that are a function of the step, so a test can tell whether a loaded
// checkpoint is complete and belongs to the step it claims: a 1 MiB float32 "weight", a small
// int64 "optimizer" tensor, a sampler state and metadata, all derived from the step.

#include <cstdint>
#include <string>
#include <vector>

#include <trun/checkpoint.h>

namespace trun::test {

constexpr size_t kWeightNumel = 256 * 1024;

struct ContentBuffers {
  std::vector<float> weight = std::vector<float>(kWeightNumel);
  std::vector<int64_t> opt = std::vector<int64_t>(17);
};

inline float weight_at(uint64_t step, size_t i) {
  return static_cast<float>((step * 131 + i * 7) % 100003) * 0.5f;
}

inline worker::SaveRequest make_request(uint64_t step, ContentBuffers& b) {
  for (size_t i = 0; i < b.weight.size(); ++i) b.weight[i] = weight_at(step, i);
  for (size_t i = 0; i < b.opt.size(); ++i) b.opt[i] = static_cast<int64_t>(step * 1000 + i);
  worker::SaveRequest r;
  r.step = step;
  r.model.push_back({"weight", worker::DataType::kFloat32, {512, 512}, b.weight.data()});
  r.optimizer.push_back({"opt", worker::DataType::kInt64, {17}, b.opt.data()});
  worker::SamplerState s;
  s.epoch = step / 10;
  s.offset = step % 10;
  s.dataset_size = 1000;
  r.sampler = s;
  r.metadata = "{\"step\": " + std::to_string(step) + "}";
  return r;
}

// True when `c` holds exactly what make_request(c.step) saved.
inline bool check_content(const worker::Checkpoint& c, std::string* why) {
  const uint64_t step = c.step;
  const auto* w = c.find("model", "weight");
  const auto* o = c.find("optimizer", "opt");
  if (!w || !o) return *why = "missing tensor", false;
  if (w->bytes.size() != kWeightNumel * 4 || o->bytes.size() != 17 * 8)
    return *why = "wrong tensor sizes", false;
  const auto* wf = reinterpret_cast<const float*>(w->bytes.data());
  for (size_t i = 0; i < kWeightNumel; ++i)
    if (wf[i] != weight_at(step, i)) return *why = "weight[" + std::to_string(i) + "]", false;
  const auto* oi = reinterpret_cast<const int64_t*>(o->bytes.data());
  for (size_t i = 0; i < 17; ++i)
    if (oi[i] != static_cast<int64_t>(step * 1000 + i)) return *why = "opt", false;
  if (!c.sampler || c.sampler->epoch != step / 10 || c.sampler->offset != step % 10)
    return *why = "sampler", false;
  if (c.metadata != "{\"step\":" + std::to_string(step) + "}")
    return *why = "metadata " + c.metadata, false;
  return true;
}

}  // namespace trun::test
