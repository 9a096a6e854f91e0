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
  bool classic = false;  // without the resilient loop
};

[[noreturn]] void usage(int code) {
  std::fprintf(code ? stderr : stdout,
               "usage: libtorch_toy --out DIR [--steps N (20)] [--lr X (0.01)]\n"
               "                    [--ckpt-dir DIR [--ckpt-every K (5)]] [--step-sleep-ms T]\n"
               "                    [--find-unused-parameters] [--classic]\n");
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
    else if (k == "--classic")
      a.classic = true;
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

// The toy's training: the model, its optimizer, the step, and rank R's data generator (seeded
// 100 + R, drawn once per step: gen_step says for which step it stands ready).
struct Toy {
  const Args& args;
  torch::nn::Sequential model;
  torch::optim::SGD& opt;
  uint64_t step = 0;
  uint64_t resumed_from = 0;
  int rank = 0;
  int world = 1;
  at::Generator gen{};
  uint64_t gen_step = UINT64_MAX;
  std::unique_ptr<trun::worker::Checkpointer> ckpt{};
};

// Opens --ckpt-dir with `pg` as the load's group (dropping the previous checkpointer first).
void open_checkpointer(Toy& t, trun::worker::ProcessGroup& pg) {
  if (t.args.ckpt_dir.empty()) return;
  trun::worker::CheckpointerOptions co;
  co.group = &pg;
  t.ckpt.reset();
  t.ckpt = std::make_unique<trun::worker::Checkpointer>(t.args.ckpt_dir, co);
}

// Resumes from the newest checkpoint, if any (collective over the checkpointer's group).
void load_checkpoint(Toy& t) {
  if (!t.ckpt) return;
  // Before the wrapper is built (trun/torch.h); restore() keeps the parameters' storage anyway.
  if (auto r = trun::libtorch::load_latest(*t.ckpt, *t.model, &t.opt)) {
    t.step = t.resumed_from = r->step;
    if (t.rank == 0)
      std::printf("[%d] resumed from %s (step %" PRIu64 ", saved at world size %d, now %d)\n",
                  static_cast<int>(::getpid()), r->path.c_str(), t.step, r->world_size, t.world);
  } else if (t.rank == 0) {
    std::printf("[%d] no checkpoint in %s: starting from scratch\n", static_cast<int>(::getpid()),
                t.args.ckpt_dir.c_str());
  }
  std::fflush(stdout);
}

// One step; false when training is complete. The data generator is brought to the step first
// (from its seed, past the steps already done: after a resume, or a failed step that drew).
bool train_step(Toy& t, trun::libtorch::DistributedDataParallel& ddp) {
  if (t.step >= t.args.steps) return false;
  if (t.gen_step != t.step) {
    t.gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(100 + t.rank));
    for (uint64_t s = 0; s < t.step; ++s) {
      (void)torch::randn({16, 10}, t.gen);
      (void)torch::randn({16, 5}, t.gen);
    }
  }
  const auto x = torch::randn({16, 10}, t.gen);
  const auto y = torch::randn({16, 5}, t.gen);
  t.gen_step = UINT64_MAX;  // drawn: ready again only once the step completes
  t.opt.zero_grad();
  const auto loss = torch::mse_loss(ddp.forward(t.model, x), y);
  loss.backward();  // gradients averaged across the ranks when it returns
  t.opt.step();
  ++t.step;
  t.gen_step = t.step;
  std::printf("[%d] rank %d step %" PRIu64 " loss %.6f\n", static_cast<int>(::getpid()), t.rank,
              t.step, loss.item<double>());
  std::fflush(stdout);
  if (t.ckpt && t.step % t.args.ckpt_every == 0)
    trun::libtorch::save_checkpoint(*t.ckpt, t.step, *t.model, &t.opt);
  if (t.args.step_sleep_ms > 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(t.args.step_sleep_ms));
  return true;
}

// Writes OUT/rank<R>.json: the digest, and whether every rank holds rank 0's parameters bit for
// bit (collective over `pg`).
int report(Toy& t, trun::worker::ProcessGroup& pg) {
  if (t.ckpt) t.ckpt->wait();
  double sum = 0, sq = 0;
  std::vector<torch::Tensor> flat;
  for (const auto& p : t.model->parameters()) {
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

  const std::string path = t.args.out + "/rank" + std::to_string(t.rank) + ".json";
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "libtorch_toy: cannot write %s\n", path.c_str());
    return 1;
  }
  std::fprintf(f,
               "{\"digest\": [%.17g, %.17g], \"replicas_identical\": %s, \"steps\": %" PRIu64
               ", \"resumed_from\": %" PRIu64 ", \"world_size\": %d}\n",
               sum, sq, differs ? "false" : "true", t.step, t.resumed_from, t.world);
  std::fclose(f);
  return 0;
}

void write_pid(const Toy& t) {
  std::ofstream pid(t.args.out + "/rank" + std::to_string(t.rank) + ".pid");
  pid << ::getpid() << "\n";
}

int run(int argc, char** argv) {
  const Args args = parse(argc, argv);
  torch::set_num_threads(1);  // one core per rank

  torch::manual_seed(1234);
  // One statement each: the layers must draw their initial weights in this order (as Python's
  // ToyModel does), and the order in which a call's arguments are evaluated is unspecified (GCC
  // goes right to left). The digest would not notice: both layers draw from one uniform range.
  torch::nn::Linear net1(10, 10);
  torch::nn::Linear net2(10, 5);
  torch::nn::Sequential model(net1, torch::nn::ReLU(), net2);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(args.lr));
  Toy t{args, model, opt};

  trun::worker::InitOptions io;
  io.backend = trun::worker::Backend::kCpu;
  trun::libtorch::DdpOptions dopt;
  dopt.find_unused_parameters = args.find_unused;
  if (args.classic) {
    // Without the resilient loop: a peer's failure ends this process, and the agent restarts
    // the whole group, which resumes from the newest checkpoint.
    trun::worker::Worker worker = trun::worker::init(io);
    trun::worker::ProcessGroup& pg = worker.process_group();
    t.rank = worker.rank();
    t.world = worker.world_size();
    write_pid(t);
    open_checkpointer(t, pg);
    load_checkpoint(t);
    trun::libtorch::DistributedDataParallel ddp(pg, model.ptr(), dopt);
    while (train_step(t, ddp)) {
    }
    return report(t, pg);
  }
  // The resilient loop (trun/resilient.h): a peer's failure makes this process build new groups
  // with the peer's replacement and continue from the most advanced step any rank holds.
  trun::worker::ResilientState state;
  state.set_step(&t.step);
  trun::libtorch::add_to_resilient_state(state, *model, &opt);
  trun::worker::ResilientOptions ro;
  ro.init = io;
  trun::worker::ResilientLoop loop(state, ro);
  std::unique_ptr<trun::libtorch::DistributedDataParallel> ddp;
  dopt.broadcast_parameters = false;  // the loop moves the state
  trun::worker::ResilientProgram program;
  program.on_group = [&](trun::worker::Worker& worker, const trun::worker::Formation& f) {
    t.rank = worker.rank();
    t.world = worker.world_size();
    if (f.number == 0) write_pid(t);
    open_checkpointer(t, worker.process_group());
  };
  program.release = [&] {
    ddp.reset();
    t.ckpt.reset();
  };
  program.restore = [&](trun::worker::Worker&) { load_checkpoint(t); };
  program.step = [&](trun::worker::Worker& worker) {
    // Built on the first step of a formation: after the loop moved the state into the module.
    if (!ddp)
      ddp = std::make_unique<trun::libtorch::DistributedDataParallel>(worker.process_group(),
                                                                      model.ptr(), dopt);
    return train_step(t, *ddp);
  };
  loop.run(program);
  return report(t, loop.worker().process_group());
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
