// A rank program for the DDP tests (launched by tests/worker_sdk/ddp/ddp_test.cpp through the
// launcher environment):
//
//   ddp_worker train STEPS BATCH CAP_MB FIRST_CAP_MB ACCUM OUT
//       trains examples/train_mlp's MLP (10,32,32,5) with DDP; ranks start from different
//       weights (DDP must broadcast rank 0's); ACCUM micro-batches per step, all but the last
//       under no_sync; after every step the parameters' CRC32C is allgathered and must be equal
//       on every rank; rank 0 writes the final parameters (float32, concatenated) to OUT.
//   ddp_worker overlap
//       8 parameters of 64 Ki floats, 256 KiB buckets; backward is simulated with a 30 ms pause
//       before each gradient; checks the first bucket was launched and had completed before the
//       last gradient was marked, and that the averages are right.
//   ddp_worker errors
//       misuse: a gradient marked twice, finalize() with a gradient missing (both DdpError with
//       the parameter's name), and find_unused_parameters with a parameter unused on rank 0.
//
// Exit codes: 0 pass, 1 check failed, 2 usage, 3 unexpected exception.

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "examples/train_mlp/mlp.h"
#include "trun/checkpoint.h"
#include "trun/ddp.h"
#include "trun/sampler.h"
#include "trun/worker.h"

using namespace trun::worker;
using trun::examples::Mlp;
using trun::examples::Sgd;

namespace {

int fail(const std::string& msg) {
  std::fprintf(stderr, "CHECK FAILED: %s\n", msg.c_str());
  return 1;
}

int train(ProcessGroup& pg, int argc, char** argv) {
  if (argc != 8) return 2;
  const int steps = std::atoi(argv[2]);
  const size_t batch = std::strtoul(argv[3], nullptr, 10);
  DdpOptions opt;
  opt.bucket_cap_mb = std::atof(argv[4]);
  opt.first_bucket_cap_mb = std::atof(argv[5]);
  const int accum = std::atoi(argv[6]);
  const std::string out = argv[7];

  Mlp model({10, 32, 32, 5});
  model.init(100 + static_cast<uint64_t>(pg.rank()));
  std::vector<Parameter> params;
  for (size_t i = 0; i < model.num_params(); ++i)
    params.push_back({model.param_name(i), model.param(i), model.param_numel(i)});
  DistributedDataParallel ddp(pg, params, opt);
  std::printf("buckets %zu\n", ddp.buckets().size());
  SamplerOptions so;
  so.seed = 3;
  DistributedSampler sampler(512, pg.rank(), pg.size(), so);
  Sgd sgd(0.05f, 0.5f);
  std::vector<float*> grads;
  std::vector<const float*> cgrads;
  for (size_t i = 0; i < model.num_params(); ++i) {
    grads.push_back(ddp.grad_as<float>(i));
    cgrads.push_back(grads.back());
  }
  std::vector<float> x, t;
  std::vector<int64_t> crcs(pg.size());
  for (int s = 0; s < steps; ++s) {
    ddp.zero_grad();
    for (int m = 0; m < accum; ++m) {
      auto idx = sampler.next_batch(batch);
      if (idx.size() != batch) return fail("sampler ran out of samples");
      model.make_batch(idx, x, t);
      model.forward(x.data(), t.data(), idx.size());
      auto mark = [&](size_t i) { ddp.mark_ready(i); };
      if (m + 1 < accum) {
        auto guard = ddp.no_sync();
        model.backward(grads, mark, 1.0f / static_cast<float>(accum));
        ddp.finalize();
      } else {
        model.backward(grads, mark, 1.0f / static_cast<float>(accum));
        ddp.finalize();
      }
    }
    sgd.step(model, cgrads);
    uint32_t crc = 0;
    for (size_t i = 0; i < model.num_params(); ++i)
      crc = crc32c(model.param(i), model.param_numel(i) * sizeof(float), crc);
    int64_t mine = crc;
    pg.allgather(&mine, crcs.data(), 1, DataType::kInt64);
    for (int r = 0; r < pg.size(); ++r)
      if (crcs[r] != mine)
        return fail("step " + std::to_string(s) + ": parameters differ between rank " +
                    std::to_string(pg.rank()) + " and rank " + std::to_string(r));
  }
  if (pg.rank() == 0) {
    std::FILE* f = std::fopen(out.c_str(), "wb");
    if (!f) return fail("cannot write " + out);
    for (size_t i = 0; i < model.num_params(); ++i)
      std::fwrite(model.param(i), sizeof(float), model.param_numel(i), f);
    std::fclose(f);
  }
  std::printf("PASS train\n");
  return 0;
}

int overlap(ProcessGroup& pg) {
  constexpr size_t kParams = 8, kNumel = 64 * 1024;
  std::vector<std::vector<float>> data(kParams, std::vector<float>(kNumel, 0.0f));
  std::vector<Parameter> params;
  for (size_t i = 0; i < kParams; ++i)
    params.push_back({"p" + std::to_string(i), data[i].data(), kNumel});
  DdpOptions opt;
  opt.bucket_cap_mb = 0.25;
  opt.first_bucket_cap_mb = 0.25;
  DistributedDataParallel ddp(pg, params, opt);
  if (ddp.buckets().size() != kParams)
    return fail("expected one bucket per parameter, got " + std::to_string(ddp.buckets().size()));
  for (int iter = 0; iter < 2; ++iter) {
    ddp.zero_grad();
    for (size_t i = kParams; i-- > 0;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));  // "computing" gradient i
      float* g = ddp.grad_as<float>(i);
      for (size_t k = 0; k < kNumel; ++k) g[k] = static_cast<float>(pg.rank() + i + k % 7);
      ddp.mark_ready(i);
    }
    ddp.finalize();
    const auto& st = ddp.last_iteration();
    const double lead_ms =
        std::chrono::duration<double, std::milli>(st.last_mark - st.bucket_launch[0]).count();
    std::printf(
        "OVERLAP iter %d: first bucket launched %.1f ms before the last mark; %zu of %zu "
        "buckets done by then\n",
        iter, lead_ms, st.buckets_done_at_last_mark, ddp.buckets().size());
    if (!(st.bucket_launch[0] < st.last_mark)) return fail("first bucket not launched early");
    if (st.buckets_done_at_last_mark < 1) return fail("no bucket completed during backward");
    const double mean_rank = (pg.size() - 1) / 2.0;
    for (size_t i = 0; i < kParams; ++i) {
      const float* g = ddp.grad_as<float>(i);
      for (size_t k = 0; k < kNumel; k += 997) {
        const double want = mean_rank + static_cast<double>(i) + static_cast<double>(k % 7);
        if (std::fabs(g[k] - want) > 1e-5)
          return fail("param " + std::to_string(i) + "[" + std::to_string(k) +
                      "] = " + std::to_string(g[k]) + ", want " + std::to_string(want));
      }
    }
  }
  std::printf("PASS overlap\n");
  return 0;
}

int errors(ProcessGroup& pg) {
  std::vector<float> a(100), b(50), c(10);
  auto make_params = [&] {
    return std::vector<Parameter>{{"fc.weight", a.data(), a.size()},
                                  {"fc.bias", b.data(), b.size()},
                                  {"head", c.data(), c.size()}};
  };
  DdpOptions small;
  small.bucket_cap_mb = 0.0002;  // ~200 bytes: several small buckets
  small.first_bucket_cap_mb = 0.0002;
  {
    DistributedDataParallel ddp(pg, make_params(), small);
    ddp.mark_ready(2);
    try {
      ddp.mark_ready(2);
      return fail("marking twice did not throw");
    } catch (const DdpError& e) {
      std::printf("double mark: %s\n", e.what());
      if (!std::strstr(e.what(), "'head'") || !std::strstr(e.what(), "twice"))
        return fail("double-mark message lacks the name: " + std::string(e.what()));
    }
    try {
      ddp.mark_ready(0);
      return fail("a broken reducer accepted a call");
    } catch (const DdpError&) {
    }
  }
  pg.barrier();
  {
    DistributedDataParallel ddp(pg, make_params(), small);
    ddp.mark_ready(2);
    ddp.mark_ready(1);  // parameter 0 never marked
    try {
      ddp.finalize();
      return fail("finalize with a missing gradient did not throw");
    } catch (const DdpError& e) {
      std::printf("incomplete: %s\n", e.what());
      if (!std::strstr(e.what(), "'fc.weight'") || !std::strstr(e.what(), "find_unused"))
        return fail("incomplete-bucket message lacks the name: " + std::string(e.what()));
    }
  }
  pg.barrier();
  {
    DdpOptions opt = small;
    opt.find_unused_parameters = true;
    DistributedDataParallel ddp(pg, make_params(), opt);
    for (int iter = 0; iter < 2; ++iter) {
      ddp.zero_grad();
      for (size_t i = 3; i-- > 0;) {
        if (pg.rank() == 0 && i == 1) {
          // Unused here: leave garbage in the slot; the reducer must zero it.
          ddp.grad_as<float>(1)[0] = 12345.0f;
          continue;
        }
        float* g = ddp.grad_as<float>(i);
        for (size_t k = 0; k < ddp.parameter(i).numel; ++k) g[k] = 1.0f + pg.rank();
        ddp.mark_ready(i);
      }
      ddp.finalize();
      const float want_used = 1.0f + (pg.size() - 1) / 2.0f;
      const float want_1 = pg.size() == 1 ? 0.0f : [&] {
        float s = 0;
        for (int r = 1; r < pg.size(); ++r) s += 1.0f + r;
        return s / pg.size();
      }();
      if (std::fabs(ddp.grad_as<float>(0)[0] - want_used) > 1e-6)
        return fail("used parameter average wrong: " + std::to_string(ddp.grad_as<float>(0)[0]));
      if (std::fabs(ddp.grad_as<float>(1)[0] - want_1) > 1e-6)
        return fail("partly unused parameter average wrong: " +
                    std::to_string(ddp.grad_as<float>(1)[0]) + ", want " + std::to_string(want_1));
      auto unused = ddp.unused_parameters();
      const bool expect = pg.rank() == 0;
      if (expect != (unused.size() == 1 && unused[0] == 1))
        return fail("unused_parameters() wrong on rank " + std::to_string(pg.rank()));
    }
  }
  std::printf("PASS errors\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  try {
    InitOptions io;
    io.backend = Backend::kCpu;
    io.timeout = std::chrono::seconds(60);
    Worker w = init(io);
    const std::string mode = argv[1];
    int rc = 2;
    if (mode == "train")
      rc = train(w.process_group(), argc, argv);
    else if (mode == "overlap")
      rc = overlap(w.process_group());
    else if (mode == "errors")
      rc = errors(w.process_group());
    std::fflush(stdout);
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "unexpected exception: %s\n", e.what());
    return 3;
  }
}
