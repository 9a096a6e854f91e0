// trun::libtorch: the DDP wrapper over trun's reducer and the checkpoint helpers (trun/torch.h).
// One translation unit: torch/torch.h costs ~40 s per file to compile.

#include "trun/torch.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>
#include <stdexcept>

namespace trun::libtorch {

using worker::DataType;
using worker::Device;

namespace {

DataType to_dtype(c10::ScalarType t, const std::string& what) {
  switch (t) {
    case c10::kFloat:
      return DataType::kFloat32;
    case c10::kDouble:
      return DataType::kFloat64;
    case c10::kHalf:
      return DataType::kFloat16;
    case c10::kBFloat16:
      return DataType::kBFloat16;
    case c10::kInt:
      return DataType::kInt32;
    case c10::kLong:
      return DataType::kInt64;
    default:
      throw std::invalid_argument("trun::libtorch: " + what + " has dtype " +
                                  std::string(c10::toString(t)) +
                                  ", which trun's collectives do not support (float32, float64, "
                                  "float16, bfloat16, int32, int64)");
  }
}

worker::Parameter describe(const std::string& name, const torch::Tensor& t,
                           const std::string& what) {
  if (!t.is_contiguous())
    throw std::invalid_argument("trun::libtorch: " + what + " '" + name + "' is not contiguous");
  if (!t.device().is_cpu() && !t.device().is_cuda())
    throw std::invalid_argument("trun::libtorch: " + what + " '" + name + "' is on " +
                                t.device().str() + " (only CPU and CUDA tensors)");
  worker::Parameter p;
  p.name = name;
  p.data = t.data_ptr();
  p.numel = static_cast<size_t>(t.numel());
  p.dtype = to_dtype(t.scalar_type(), what + " '" + name + "'");
  p.device = t.device().is_cuda() ? Device::kCuda : Device::kCpu;
  return p;
}

}  // namespace

// Shared with the autograd hooks, which may outlive the wrapper (they live in the parameters'
// grad accumulators): after the wrapper is gone, `alive` is false and they do nothing.
struct DistributedDataParallel::State {
  std::mutex mu;
  bool alive = true;
  bool callback_queued = false;
  DistributedDataParallel* owner = nullptr;
  // The grad accumulators (autograd holds them weakly from the parameters: keep them, and with
  // them the hooks, alive as PyTorch's reducer does).
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
};

DistributedDataParallel::DistributedDataParallel(worker::ProcessGroup& group,
                                                 std::shared_ptr<torch::nn::Module> module,
                                                 DdpOptions options)
    : module_(std::move(module)), options_(options), state_(std::make_shared<State>()) {
  if (!module_) throw std::invalid_argument("trun::libtorch: DistributedDataParallel: no module");
  std::vector<worker::Parameter> params, buffers;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    params_.push_back(item.value());
    names_.push_back(item.key());
    params.push_back(describe(item.key(), item.value(), "parameter"));
  }
  if (params_.empty())
    throw std::invalid_argument("trun::libtorch: the module has no parameter that requires grad");
  // Without broadcast_buffers, buffers are not registered at all (not broadcast on construction
  // either), so a model with buffers of other dtypes (bool, uint8) can still be wrapped.
  if (options.broadcast_buffers) {
    for (const auto& item : module_->named_buffers(/*recurse=*/true)) {
      if (!item.value().defined() || item.value().numel() == 0) continue;
      buffers_.push_back(item.value());
      buffers.push_back(describe(item.key(), item.value(),
                                 "buffer (set broadcast_buffers = false to "
                                 "wrap a module without broadcasting them)"));
    }
  }
  // The reducer's own check knows element counts only: check with the tensors' shapes here.
  if (options.check_parameters_across_ranks && group.size() > 1) {
    std::vector<std::vector<int64_t>> shapes;
    for (const auto& t : params_) shapes.emplace_back(t.sizes().begin(), t.sizes().end());
    worker::check_parameters_across_ranks(group, params, options.timeout, shapes);
  }
  worker::DdpOptions ro;
  ro.bucket_cap_mb = options.bucket_cap_mb;
  ro.first_bucket_cap_mb = options.first_bucket_cap_mb;
  ro.find_unused_parameters = options.find_unused_parameters;
  ro.check_parameters_across_ranks = false;  // done above
  ro.broadcast_on_construction = options.broadcast_parameters;
  ro.timeout = options.timeout;
  reducer_ = std::make_unique<worker::DistributedDataParallel>(group, std::move(params), ro,
                                                               std::move(buffers));
  state_->owner = this;

  views_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    views_[i] = torch::from_blob(reducer_->grad(i), p.sizes(),
                                 torch::TensorOptions().dtype(p.scalar_type()).device(p.device()));
    attach_grad(i, /*copy_existing=*/true);
    auto acc = torch::autograd::impl::grad_accumulator(p);
    if (!acc)
      throw std::invalid_argument("trun::libtorch: parameter '" + names_[i] +
                                  "' has no grad accumulator (is it a leaf that requires grad?)");
    std::weak_ptr<State> weak = state_;
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [weak, i](const torch::autograd::variable_list& outputs,
                  const torch::autograd::variable_list& /*inputs*/) {
          auto st = weak.lock();
          if (!st) return outputs;
          DistributedDataParallel* self = nullptr;
          {
            std::lock_guard<std::mutex> lock(st->mu);
            if (!st->alive) return outputs;
            self = st->owner;
            if (!st->callback_queued) {
              st->callback_queued = true;
              // Runs when this backward ends, on the engine: wait for every bucket.
              torch::autograd::Engine::get_default_engine().queue_callback([weak] {
                auto s = weak.lock();
                if (!s) return;
                DistributedDataParallel* o = nullptr;
                {
                  std::lock_guard<std::mutex> l(s->mu);
                  s->callback_queued = false;
                  if (!s->alive) return;
                  o = s->owner;
                }
                o->reducer_->finalize();
              });
            }
          }
          self->attach_grad(i, /*copy_existing=*/true);
          self->reducer_->mark_ready(i);
          return outputs;
        }));
    state_->accumulators.push_back(std::move(acc));
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->alive = false;
  state_->owner = nullptr;
  state_->accumulators.clear();
}

// Makes params_[i].grad() the bucket view. copy_existing: a grad that is another tensor holds
// this iteration's gradient (accumulated by autograd outside the bucket): copy it in; an
// undefined grad means zero.
void DistributedDataParallel::attach_grad(size_t i, bool copy_existing) {
  auto& p = params_[i];
  auto& view = views_[i];
  torch::Tensor& g = p.mutable_grad();
  if (g.defined() && g.data_ptr() == view.data_ptr()) return;
  torch::NoGradGuard no_grad;
  if (g.defined() && copy_existing)
    view.copy_(g);
  else
    view.zero_();
  g = view;
}

void DistributedDataParallel::prepare_forward() {
  if (!buffers_.empty()) {
    for (size_t k = 0; k < buffers_.size(); ++k)
      if (!buffers_[k].defined())
        throw std::invalid_argument("trun::libtorch: a registered buffer became undefined");
    reducer_->broadcast_buffers();
  }
  for (size_t i = 0; i < params_.size(); ++i) attach_grad(i, /*copy_existing=*/true);
}

std::vector<std::string> DistributedDataParallel::unused_parameters() const {
  std::vector<std::string> out;
  for (size_t i : reducer_->unused_parameters()) out.push_back(names_[i]);
  return out;
}

// ---- checkpoints

namespace {

const char* kModelBlob = "libtorch.model";
const char* kOptimizerBlob = "libtorch.optimizer";

// Bytes as int64 words (the checkpoint's dtypes have no byte type), zero-padded.
struct Blob {
  std::vector<int64_t> words;
  int64_t bytes = 0;
};

Blob to_blob(const std::string& s) {
  Blob b;
  b.bytes = static_cast<int64_t>(s.size());
  b.words.assign((s.size() + 7) / 8, 0);
  if (!s.empty()) std::memcpy(b.words.data(), s.data(), s.size());
  return b;
}

std::string archive_of(torch::nn::Module& module) {
  torch::serialize::OutputArchive ar;
  module.save(ar);
  std::ostringstream os;
  ar.save_to(os);
  return os.str();
}

std::string archive_of(torch::optim::Optimizer& opt) {
  torch::serialize::OutputArchive ar;
  opt.save(ar);
  std::ostringstream os;
  ar.save_to(os);
  return os.str();
}

std::string read_blob(const worker::Checkpoint& c, const std::string& section,
                      const std::string& name) {
  const auto* t = c.find(section, name);
  const auto* n = c.find(section, name + ".bytes");
  if (!t || !n)
    throw worker::CheckpointError("trun::libtorch: checkpoint " + c.path + " has no " + section +
                                  " tensor '" + name +
                                  "' (it was not saved with trun::libtorch::save_checkpoint)");
  if (n->dtype != DataType::kInt64 || n->bytes.size() != 8 || t->dtype != DataType::kInt64)
    throw worker::CheckpointError("trun::libtorch: checkpoint " + c.path + ": '" + name +
                                  "' has an unexpected dtype or size");
  int64_t bytes = 0;
  std::memcpy(&bytes, n->bytes.data(), 8);
  if (bytes < 0 || static_cast<size_t>(bytes) > t->bytes.size())
    throw worker::CheckpointError("trun::libtorch: checkpoint " + c.path + ": '" + name +
                                  "' says " + std::to_string(bytes) + " bytes but holds " +
                                  std::to_string(t->bytes.size()));
  return std::string(reinterpret_cast<const char*>(t->bytes.data()), static_cast<size_t>(bytes));
}

}  // namespace

void save_checkpoint(worker::Checkpointer& checkpointer, uint64_t step, torch::nn::Module& module,
                     torch::optim::Optimizer* optimizer, const SaveOptions& options) {
  worker::SaveRequest req;
  req.step = step;
  req.sampler = options.sampler;
  req.metadata = options.metadata;
  const Blob model = to_blob(archive_of(module));
  Blob opt;
  if (optimizer) opt = to_blob(archive_of(*optimizer));
  auto add = [](std::vector<worker::TensorRef>& section, const std::string& name, const Blob& b) {
    section.push_back({name,
                       DataType::kInt64,
                       {static_cast<int64_t>(b.words.size())},
                       b.words.empty() ? static_cast<const void*>(&b.bytes) : b.words.data()});
    section.push_back({name + ".bytes", DataType::kInt64, {}, &b.bytes});
  };
  add(req.model, kModelBlob, model);
  if (optimizer) add(req.optimizer, kOptimizerBlob, opt);
  checkpointer.save(req);
}

void restore(const worker::Checkpoint& checkpoint, torch::nn::Module& module,
             torch::optim::Optimizer* optimizer) {
  // Module::load replaces each tensor's storage (Tensor::set_): keep aliases of the current
  // storage, load, copy the values back into it and point the tensors at it again, so views on
  // the parameters (a reducer's registered pointers) stay valid.
  std::vector<torch::Tensor> tensors, aliases;
  for (auto& p : module.parameters(true)) tensors.push_back(p);
  for (auto& b : module.buffers(true))
    if (b.defined()) tensors.push_back(b);
  for (auto& t : tensors) aliases.push_back(t.detach());
  {
    const std::string bytes = read_blob(checkpoint, "model", kModelBlob);
    std::istringstream is(bytes);
    torch::serialize::InputArchive ar;
    ar.load_from(is);
    module.load(ar);
  }
  {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < tensors.size(); ++k) {
      if (tensors[k].data_ptr() == aliases[k].data_ptr()) continue;
      if (tensors[k].sizes() != aliases[k].sizes() ||
          tensors[k].scalar_type() != aliases[k].scalar_type())
        throw worker::CheckpointError("trun::libtorch: checkpoint " + checkpoint.path +
                                      ": a tensor's shape or dtype differs from the module's");
      aliases[k].copy_(tensors[k]);
      tensors[k].set_(aliases[k]);
    }
  }
  if (optimizer) {
    const std::string bytes = read_blob(checkpoint, "optimizer", kOptimizerBlob);
    std::istringstream is(bytes);
    torch::serialize::InputArchive ar;
    ar.load_from(is);
    optimizer->load(ar);
  }
}

void add_to_resilient_state(worker::ResilientState& state, torch::nn::Module& module,
                            torch::optim::Optimizer* optimizer) {
  auto add = [&](const std::string& name, torch::Tensor& t) {
    if (!t.defined()) return;
    if (!t.device().is_cpu() || !t.is_contiguous())
      throw std::invalid_argument("trun::libtorch::add_to_resilient_state: tensor '" + name +
                                  "' must be a contiguous CPU tensor");
    state.add(name, t.data_ptr(), t.nbytes());
  };
  for (auto& p : module.named_parameters(true)) add(p.key(), p.value());
  for (auto& b : module.named_buffers(true)) add(b.key(), b.value());
  if (!optimizer) return;
  state.add_serialized(
      kOptimizerBlob, [optimizer] { return archive_of(*optimizer); },
      [optimizer](const std::string& bytes) {
        std::istringstream is(bytes);
        torch::serialize::InputArchive ar;
        ar.load_from(is);
        optimizer->load(ar);
      });
}

std::optional<Resumed> load_latest(worker::Checkpointer& checkpointer, torch::nn::Module& module,
                                   torch::optim::Optimizer* optimizer) {
  auto c = checkpointer.load_latest();
  if (!c) return std::nullopt;
  restore(*c, module, optimizer);
  Resumed r;
  r.step = c->step;
  r.world_size = c->world_size;
  r.path = c->path;
  r.sampler = c->sampler;
  r.metadata = c->metadata;
  return r;
}

std::string model_archive(const worker::Checkpoint& checkpoint) {
  return read_blob(checkpoint, "model", kModelBlob);
}

void export_model(const std::string& step_dir, const std::string& file) {
  const auto c = worker::Checkpointer::load(step_dir);
  const std::string bytes = model_archive(c);
  std::FILE* f = std::fopen(file.c_str(), "wb");
  if (!f)
    throw worker::CheckpointError(
        "trun::libtorch: cannot write " + file + ": " + std::strerror(errno), errno);
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  const bool closed = std::fclose(f) == 0;
  if (!ok || !closed)
    throw worker::CheckpointError("trun::libtorch: writing " + file + " failed", errno);
}

}  // namespace trun::libtorch
