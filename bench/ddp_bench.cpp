// DDP step-time overhead: the same training step of examples/train_mlp's MLP with and without
// gradient communication, on N ranks of one node, for several bucket caps. The peer (PyTorch 1.13
// DDP with gloo on the same model) is ddp_torch.py; scripts/bench_ddp.sh runs both.
//
//   ddp_bench [--ranks 2] [--sizes 1024,2560,2048,1024] [--batch 8] [--steps 8]
//             [--caps 1,5,25,100] [--fp16-caps 25] [--bf16-caps 25]
//
// Starts a store server and launches N copies of itself as ranks (the environment a trun agent
// would set). With RANK in its environment it is one rank instead, --ranks ignored: so a launcher
// can run it, as scripts/bench_ddp_net.sh does (one rank per node, trun agents in two network
// namespaces). Each rank runs every mode in turn; a step's time is the slowest rank's, and each
// mode reports the median over --steps timed steps (after 2 untimed rounds); the modes' steps are
// interleaved round by round. Prints:
//   trun mode=local ranks=N params=P step_ms=T
//   trun mode=ddp ranks=N params=P cap_mb=C buckets=B step_ms=T overhead=R
//   trun mode=ddp_fp16 ranks=N params=P cap_mb=C buckets=B step_ms=T overhead=R
//   trun mode=ddp_bf16 ranks=N params=P cap_mb=C buckets=B step_ms=T overhead=R
// where R = ddp step / local step (1.00 = no overhead); ddp_fp16 (ddp_bf16) is DDP with
// fp16_compress_hook() (bf16_compress_hook()) at each of --fp16-caps (--bf16-caps; empty: none).

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <trun/ddp.h>
#include <trun/worker.h>

#include "examples/train_mlp/mlp.h"
#include "store/server.h"

using Clock = std::chrono::steady_clock;
using namespace trun::worker;
using trun::examples::Mlp;
using trun::examples::Sgd;

namespace {

struct Args {
  int ranks = 2;
  std::string sizes = "1024,2560,2048,1024";
  size_t batch = 8;
  int steps = 8;
  std::vector<double> caps = {1, 5, 25, 100};
  std::vector<double> fp16_caps = {25};
  std::vector<double> bf16_caps = {25};
};

std::vector<double> parse_list(const std::string& s) {
  std::vector<double> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    if (comma == std::string::npos) comma = s.size();
    out.push_back(std::stod(s.substr(pos, comma - pos)));
    pos = comma + 1;
  }
  return out;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--ranks")
      a.ranks = std::stoi(v);
    else if (k == "--sizes")
      a.sizes = v;
    else if (k == "--batch")
      a.batch = std::stoul(v);
    else if (k == "--steps")
      a.steps = std::stoi(v);
    else if (k == "--caps")
      a.caps = parse_list(v);
    else if (k == "--fp16-caps")
      a.fp16_caps = v.empty() ? std::vector<double>{} : parse_list(v);
    else if (k == "--bf16-caps")
      a.bf16_caps = v.empty() ? std::vector<double>{} : parse_list(v);
    else {
      std::fprintf(stderr, "ddp_bench: unknown option %s\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One rank: every mode, timed; rank 0 prints.
int rank_main(const Args& a) {
  InitOptions io;
  io.backend = Backend::kCpu;
  Worker w = init(io);
  ProcessGroup& pg = w.process_group();
  Mlp model(trun::examples::parse_sizes(a.sizes));
  model.init(1);
  Sgd sgd(1e-4f, 0.0f);
  std::vector<float> x, t;
  std::vector<uint64_t> idx(a.batch);

  // Modes: 0 = local (own gradient buffers, no communication), 1.. = DDP with caps[m - 1], then
  // DDP with the fp16 compression hook at each of fp16_caps, then with the bf16 one at each of
  // bf16_caps.
  // Steps of all modes are interleaved round by round, so that drift in the machine's load
  // (it is shared) hits every mode alike.
  std::vector<std::vector<float>> local_store(model.num_params());
  std::vector<float*> local_grads;
  for (size_t i = 0; i < model.num_params(); ++i) {
    local_store[i].assign(model.param_numel(i), 0.0f);
    local_grads.push_back(local_store[i].data());
  }
  std::vector<std::unique_ptr<DistributedDataParallel>> ddps;
  std::vector<std::vector<float*>> ddp_grads;
  std::vector<double> all_caps = a.caps;
  all_caps.insert(all_caps.end(), a.fp16_caps.begin(), a.fp16_caps.end());
  all_caps.insert(all_caps.end(), a.bf16_caps.begin(), a.bf16_caps.end());
  const size_t first_bf16 = a.caps.size() + a.fp16_caps.size();
  auto mode_name = [&](size_t c) {
    return c < a.caps.size() ? "ddp" : c < first_bf16 ? "ddp_fp16" : "ddp_bf16";
  };
  for (size_t c = 0; c < all_caps.size(); ++c) {
    const double cap = all_caps[c];
    std::vector<Parameter> params;
    for (size_t i = 0; i < model.num_params(); ++i)
      params.push_back({model.param_name(i), model.param(i), model.param_numel(i)});
    DdpOptions o;
    o.bucket_cap_mb = cap;
    ddps.push_back(std::make_unique<DistributedDataParallel>(pg, params, o));
    if (c >= first_bf16)
      ddps.back()->register_comm_hook(bf16_compress_hook());
    else if (c >= a.caps.size())
      ddps.back()->register_comm_hook(fp16_compress_hook());
    std::vector<float*> g;
    for (size_t i = 0; i < model.num_params(); ++i) g.push_back(ddps.back()->grad_as<float>(i));
    ddp_grads.push_back(std::move(g));
  }
  const size_t modes = 1 + all_caps.size();
  std::vector<std::vector<double>> times(modes);
  for (int s = 0; s < a.steps + 2; ++s) {
    for (size_t m = 0; m < modes; ++m) {
      DistributedDataParallel* ddp = m == 0 ? nullptr : ddps[m - 1].get();
      std::vector<float*>& grads = m == 0 ? local_grads : ddp_grads[m - 1];
      std::vector<const float*> cg(grads.begin(), grads.end());
      for (size_t k = 0; k < a.batch; ++k) idx[k] = (s * a.batch + k) * pg.size() + pg.rank();
      model.make_batch(idx, x, t);
      pg.barrier();
      const auto t0 = Clock::now();
      if (ddp) {
        ddp->zero_grad();
      } else {
        for (size_t i = 0; i < model.num_params(); ++i)
          std::memset(grads[i], 0, model.param_numel(i) * sizeof(float));
      }
      model.forward(x.data(), t.data(), a.batch);
      if (ddp) {
        model.backward(grads, [&](size_t i) { ddp->mark_ready(i); });
        ddp->finalize();
      } else {
        model.backward(grads, nullptr);
      }
      sgd.step(model, cg);
      double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      pg.allreduce(&ms, 1, DataType::kFloat64, ReduceOp::kMax);
      if (s >= 2) times[m].push_back(ms);
    }
  }
  if (pg.rank() == 0) {
    const double local_ms = median(times[0]);
    std::printf("trun mode=local ranks=%d params=%zu step_ms=%.2f\n", pg.size(),
                model.total_elements(), local_ms);
    for (size_t m = 1; m < modes; ++m) {
      const double ms = median(times[m]);
      std::printf(
          "trun mode=%s ranks=%d params=%zu cap_mb=%g buckets=%zu step_ms=%.2f "
          "overhead=%.3f\n",
          mode_name(m - 1), pg.size(), model.total_elements(), all_caps[m - 1],
          ddps[m - 1]->buckets().size(), ms, ms / local_ms);
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  if (std::getenv("RANK")) {
    try {
      return rank_main(a);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ddp_bench rank: %s\n", e.what());
      return 1;
    }
  }
  trun::store::StoreServerOptions so;
  so.host = "127.0.0.1";
  auto server = trun::store::StoreServer::start(so);
  const std::string port = std::to_string(server->port());
  const std::string run_id = "ddp-bench-" + std::to_string(::getpid());
  std::vector<pid_t> pids;
  for (int r = 0; r < a.ranks; ++r) {
    pid_t pid = ::fork();
    if (pid < 0) return 1;
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(a.ranks).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(a.ranks).c_str(), 1);
      ::setenv("GROUP_RANK", "0", 1);
      ::setenv("GROUP_WORLD_SIZE", "1", 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      ::setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);  // the server above
      ::setenv("TORCHELASTIC_RUN_ID", run_id.c_str(), 1);
      ::setenv("TORCHELASTIC_RESTART_COUNT", "0", 1);
      ::execv("/proc/self/exe", argv);
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  int rc = 0;
  for (pid_t p : pids) {
    int st = 0;
    ::waitpid(p, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) rc = 1;
  }
  server->stop();
  return rc;
}
