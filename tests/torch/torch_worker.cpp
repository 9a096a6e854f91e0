// A rank of the trun::libtorch tests (tests/torch/torch_test.cpp): `torch_worker MODE [DIR]`
// checks one behaviour of trun/torch.h across the ranks of a job and exits 0, or prints what
// differed and exits 1.

#include <ATen/CPUGeneratorImpl.h>

#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>

#include <trun/checkpoint.h>
#include <trun/torch.h>
#include <trun/worker.h>

namespace {

using trun::libtorch::DistributedDataParallel;

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

bool close(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && torch::allclose(a, b, 1e-5, 1e-6);
}

torch::nn::Sequential make_model() {
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Tanh(), torch::nn::Linear(8, 3));
}

std::pair<torch::Tensor, torch::Tensor> batch(int rank, int iteration) {
  auto gen =
      at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(1000 * iteration + rank));
  auto x = torch::randn({6, 4}, gen);
  auto y = torch::randn({6, 3}, gen);
  return {x, y};
}

// Sum over `iterations` of rank r's local gradients, averaged over the ranks: computed locally
// on a copy of the model, as the reference.
std::vector<torch::Tensor> reference(torch::nn::Sequential& model, int world,
                                     const std::vector<int>& iterations, int only_rank = -1) {
  auto copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());
  std::vector<torch::Tensor> sum;
  for (auto& p : copy->parameters()) sum.push_back(torch::zeros_like(p));
  for (int r = 0; r < world; ++r)
    for (int it : iterations) {
      if (only_rank >= 0 && r != only_rank) continue;
      for (auto& p : copy->parameters()) p.mutable_grad() = torch::Tensor();
      auto [x, y] = batch(r, it);
      torch::mse_loss(copy->forward(x), y).backward();
      auto ps = copy->parameters();
      for (size_t i = 0; i < ps.size(); ++i) sum[i] += ps[i].grad() / world;
    }
  return sum;
}

void check_grads_in_buckets(DistributedDataParallel& ddp) {
  for (size_t i = 0; i < ddp.parameters().size(); ++i)
    require(ddp.parameters()[i].grad().data_ptr() == ddp.reducer().grad(i),
            "grad of " + ddp.parameter_names()[i] + " is a view on its bucket");
}

void mode_average(trun::worker::ProcessGroup& pg) {
  auto model = make_model();
  torch::optim::SGD opt(model->parameters(), 0.1);
  DistributedDataParallel ddp(pg, model.ptr());
  check_grads_in_buckets(ddp);
  for (int it = 0; it < 3; ++it) {
    const auto before = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());
    torch::nn::Sequential ref_model(before);
    const auto expected = reference(ref_model, pg.size(), {it});
    // Alternate the ways gradients get cleared: in place (optimizer), to undefined (module).
    if (it == 1)
      model->zero_grad();
    else
      opt.zero_grad();
    auto [x, y] = batch(pg.rank(), it);
    torch::mse_loss(ddp.forward(model, x), y).backward();
    check_grads_in_buckets(ddp);
    auto ps = model->parameters();
    for (size_t i = 0; i < ps.size(); ++i)
      require(close(ps[i].grad(), expected[i]),
              "iteration " + std::to_string(it) + ": averaged grad of " + ddp.parameter_names()[i]);
    opt.step();
  }
  // Gradients undefined and a backward without forward(): re-attached in the hook (one copy).
  model->zero_grad();
  const auto expected = reference(model, pg.size(), {9});
  auto [x, y] = batch(pg.rank(), 9);
  torch::mse_loss(model->forward(x), y).backward();
  check_grads_in_buckets(ddp);
  auto ps = model->parameters();
  for (size_t i = 0; i < ps.size(); ++i)
    require(close(ps[i].grad(), expected[i]), "grad after backward without forward()");
}

void mode_no_sync(trun::worker::ProcessGroup& pg) {
  auto model = make_model();
  DistributedDataParallel ddp(pg, model.ptr());
  const auto expected = reference(model, pg.size(), {0, 1, 2});
  {
    auto guard = ddp.no_sync();
    for (int it = 0; it < 2; ++it) {
      auto [x, y] = batch(pg.rank(), it);
      torch::mse_loss(ddp.forward(model, x), y).backward();
    }
    // Nothing was communicated: the grads are this rank's own sums (over world ranks' shares:
    // the reference divides by the world size).
    const auto local = reference(model, pg.size(), {0, 1}, pg.rank());
    auto ps = model->parameters();
    for (size_t i = 0; i < ps.size(); ++i)
      require(close(ps[i].grad() / pg.size(), local[i]),
              "local sum under no_sync of " + ddp.parameter_names()[i]);
  }
  auto [x, y] = batch(pg.rank(), 2);
  torch::mse_loss(ddp.forward(model, x), y).backward();
  auto ps = model->parameters();
  for (size_t i = 0; i < ps.size(); ++i)
    require(close(ps[i].grad(), expected[i]),
            "accumulated then averaged grad of " + ddp.parameter_names()[i]);
}

struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl() {
    torch::manual_seed(3);
    used = register_module("used", torch::nn::Linear(4, 3));
    unused = register_module("unused", torch::nn::Linear(4, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return used->forward(x); }
  torch::nn::Linear used{nullptr}, unused{nullptr};
};
TORCH_MODULE(TwoHeads);

void mode_unused(trun::worker::ProcessGroup& pg, bool find_unused) {
  TwoHeads model;
  trun::libtorch::DdpOptions o;
  o.find_unused_parameters = find_unused;
  DistributedDataParallel ddp(pg, model.ptr(), o);
  auto [x, y] = batch(pg.rank(), 0);
  if (!find_unused) {
    try {
      torch::mse_loss(ddp.forward(model, x), y).backward();
    } catch (const std::exception& e) {
      std::printf("backward failed: %s\n", e.what());
      require(std::string(e.what()).find("unused.weight") != std::string::npos,
              "the error names the unused parameter");
      return;
    }
    require(false, "backward with an unused parameter and no find_unused_parameters throws");
  }
  torch::mse_loss(ddp.forward(model, x), y).backward();
  const auto unused = ddp.unused_parameters();
  require(unused == std::vector<std::string>{"unused.weight", "unused.bias"},
          "unused_parameters() names the unused head");
  require(model->unused->weight.grad().abs().sum().item<double>() == 0, "unused grad is zero");
  require(model->used->weight.grad().abs().sum().item<double>() > 0, "used grad is not zero");
}

void mode_mismatch(trun::worker::ProcessGroup& pg) {
  torch::nn::Sequential model(torch::nn::Linear(4, 8),
                              torch::nn::Linear(8, pg.rank() == 1 ? 2 : 3));
  try {
    DistributedDataParallel ddp(pg, model.ptr());
  } catch (const std::invalid_argument& e) {
    std::printf("construction failed: %s\n", e.what());
    const std::string m = e.what();
    require(m.find("'1.weight'") != std::string::npos, "the error names 1.weight");
    require(m.find("rank 0 has shape [3, 8]") != std::string::npos, "and rank 0's shape");
    require(m.find("rank 1 has shape [2, 8]") != std::string::npos, "and rank 1's shape");
    return;
  }
  require(false, "different models across ranks are refused");
}

void mode_buffers(trun::worker::ProcessGroup& pg) {
  torch::manual_seed(5);
  torch::nn::BatchNorm1d bn(3);
  torch::nn::Sequential model(torch::nn::Linear(4, 3), bn);
  DistributedDataParallel ddp(pg, model.ptr());
  for (int it = 0; it < 2; ++it) {
    auto [x, y] = batch(pg.rank(), it);
    torch::mse_loss(ddp.forward(model, x), y).backward();
  }
  // Each rank's running stats now reflect its own last batch; the next forward broadcasts rank
  // 0's first. Compare what every rank holds right after the broadcast.
  ddp.prepare_forward();
  auto mine = bn->running_mean.clone();
  auto theirs = mine.clone();
  pg.broadcast(theirs.data_ptr(), 3, trun::worker::DataType::kFloat32, 0);
  require(torch::equal(mine, theirs), "running_mean equals rank 0's after prepare_forward()");
  require(bn->num_batches_tracked.item<int64_t>() == 2, "num_batches_tracked broadcast too");
}

void mode_checkpoint(trun::worker::ProcessGroup& pg, const std::string& dir) {
  auto model = make_model();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  DistributedDataParallel ddp(pg, model.ptr());
  for (int it = 0; it < 2; ++it) {
    opt.zero_grad();
    auto [x, y] = batch(pg.rank(), it);
    torch::mse_loss(ddp.forward(model, x), y).backward();
    opt.step();
  }
  trun::worker::CheckpointerOptions co;
  co.group = &pg;
  co.job_id = "torch-test";
  trun::worker::Checkpointer ckpt(dir, co);
  trun::libtorch::save_checkpoint(ckpt, 2, *model, &opt);
  ckpt.wait();
  pg.barrier();
  const auto saved = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());

  // torch::load reads the model part (from the exported file and from the bytes).
  if (pg.rank() == 0) {
    trun::libtorch::export_model(dir + "/step_2", dir + "/model.pt");
    auto fresh =
        torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Tanh(), torch::nn::Linear(8, 3));
    torch::load(fresh, dir + "/model.pt");
    auto a = fresh->parameters(), b = saved->parameters();
    for (size_t i = 0; i < a.size(); ++i) require(torch::equal(a[i], b[i]), "torch::load(file)");
  }
  pg.barrier();

  // Train further, then restore: the values come back into the same storage, which the reducer
  // keeps using; one more synchronized step works and leaves replicas identical.
  std::vector<void*> ptrs;
  for (auto& p : model->parameters()) ptrs.push_back(p.data_ptr());
  opt.zero_grad();
  auto [x, y] = batch(pg.rank(), 5);
  torch::mse_loss(ddp.forward(model, x), y).backward();
  opt.step();
  auto r = trun::libtorch::load_latest(ckpt, *model, &opt);
  require(r && r->step == 2, "load_latest finds step 2");
  auto ps = model->parameters(), ss = saved->parameters();
  for (size_t i = 0; i < ps.size(); ++i) {
    require(ps[i].data_ptr() == ptrs[i], "storage kept by restore()");
    require(torch::equal(ps[i], ss[i]), "restored values");
  }
  opt.zero_grad();
  torch::mse_loss(ddp.forward(model, x), y).backward();
  check_grads_in_buckets(ddp);
  opt.step();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: torch_worker MODE [DIR]\n");
    return 2;
  }
  const std::string mode = argv[1];
  try {
    torch::set_num_threads(1);
    trun::worker::InitOptions io;
    io.backend = trun::worker::Backend::kCpu;
    auto worker = trun::worker::init(io);
    auto& pg = worker.process_group();
    if (mode == "average")
      mode_average(pg);
    else if (mode == "no_sync")
      mode_no_sync(pg);
    else if (mode == "unused")
      mode_unused(pg, true);
    else if (mode == "unused_error")
      mode_unused(pg, false);
    else if (mode == "mismatch")
      mode_mismatch(pg);
    else if (mode == "buffers")
      mode_buffers(pg);
    else if (mode == "checkpoint" && argc > 2)
      mode_checkpoint(pg, argv[2]);
    else {
      std::fprintf(stderr, "torch_worker: unknown mode '%s'\n", mode.c_str());
      return 2;
    }
    std::printf("rank %d: %s OK\n", worker.rank(), mode.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::printf("rank ?: %s FAILED: %s\n", mode.c_str(), e.what());
    return 1;
  }
}
