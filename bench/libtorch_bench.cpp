// libtorch_bench: step time of a ~10M-parameter MLP (libtorch) trained data-parallel with
// trun::libtorch::DistributedDataParallel, and with no communication (steps under no_sync(),
// alternating with the DDP steps); run as the ranks of a trun job by scripts/bench_libtorch.sh,
// which compares it with PyTorch's Python DDP (bench/ddp_libtorch.py). Rank 0 prints one line:
//   trun mode=ddp|local cap_mb=C ranks=N params=P step_ms=T
// Each rank uses one thread (torch::set_num_threads(1)).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include <trun/progress.h>
#include <trun/torch.h>
#include <trun/worker.h>

int main(int argc, char** argv) {
  std::vector<int64_t> sizes = {1024, 2560, 2048, 1024};
  int64_t batch = 32;
  int steps = 15, warmup = 3;
  double cap = 25;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "libtorch_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--batch")
      batch = std::stoll(next());
    else if (a == "--steps")
      steps = std::stoi(next());
    else if (a == "--warmup")
      warmup = std::stoi(next());
    else if (a == "--cap-mb")
      cap = std::stod(next());
    else if (a == "--sizes") {
      sizes.clear();
      std::string s = next();
      for (size_t p = 0; p < s.size();) {
        size_t q = s.find(',', p);
        if (q == std::string::npos) q = s.size();
        sizes.push_back(std::stoll(s.substr(p, q - p)));
        p = q + 1;
      }
    } else {
      std::fprintf(stderr,
                   "usage: libtorch_bench [--sizes A,B,..] [--batch B] [--steps N] "
                   "[--warmup N] [--cap-mb X]\n");
      return 2;
    }
  }
  if (sizes.size() < 2 || batch < 1 || steps < 1 || warmup < 0) {
    std::fprintf(stderr, "libtorch_bench: bad arguments\n");
    return 2;
  }
  try {
    torch::set_num_threads(1);
    trun::worker::InitOptions io;
    io.backend = trun::worker::Backend::kCpu;
    auto worker = trun::worker::init(io);
    auto& pg = worker.process_group();
    torch::manual_seed(0);
    torch::nn::Sequential model;
    for (size_t i = 0; i + 1 < sizes.size(); ++i) {
      model->push_back(torch::nn::Linear(sizes[i], sizes[i + 1]));
      if (i + 2 < sizes.size()) model->push_back(torch::nn::ReLU());
    }
    int64_t params = 0;
    for (auto& p : model->parameters()) params += p.numel();
    torch::optim::SGD opt(model->parameters(), 0.001);
    trun::libtorch::DdpOptions o;
    o.bucket_cap_mb = cap;
    trun::libtorch::DistributedDataParallel ddp(pg, model.ptr(), o);
    auto x = torch::randn({batch, sizes.front()});
    auto y = torch::randn({batch, sizes.back()});
    // Local and DDP steps alternate, so that both see the same load on the machine. A local step
    // is a step under no_sync(): the same hooks run, nothing is communicated.
    std::vector<double> times[2];
    for (int s = 0; s < 2 * (warmup + steps); ++s) {
      const bool sync = s % 2 == 1;
      pg.barrier();  // every rank starts the step together
      const auto t0 = std::chrono::steady_clock::now();
      {
        std::optional<trun::worker::DistributedDataParallel::NoSync> guard;
        if (!sync) guard.emplace(ddp.no_sync());
        opt.zero_grad();
        torch::mse_loss(ddp.forward(model, x), y).backward();
        opt.step();
      }
      const auto t1 = std::chrono::steady_clock::now();
      if (s / 2 >= warmup)
        times[sync].push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    for (int sync = 0; sync < 2; ++sync) {
      // The step time of the job: the slowest rank's median.
      auto& t = times[sync];
      std::sort(t.begin(), t.end());
      double med = t[t.size() / 2];
      pg.allreduce(&med, 1, trun::worker::DataType::kFloat64, trun::worker::ReduceOp::kMax);
      if (worker.rank() == 0)
        std::printf("trun mode=%s cap_mb=%g ranks=%d params=%lld step_ms=%.2f progress=%d\n",
                    sync ? "ddp" : "local", cap, worker.world_size(),
                    static_cast<long long>(params), med, trun::worker::progress_reported());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "libtorch_bench: %s\n", e.what());
    return 1;
  }
}
