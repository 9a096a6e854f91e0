#pragma once
// trun::torch (target trun::torch, library libtrun_torch): data-parallel training of a libtorch
// torch::nn::Module with libtrun_worker. PyTorch's C++ frontend has no DistributedDataParallel;
// this is one, over the bucketed, overlapped reducer of trun/ddp.h, plus checkpoints of a model
// and optimizer through trun/checkpoint.h.
//
//   auto worker = trun::worker::init();
//   torch::manual_seed(1234);
//   torch::nn::Sequential model(torch::nn::Linear(10, 10), torch::nn::ReLU(),
//                               torch::nn::Linear(10, 5));
//   torch::optim::SGD opt(model->parameters(), 0.01);
//   trun::worker::Checkpointer ckpt(dir, {&worker.process_group()});
//   auto resumed = trun::libtorch::load_latest(ckpt, *model, &opt);  // before wrapping: see below
//   trun::libtorch::DistributedDataParallel ddp(worker.process_group(), model.ptr());
//   for (...) {
//     opt.zero_grad();
//     auto loss = torch::mse_loss(ddp.forward(model, x), y);  // broadcasts buffers, then forward
//     loss.backward();  // buckets are all-reduced while backward runs; returns averaged grads
//     opt.step();
//   }
//
// What the wrapper does (and how it maps onto PyTorch's DDP):
// - Construction (collective): registers the module's parameters that require grad, in
//   Module::parameters() order, and its buffers; checks across ranks that every rank has the
//   same parameters (count, dtype, device, shape; the error names the first mismatch); broadcasts
//   rank 0's parameters and buffers.
// - gradient_as_bucket_view: each parameter's grad() is a view (torch::from_blob) on the
//   reducer's flat bucket memory, so AccumulateGrad writes gradients straight into the buckets
//   and nothing is copied to communicate. The optimizer's zero_grad() (libtorch 1.13 zeroes in
//   place) keeps the views. A grad that was reset to undefined (Module::zero_grad(), or
//   set_to_none) or replaced by another tensor is re-attached before the next forward (forward()
//   / prepare_forward()), or at the latest when its gradient is ready (then with one copy).
// - A post-hook on every parameter's grad accumulator marks it ready in the reducer, which
//   launches a bucket's allreduce (average) as soon as its last gradient is ready, while
//   backward continues. The first hook of a backward queues a callback on the autograd engine
//   that runs when backward ends and waits for every bucket (finalize): when backward() returns,
//   param.grad() holds the average over the ranks. Errors of the reducer (an unused parameter
//   without find_unused_parameters, a failed collective) are thrown out of backward().
// - no_sync(): while the returned guard lives, backward accumulates locally; the first
//   synchronized backward afterwards averages the sums.
// - find_unused_parameters: parameters whose gradient was not produced are zeroed and their
//   buckets reduced when backward ends. Unlike PyTorch, the graph is not traversed after the
//   forward: buckets holding an unused parameter wait for the end of backward instead of
//   launching early. unused_parameters() names them.
// - broadcast_buffers (default on, as PyTorch): rank 0's buffers are broadcast on construction
//   and before each forward(). Off: buffers are not registered at all (PyTorch still broadcasts
//   them once on construction); this is also how to wrap a module whose buffers have a dtype
//   trun's collectives lack (bool, uint8: std::invalid_argument otherwise).
// - Devices: CPU tensors go through a CPU group (shared memory / Gloo), CUDA tensors through an
//   NCCL group (the caller passes the matching group; a mismatch is std::invalid_argument). The
//   CUDA path is untested: Debian's libtorch is a CPU-only build, so no CUDA tensor can be made
//   on the machines trun is tested on. It uses the legacy default stream (DdpOptions has no
//   stream of libtorch's current stream, which needs c10/cuda).
//
// The parameters' storage must stay where it was at construction: load checkpoints before
// wrapping the module, or with the helpers below (they copy into the existing storage; plain
// Module::load / torch::load replace it and leave the reducer with stale pointers).
//
// Collectives: construction, forward() (when broadcasting buffers) and each synchronized
// backward are collective: every rank makes the same calls in the same order.
// Thread safety: one training thread; the hooks run on autograd's threads.
// Errors: std::invalid_argument (unsupported dtype, non-contiguous parameter, mismatch across
// ranks), trun::worker::DdpError, trun::worker::CollectiveError.

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <trun/checkpoint.h>
#include <trun/ddp.h>
#include <trun/process_group.h>
#include <trun/resilient.h>
#include <trun/sampler.h>

namespace trun::libtorch {

struct DdpOptions {
  double bucket_cap_mb = 25.0;       // MiB, as PyTorch
  double first_bucket_cap_mb = 1.0;  // MiB
  bool find_unused_parameters = false;
  bool broadcast_buffers = true;
  bool check_parameters_across_ranks = true;
  // Off: construction does not broadcast rank 0's parameters and buffers (the caller makes them
  // equal itself: a resilient loop moves its state after the groups form, trun/resilient.h).
  bool broadcast_parameters = true;
  // Deadline of each collective; 0: the group's.
  std::chrono::milliseconds timeout{0};
};

class DistributedDataParallel {
 public:
  // Collective. `group` is not owned and must outlive the wrapper; the module is shared.
  DistributedDataParallel(worker::ProcessGroup& group, std::shared_ptr<torch::nn::Module> module,
                          DdpOptions options = {});
  ~DistributedDataParallel();  // removes nothing from autograd: the hooks become no-ops
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // Broadcasts buffers (broadcast_buffers) and re-attaches gradient views. forward() calls it.
  void prepare_forward();
  // prepare_forward(), then module->forward(args...).
  template <typename ModuleHolder, typename... Args>
  auto forward(ModuleHolder& module, Args&&... args) {
    prepare_forward();
    return module->forward(std::forward<Args>(args)...);
  }

  worker::DistributedDataParallel::NoSync no_sync() { return reducer_->no_sync(); }

  // The registered parameters (Module::parameters() that require grad) and their names.
  const std::vector<torch::Tensor>& parameters() const { return params_; }
  const std::vector<std::string>& parameter_names() const { return names_; }
  // Names of the parameters unused in the last synchronized backward (find_unused_parameters).
  std::vector<std::string> unused_parameters() const;
  // The core reducer (buckets, timings of the last iteration).
  worker::DistributedDataParallel& reducer() { return *reducer_; }
  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }

  struct State;  // private: what the autograd hooks share with the wrapper

 private:
  void attach_grad(size_t i, bool copy_existing);

  std::shared_ptr<torch::nn::Module> module_;
  DdpOptions options_;
  std::vector<torch::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> buffers_;
  std::vector<torch::Tensor> views_;  // views_[i]: parameter i's gradient, in bucket memory
  std::unique_ptr<worker::DistributedDataParallel> reducer_;
  std::shared_ptr<State> state_;
};

// ---- Checkpoints of a libtorch model and optimizer (trun/checkpoint.h: atomic, checksummed,
// resumable at another world size).
//
// The model is serialized with libtorch's own format (Module::save into a
// torch::serialize::OutputArchive: what torch::save(module, file) writes) and stored as the
// tensor "libtorch.model" of the checkpoint's model section, the optimizer (Optimizer::save) as
// "libtorch.optimizer" of its optimizer section; each blob is int64 words, its byte length in
// the scalar "<name>.bytes". model_archive() returns the model's bytes, which torch::load(module,
// stream) reads; export_model() writes them to a file for torch::load(module, path).

struct SaveOptions {
  std::optional<worker::SamplerState> sampler;
  std::string metadata = "{}";  // user JSON
};

// Saves (rank 0 writes; others return at once; see Checkpointer::save).
void save_checkpoint(worker::Checkpointer& checkpointer, uint64_t step, torch::nn::Module& module,
                     torch::optim::Optimizer* optimizer, const SaveOptions& options = {});

struct Resumed {
  uint64_t step = 0;
  int world_size = 1;  // of the job that saved it
  std::string path;
  std::optional<worker::SamplerState> sampler;
  std::string metadata;
};

// Checkpointer::load_latest() (collective with a group), then restores the module (and the
// optimizer when given) into their existing storage. std::nullopt: no checkpoint; the module is
// untouched. Throws CheckpointError when the checkpoint has no libtorch model, or libtorch's
// errors (c10::Error) when it does not fit the module.
std::optional<Resumed> load_latest(worker::Checkpointer& checkpointer, torch::nn::Module& module,
                                   torch::optim::Optimizer* optimizer = nullptr);

// Restores a loaded checkpoint into `module` / `optimizer` (existing storage kept).
void restore(const worker::Checkpoint& checkpoint, torch::nn::Module& module,
             torch::optim::Optimizer* optimizer = nullptr);

// ---- the resilient loop (trun/resilient.h)
//
// Registers `module`'s parameters and buffers (every one a contiguous CPU tensor, whose storage
// must stay where it is while the loop runs: load checkpoints with restore() above, which keeps
// it) as buffers of `state`, and `optimizer`'s state (Optimizer::save / load, e.g. SGD's
// momentum) as serialized state, so that a ResilientLoop moves them to a replaced rank.
// std::invalid_argument for a tensor on a device or not contiguous.
void add_to_resilient_state(worker::ResilientState& state, torch::nn::Module& module,
                            torch::optim::Optimizer* optimizer = nullptr);

// The model's libtorch archive bytes (torch::load reads them). CheckpointError when absent.
std::string model_archive(const worker::Checkpoint& checkpoint);
// Reads and verifies checkpoint directory `step_dir` and writes its model archive to `file`.
void export_model(const std::string& step_dir, const std::string& file);

}  // namespace trun::libtorch
