#pragma once
// A multilayer perceptron with forward and backward written out in plain C++ (float32), the
// model of examples/train_mlp, also used by the DDP tests as their single-process reference.
//
// Layers: sizes[0] -> sizes[1] -> ... -> sizes.back(), a Linear layer (y = W x + b, W stored
// out x in, row-major) between each pair, ReLU after every layer but the last. Loss: mean squared
// error over every output element of the batch (PyTorch's nn.MSELoss()).
//
// Parameters are registered as W0, b0, W1, b1, ...; backward produces their gradients in reverse
// order (b_last, W_last, ..., b0, W0) and calls `ready(i)` as soon as parameter i's gradient is
// complete, which is when a DDP reducer may start communicating it.
//
// Synthetic regression data: sample `index` has inputs x_j = sin(0.37 * index + 1.3 * j) and
// targets t_o = sin(sum_j c_j x_j + 0.7 o) (c_j alternating -0.25, 0.5), so any process computes
// any sample without a data file.
//
// Not thread-safe; one instance per training loop.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace trun::examples {

class Mlp {
 public:
  explicit Mlp(std::vector<int> sizes);

  // Deterministic initialization (uniform in +-1/sqrt(fan_in), as PyTorch's Linear) from `seed`.
  void init(uint64_t seed);

  size_t num_params() const { return params_.size(); }  // tensors: 2 per layer
  size_t total_elements() const;
  std::string param_name(size_t i) const;
  float* param(size_t i) { return params_[i].data(); }
  const float* param(size_t i) const { return params_[i].data(); }
  size_t param_numel(size_t i) const { return params_[i].size(); }
  std::vector<int64_t> param_shape(size_t i) const;
  const std::vector<int>& sizes() const { return sizes_; }

  // Forward on `batch` samples (x: batch x sizes[0]), keeping activations for backward; returns
  // the MSE loss against `target` (batch x sizes.back()).
  float forward(const float* x, const float* target, size_t batch);
  // Backward of the last forward, scaled by `scale` (e.g. 1 / accumulation steps): adds
  // d(scale * loss)/d(param i) into grads[i], calling ready(i) after each parameter.
  void backward(const std::vector<float*>& grads, const std::function<void(size_t)>& ready,
                float scale = 1.0f);

  // Fills x and target for the given dataset indices.
  void make_batch(const std::vector<uint64_t>& indices, std::vector<float>& x,
                  std::vector<float>& target) const;

 private:
  std::vector<int> sizes_;
  std::vector<std::vector<float>> params_;
  // Activations: acts_[0] = input, acts_[l+1] = output of layer l (after ReLU except the last).
  std::vector<std::vector<float>> acts_;
  std::vector<float> target_;
  size_t batch_ = 0;
};

// SGD with momentum (PyTorch's torch.optim.SGD semantics: buf = momentum * buf + grad,
// param -= lr * buf; plain SGD when momentum is 0).
class Sgd {
 public:
  Sgd(float lr, float momentum) : lr_(lr), momentum_(momentum) {}
  void step(Mlp& model, const std::vector<const float*>& grads);
  std::vector<std::vector<float>>& momentum_buffers() { return bufs_; }
  void ensure_buffers(const Mlp& model);

 private:
  float lr_, momentum_;
  std::vector<std::vector<float>> bufs_;
};

// Parses "10,10,5" into layer sizes; std::invalid_argument with a clear message otherwise.
std::vector<int> parse_sizes(const std::string& text);

}  // namespace trun::examples
