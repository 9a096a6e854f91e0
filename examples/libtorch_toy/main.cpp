// libtorch_toy: the seed tutorial's ToyModel (Linear(10,10), ReLU, Linear(10,5)) trained
// data-parallel with libtorch and trun::libtorch::DistributedDataParallel, SGD and MSELoss; the
// C++ twin of tests/torch/toy_ddp.py (PyTorch's DistributedDataParallel on gloo).
//
//   trun --standalone --nproc-per-node=2 --max-restarts=3
//       build/examples/libtorch_toy/libtorch_toy --out /tmp/toy --ckpt-dir /tmp/toy/ck
//   (one command line)
//
// Seeds: torch::manual_seed(1234) before the model is built; rank R draws its data from a
// generator seeded 100 + R: per step randn(16, 10) then randn(16, 5). After training each rank
// writes OUT/rank<R>.json: {"digest": [sum of all parameters, sum of their squares],
// "replicas_identical": true|false, "steps": N, "resumed_from": S, "world_size": W}.
//
// With --ckpt-dir, rank 0 saves the model and optimizer every --ckpt-every steps (trun/torch.h),
// and every rank resumes from the newest checkpoint on start; the data generator is advanced past
// the steps already done, so a resumed run ends with the digest of an uninterrupted one.

#include <ATen/CPUGeneratorImpl.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include <trun/checkpoint.h>
#include <trun/torch.h>
#include <trun/worker.h>

namespace {

struct Args {
  std::string out;
  std::string ckpt_dir;
  uint64_t steps = 20;
  uint64_t ckpt_every = 5;
  double lr = 0.01;
  int step_sleep_ms = 0;
  bool find_unused = false;
};

[[noreturn]] void usage(int code) {
  std::fprintf(code ? stderr : stdout,
               "usage: libtorch_toy --out DIR [--steps N (20)] [--lr X (0.01)]\n"
               "                    [--ckpt-dir DIR [--ckpt-every K (5)]] [--step-sleep-ms T]\n"
               "                    [--find-unused-parameters]\n");
  std::exit(code);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "libtorch_toy: %s needs a value\n", k.c_str());
        usage(2);
      }
      return argv[++i];
    };
    auto count = [&](const std::string& v) -> uint64_t {
      char* end = nullptr;
      const unsigned long long n = std::strtoull(v.c_str(), &end, 10);
      if (v.empty() || *end || v[0] == '-') {
        std::fprintf(stderr, "libtorch_toy: %s: '%s' is not a non-negative integer\n", k.c_str(),
                     v.c_str());
        std::exit(2);
      }
      return n;
    };
    if (k == "--out")
      a.out = val();
    else if (k == "--ckpt-dir")
      a.ckpt_dir = val();
    else if (k == "--steps")
      a.steps = count(val());
    else if (k == "--ckpt-every")
      a.ckpt_every = count(val());
    else if (k == "--step-sleep-ms")
      a.step_sleep_ms = static_cast<int>(count(val()));
    else if (k == "--find-unused-parameters")
      a.find_unused = true;
    else if (k == "--lr") {
      const std::string v = val();
      char* end = nullptr;
      a.lr = std::strtod(v.c_str(), &end);
      if (v.empty() || *end || !(a.lr > 0)) {
        std::fprintf(stderr, "libtorch_toy: --lr: '%s' is not a positive number\n", v.c_str());
        std::exit(2);
      }
    } else if (k == "-h" || k == "--help")
      usage(0);
    else {
      std::fprintf(stderr, "libtorch_toy: unknown option '%s'\n", k.c_str());
      usage(2);
    }
  }
  if (a.out.empty()) {
    std::fprintf(stderr, "libtorch_toy: --out DIR is required\n");
    usage(2);
  }
  if (a.ckpt_every == 0) {
    std::fprintf(stderr, "libtorch_toy: --ckpt-every must be positive\n");
    std::exit(2);
  }
  return a;
}

int run(int argc, char** argv) {
  const Args args = parse(argc, argv);
  torch::set_num_threads(1);  // one core per rank

  trun::worker::InitOptions io;
  io.backend = trun::worker::Backend::kCpu;
  trun::worker::Worker worker = trun::worker::init(io);
  trun::worker::ProcessGroup& pg = worker.process_group();
  const int rank = worker.rank(), world = worker.world_size();
  {
    std::ofstream pid(args.out + "/rank" + std::to_string(rank) + ".pid");
    pid << ::getpid() << "\n";
  }

  torch::manual_seed(1234);
  // One statement each: the layers must draw their initial weights in this order (as Python's
  // ToyModel does), and the order in which a call's arguments are evaluated is unspecified (GCC
  // goes right to left). The digest would not notice: both layers draw from one uniform range.
  torch::nn::Linear net1(10, 10);
  torch::nn::Linear net2(10, 5);
  torch::nn::Sequential model(net1, torch::nn::ReLU(), net2);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(args.lr));

  uint64_t step = 0, resumed_from = 0;
  std::unique_ptr<trun::worker::Checkpointer> ckpt;
  if (!args.ckpt_dir.empty()) {
    trun::worker::CheckpointerOptions co;
    co.group = &pg;
    ckpt = std::make_unique<trun::worker::Checkpointer>(args.ckpt_dir, co);
    // Before the wrapper is built (trun/torch.h); restore() keeps the parameters' storage anyway.
    if (auto r = trun::libtorch::load_latest(*ckpt, *model, &opt)) {
      step = resumed_from = r->step;
      if (rank == 0)
        std::printf("[%d] resumed from %s (step %" PRIu64 ", saved at world size %d, now %d)\n",
                    static_cast<int>(::getpid()), r->path.c_str(), step, r->world_size, world);
    } else if (rank == 0) {
      std::printf("[%d] no checkpoint in %s: starting from scratch\n", static_cast<int>(::getpid()),
                  args.ckpt_dir.c_str());
    }
    std::fflush(stdout);
  }

  trun::libtorch::DdpOptions dopt;
  dopt.find_unused_parameters = args.find_unused;
  trun::libtorch::DistributedDataParallel ddp(pg, model.ptr(), dopt);

  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(100 + rank));
  for (uint64_t s = 0; s < step; ++s) {  // the data of the steps already done
    (void)torch::randn({16, 10}, gen);
    (void)torch::randn({16, 5}, gen);
  }
  for (; step < args.steps;) {
    const auto x = torch::randn({16, 10}, gen);
    const auto y = torch::randn({16, 5}, gen);
    opt.zero_grad();
    const auto loss = torch::mse_loss(ddp.forward(model, x), y);
    loss.backward();  // gradients averaged across the ranks when it returns
    opt.step();
    ++step;
    std::printf("[%d] rank %d step %" PRIu64 " loss %.6f\n", static_cast<int>(::getpid()), rank,
                step, loss.item<double>());
    std::fflush(stdout);
    if (ckpt && step % args.ckpt_every == 0)
      trun::libtorch::save_checkpoint(*ckpt, step, *model, &opt);
    if (args.step_sleep_ms > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(args.step_sleep_ms));
  }
  if (ckpt) ckpt->wait();

  // Digest, and whether every rank holds rank 0's parameters bit for bit.
  double sum = 0, sq = 0;
  std::vector<torch::Tensor> flat;
  for (const auto& p : model->parameters()) {
    const auto d = p.detach().to(torch::kFloat64);
    sum += d.sum().item<double>();
    sq += (d * d).sum().item<double>();
    flat.push_back(p.detach().reshape({-1}));
  }
  const auto mine = torch::cat(flat);
  auto theirs = mine.clone();
  pg.broadcast(theirs.data_ptr(), static_cast<size_t>(theirs.numel()),
               trun::worker::DataType::kFloat32, 0);
  int32_t differs = torch::equal(mine, theirs) ? 0 : 1;
  pg.allreduce(&differs, 1, trun::worker::DataType::kInt32, trun::worker::ReduceOp::kMax);

  const std::string path = args.out + "/rank" + std::to_string(rank) + ".json";
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "libtorch_toy: cannot write %s\n", path.c_str());
    return 1;
  }
  std::fprintf(f,
               "{\"digest\": [%.17g, %.17g], \"replicas_identical\": %s, \"steps\": %" PRIu64
               ", \"resumed_from\": %" PRIu64 ", \"world_size\": %d}\n",
               sum, sq, differs ? "false" : "true", step, resumed_from, world);
  std::fclose(f);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "libtorch_toy: %s\n", e.what());
    return 1;
  }
}
