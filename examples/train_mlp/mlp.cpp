#include "examples/train_mlp/mlp.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

namespace trun::examples {

namespace {

// SplitMix64, as base/splitmix64.h: an example includes only the SDK's public headers (<trun/...>,
// scripts/check-layering.sh), so it carries its own copy of the generator. The same constants:
// the weights, and so the tests' expected losses, stay the same.
uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

float uniform(uint64_t& s) {  // [-1, 1)
  return static_cast<float>(static_cast<double>(splitmix(s) >> 11) * 0x1.0p-52 - 1.0);
}

// Eight partial sums, so the compiler can vectorize without reassociating (-ffast-math); the
// summation order is fixed, so results are reproducible across runs and ranks.
float dot(const float* a, const float* b, size_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

Mlp::Mlp(std::vector<int> sizes) : sizes_(std::move(sizes)) {
  if (sizes_.size() < 2) throw std::invalid_argument("MLP: at least two layer sizes are needed");
  for (int s : sizes_)
    if (s < 1 || s > (1 << 20))
      throw std::invalid_argument("MLP: layer size " + std::to_string(s) + " out of [1, 2^20]");
  for (size_t l = 0; l + 1 < sizes_.size(); ++l) {
    params_.emplace_back(static_cast<size_t>(sizes_[l + 1]) * sizes_[l]);
    params_.emplace_back(static_cast<size_t>(sizes_[l + 1]));
  }
  acts_.resize(sizes_.size());
}

size_t Mlp::total_elements() const {
  size_t n = 0;
  for (const auto& p : params_) n += p.size();
  return n;
}

std::string Mlp::param_name(size_t i) const {
  return "layers." + std::to_string(i / 2) + (i % 2 == 0 ? ".weight" : ".bias");
}

std::vector<int64_t> Mlp::param_shape(size_t i) const {
  const size_t l = i / 2;
  if (i % 2 == 0) return {sizes_[l + 1], sizes_[l]};
  return {sizes_[l + 1]};
}

void Mlp::init(uint64_t seed) {
  uint64_t s = seed * 0x2545F4914F6CDD1Dull + 1;
  for (size_t i = 0; i < params_.size(); ++i) {
    const float bound = 1.0f / std::sqrt(static_cast<float>(sizes_[i / 2]));
    for (float& v : params_[i]) v = bound * uniform(s);
  }
}

float Mlp::forward(const float* x, const float* target, size_t batch) {
  batch_ = batch;
  acts_[0].assign(x, x + batch * sizes_[0]);
  const size_t layers = sizes_.size() - 1;
  for (size_t l = 0; l < layers; ++l) {
    const size_t in = sizes_[l], out = sizes_[l + 1];
    const float* w = params_[2 * l].data();
    const float* b = params_[2 * l + 1].data();
    auto& y = acts_[l + 1];
    y.assign(batch * out, 0.0f);
    for (size_t n = 0; n < batch; ++n) {
      const float* xn = acts_[l].data() + n * in;
      float* yn = y.data() + n * out;
      for (size_t o = 0; o < out; ++o) {
        yn[o] = dot(w + o * in, xn, in) + b[o];
        if (l + 1 < layers && yn[o] < 0.0f) yn[o] = 0.0f;
      }
    }
  }
  const size_t out = sizes_.back();
  target_.assign(target, target + batch * out);
  double loss = 0.0;
  for (size_t k = 0; k < batch * out; ++k) {
    const double d = static_cast<double>(acts_.back()[k]) - target_[k];
    loss += d * d;
  }
  return static_cast<float>(loss / static_cast<double>(batch * out));
}

void Mlp::backward(const std::vector<float*>& grads, const std::function<void(size_t)>& ready,
                   float scale) {
  if (grads.size() != params_.size()) throw std::invalid_argument("MLP: wrong number of grads");
  const size_t layers = sizes_.size() - 1;
  const size_t out_n = sizes_.back();
  // dL/dy for the output: 2 (y - t) / (batch * out).
  std::vector<float> delta(batch_ * out_n);
  const float k = 2.0f * scale / static_cast<float>(batch_ * out_n);
  for (size_t i = 0; i < delta.size(); ++i) delta[i] = k * (acts_.back()[i] - target_[i]);
  std::vector<float> prev;
  for (size_t l = layers; l-- > 0;) {
    const size_t in = sizes_[l], out = sizes_[l + 1];
    const float* x = acts_[l].data();
    float* gw = grads[2 * l];
    float* gb = grads[2 * l + 1];
    for (size_t n = 0; n < batch_; ++n)
      for (size_t o = 0; o < out; ++o) gb[o] += delta[n * out + o];
    if (ready) ready(2 * l + 1);
    for (size_t n = 0; n < batch_; ++n) {
      const float* xn = x + n * in;
      for (size_t o = 0; o < out; ++o) {
        const float d = delta[n * out + o];
        if (d == 0.0f) continue;
        float* g = gw + o * in;
        for (size_t i = 0; i < in; ++i) g[i] += d * xn[i];
      }
    }
    if (ready) ready(2 * l);
    if (l == 0) break;
    // delta for the previous layer: W^T delta, through the ReLU.
    const float* w = params_[2 * l].data();
    prev.assign(batch_ * in, 0.0f);
    for (size_t n = 0; n < batch_; ++n) {
      float* pn = prev.data() + n * in;
      for (size_t o = 0; o < out; ++o) {
        const float d = delta[n * out + o];
        if (d == 0.0f) continue;
        const float* wo = w + o * in;
        for (size_t i = 0; i < in; ++i) pn[i] += d * wo[i];
      }
      for (size_t i = 0; i < in; ++i)
        if (x[n * in + i] <= 0.0f) pn[i] = 0.0f;
    }
    delta.swap(prev);
  }
}

void Mlp::make_batch(const std::vector<uint64_t>& indices, std::vector<float>& x,
                     std::vector<float>& target) const {
  const size_t in = sizes_.front(), out = sizes_.back();
  x.resize(indices.size() * in);
  target.resize(indices.size() * out);
  for (size_t n = 0; n < indices.size(); ++n) {
    const double idx = static_cast<double>(indices[n]);
    double sum = 0.0;
    for (size_t j = 0; j < in; ++j) {
      const double v = std::sin(0.37 * idx + 1.3 * static_cast<double>(j));
      x[n * in + j] = static_cast<float>(v);
      sum += v * (j % 2 ? 0.5 : -0.25);
    }
    for (size_t o = 0; o < out; ++o)
      target[n * out + o] = static_cast<float>(std::sin(sum + 0.7 * static_cast<double>(o)));
  }
}

void Sgd::ensure_buffers(const Mlp& model) {
  if (bufs_.size() == model.num_params()) return;
  bufs_.clear();
  for (size_t i = 0; i < model.num_params(); ++i) bufs_.emplace_back(model.param_numel(i), 0.0f);
}

void Sgd::step(Mlp& model, const std::vector<const float*>& grads) {
  ensure_buffers(model);
  for (size_t i = 0; i < model.num_params(); ++i) {
    float* p = model.param(i);
    const float* g = grads[i];
    const size_t n = model.param_numel(i);
    if (momentum_ == 0.0f) {
      for (size_t k = 0; k < n; ++k) p[k] -= lr_ * g[k];
    } else {
      float* b = bufs_[i].data();
      for (size_t k = 0; k < n; ++k) {
        b[k] = momentum_ * b[k] + g[k];
        p[k] -= lr_ * b[k];
      }
    }
  }
}

std::vector<int> parse_sizes(const std::string& text) {
  std::vector<int> sizes;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    const std::string part = text.substr(pos, comma - pos);
    char* end = nullptr;
    const long v = std::strtol(part.c_str(), &end, 10);
    if (part.empty() || *end != '\0' || v < 1 || v > (1 << 20))
      throw std::invalid_argument(
          "bad layer sizes '" + text +
          "': expected positive integers separated by commas, e.g. 10,10,5");
    sizes.push_back(static_cast<int>(v));
    pos = comma + 1;
  }
  if (sizes.size() < 2)
    throw std::invalid_argument("bad layer sizes '" + text + "': at least two are needed");
  return sizes;
}

}  // namespace trun::examples
