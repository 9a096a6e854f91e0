// A rank program for the DDP tests (launched by tests/worker_sdk/ddp/ddp_test.cpp through the
// launcher environment):
//
//   ddp_worker train STEPS BATCH CAP_MB FIRST_CAP_MB ACCUM OUT [FLAGS]
//       trains examples/train_mlp's MLP (10,32,32,5) with DDP; ranks start from different
//       weights (DDP must broadcast rank 0's); ACCUM micro-batches per step, all but the last
//       under no_sync; after every step the parameters' CRC32C is allgathered and must be equal
//       on every rank; rank 0 writes the final parameters (float32, concatenated) to OUT.
//       FLAGS (comma-separated): "static" registers the tensors in a shuffled order and sets
//       static_graph (gradients then arrive in non-registration order; checks that the buckets
//       follow the arrival order after step 1 and not before), "fp16" / "bf16" register the
//       compression hook.
//   ddp_worker join COUNTS BATCH OUT [FLAGS]
//       the same MLP with uneven inputs: rank r has COUNTS[r] (comma-separated) batches per
//       round, 2 rounds, plain SGD, a join_iteration() per step; checks that every rank leaves
//       the loop in the same call and ends with the same parameters; rank 0 writes them to OUT.
//       FLAGS as for train, plus "initial" (join_divide_by_initial_world_size), "userhook" (a
//       hook that sums and divides by GradBucket::divisor, and checks each step's divisor and
//       joined flag), and "throw"
//       (join_throw_on_early_termination: every rank must get DdpError in the call of the
//       step after the smallest count, and nothing is written).
//   ddp_worker hooks
//       fp16 and bf16 compression against the plain average (within the 16-bit types' rounding,
//       and the results are representable in them), a user hook (called once per bucket per
//       iteration with the bucket's local gradients, its parameters and divisor), and
//       registering twice is a DdpError.
//   ddp_worker join_peer_dies
//       2 ranks, 5 s collective deadline: rank 0 has no data and shadows; rank 1 trains one step,
//       then exits with 7 in the middle of the second (after its join_iteration, before
//       finalize). Rank 0's join_iteration() must fail with CollectiveError (no hang): it prints
//       the error and "PASS join_peer_dies".
//   ddp_worker hook_dump OUT N
//       one parameter of N floats, rank r's gradient value(r, k) (the formula of
//       ddp_hooks_torch.py); rank 0 writes the reduced gradient without a hook, with
//       fp16_compress_hook and with bf16_compress_hook to OUT.none, OUT.fp16, OUT.bf16.
//   ddp_worker powersgd
//       powersgd_hook on matrices whose gradients have rank 2 (every rank a different mix of the
//       same two outer products): at rank 2 the result equals the plain average, before and after
//       start_powersgd_iter, and a matrix the compression-rate rule skips is averaged exactly; at
//       rank 1 each result is rank 1 and the same on every rank, and with error feedback the
//       mean over iterations of a constant gradient converges to its average.
//   ddp_worker static_order
//       static_graph with ranks marking in different orders: every rank rebuilds in rank 0's
//       order; averages stay right; find_unused_parameters' first-iteration unused set is kept,
//       and marking such a parameter later is a DdpError.
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

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <thread>
#include <vector>

#include <trun/checkpoint.h>
#include <trun/ddp.h>
#include <trun/sampler.h>
#include <trun/worker.h>

#include "examples/train_mlp/mlp.h"

using namespace trun::worker;
using trun::examples::Mlp;
using trun::examples::Sgd;

namespace {

int fail(const std::string& msg) {
  std::fprintf(stderr, "CHECK FAILED: %s\n", msg.c_str());
  return 1;
}

// Runs `call`, which must throw E whose message contains every one of `needles`; prints it as
// "label: message". Returns the check that failed ("" when it held): the caller fails with it.
template <class E, class F>
std::string expect_error(const char* label, F&& call, std::initializer_list<std::string> needles,
                         const char* not_thrown) {
  try {
    call();
  } catch (const E& e) {
    std::printf("%s: %s\n", label, e.what());
    for (const auto& needle : needles) {
      if (!std::strstr(e.what(), needle.c_str()))
        return std::string(label) + ": the message lacks '" + needle + "': " + e.what();
    }
    return "";
  }
  return not_thrown;
}

bool has_flag(const std::string& flags, const std::string& name) {
  return ("," + flags + ",").find("," + name + ",") != std::string::npos;
}

// The MLP's tensors registered with DDP, in registration order `perm` (DDP index j is model
// tensor perm[j]); model tensor i is DDP index inv[i].
struct Registered {
  std::vector<size_t> perm, inv;
  std::vector<float*> grads;  // per model tensor, refreshed by refresh()
  std::vector<const float*> cgrads;

  Registered(Mlp& model, bool shuffled) {
    const size_t n = model.num_params();
    for (size_t i = 0; i < n; ++i) perm.push_back(i);
    if (shuffled)  // a fixed shuffle, neither registration nor reverse order
      for (size_t i = 0; i + 2 < n; i += 3) std::swap(perm[i], perm[i + 2]);
    inv.assign(n, 0);
    for (size_t j = 0; j < n; ++j) inv[perm[j]] = j;
  }
  std::vector<Parameter> params(Mlp& model) const {
    std::vector<Parameter> out;
    for (size_t j = 0; j < perm.size(); ++j)
      out.push_back({model.param_name(perm[j]), model.param(perm[j]), model.param_numel(perm[j])});
    return out;
  }
  // grad(i) views move when static_graph rebuilds the buckets: fetch them again.
  void refresh(DistributedDataParallel& ddp) {
    grads.clear();
    cgrads.clear();
    for (size_t i = 0; i < inv.size(); ++i) {
      grads.push_back(ddp.grad_as<float>(inv[i]));
      cgrads.push_back(grads.back());
    }
  }
};

std::vector<size_t> flat_bucket_order(const DistributedDataParallel& ddp) {
  std::vector<size_t> out;
  for (const auto& b : ddp.buckets()) out.insert(out.end(), b.params.begin(), b.params.end());
  return out;
}

void register_flag_hook(DistributedDataParallel& ddp, const std::string& flags) {
  if (has_flag(flags, "fp16")) ddp.register_comm_hook(fp16_compress_hook());
  if (has_flag(flags, "bf16")) ddp.register_comm_hook(bf16_compress_hook());
}

// static_graph: before the first finalize the buckets are in reverse registration order, after
// it in the order the gradients arrived (model tensors last to first, as DDP indices).
int check_rebuild(const DistributedDataParallel& ddp, const Registered& reg, bool after) {
  std::vector<size_t> arrival, reverse;
  for (size_t i = reg.inv.size(); i-- > 0;) {
    arrival.push_back(reg.inv[i]);
    reverse.push_back(i);
  }
  const auto got = flat_bucket_order(ddp);
  if (got != (after ? arrival : reverse))
    return fail(std::string("bucket order ") + (after ? "after" : "before") +
                " the first iteration is not the " + (after ? "arrival" : "reverse registration") +
                " order");
  if (arrival == reverse) return fail("the shuffle did not change the arrival order");
  return 0;
}

int check_same_everywhere(ProcessGroup& pg, const Mlp& model, const std::string& when) {
  uint32_t crc = 0;
  for (size_t i = 0; i < model.num_params(); ++i)
    crc = crc32c(model.param(i), model.param_numel(i) * sizeof(float), crc);
  int64_t mine = crc;
  std::vector<int64_t> crcs(pg.size());
  pg.allgather(&mine, crcs.data(), 1, DataType::kInt64);
  for (int r = 0; r < pg.size(); ++r)
    if (crcs[r] != mine)
      return fail(when + ": parameters differ between rank " + std::to_string(pg.rank()) +
                  " and rank " + std::to_string(r));
  return 0;
}

int write_params(ProcessGroup& pg, const Mlp& model, const std::string& out) {
  if (pg.rank() != 0) return 0;
  std::FILE* f = std::fopen(out.c_str(), "wb");
  if (!f) return fail("cannot write " + out);
  for (size_t i = 0; i < model.num_params(); ++i)
    std::fwrite(model.param(i), sizeof(float), model.param_numel(i), f);
  std::fclose(f);
  return 0;
}

int train(ProcessGroup& pg, int argc, char** argv) {
  if (argc != 8 && argc != 9) return 2;
  const int steps = std::atoi(argv[2]);
  const size_t batch = std::strtoul(argv[3], nullptr, 10);
  DdpOptions opt;
  opt.bucket_cap_mb = std::atof(argv[4]);
  opt.first_bucket_cap_mb = std::atof(argv[5]);
  const int accum = std::atoi(argv[6]);
  const std::string out = argv[7];
  const std::string flags = argc == 9 ? argv[8] : "";
  const bool shuffled = has_flag(flags, "static");
  opt.static_graph = shuffled;

  Mlp model({10, 32, 32, 5});
  model.init(100 + static_cast<uint64_t>(pg.rank()));
  Registered reg(model, shuffled);
  DistributedDataParallel ddp(pg, reg.params(model), opt);
  register_flag_hook(ddp, flags);
  std::printf("buckets %zu\n", ddp.buckets().size());
  if (shuffled)
    if (int rc = check_rebuild(ddp, reg, false)) return rc;
  SamplerOptions so;
  so.seed = 3;
  DistributedSampler sampler(512, pg.rank(), pg.size(), so);
  Sgd sgd(0.05f, 0.5f);
  std::vector<float> x, t;
  auto mark = [&](size_t i) { ddp.mark_ready(reg.inv[i]); };
  for (int s = 0; s < steps; ++s) {
    ddp.zero_grad();
    for (int m = 0; m < accum; ++m) {
      auto idx = sampler.next_batch(batch);
      if (idx.size() != batch) return fail("sampler ran out of samples");
      model.make_batch(idx, x, t);
      model.forward(x.data(), t.data(), idx.size());
      reg.refresh(ddp);
      if (m + 1 < accum) {
        auto guard = ddp.no_sync();
        model.backward(reg.grads, mark, 1.0f / static_cast<float>(accum));
        ddp.finalize();
      } else {
        model.backward(reg.grads, mark, 1.0f / static_cast<float>(accum));
        ddp.finalize();
      }
    }
    reg.refresh(ddp);
    sgd.step(model, reg.cgrads);
    if (shuffled && s == 0)
      if (int rc = check_rebuild(ddp, reg, true)) return rc;
    if (int rc = check_same_everywhere(pg, model, "step " + std::to_string(s))) return rc;
  }
  if (int rc = write_params(pg, model, out)) return rc;
  std::printf("PASS train\n");
  return 0;
}

int join(ProcessGroup& pg, int argc, char** argv) {
  if (argc != 5 && argc != 6) return 2;
  std::vector<int> counts;
  for (const char* p = argv[2]; *p;) {
    char* end = nullptr;
    counts.push_back(static_cast<int>(std::strtol(p, &end, 10)));
    if (end == p) return 2;
    p = *end == ',' ? end + 1 : end;
  }
  if (counts.size() != static_cast<size_t>(pg.size())) return fail("COUNTS needs one per rank");
  const size_t batch = std::strtoul(argv[3], nullptr, 10);
  const std::string out = argv[4];
  const std::string flags = argc == 6 ? argv[5] : "";
  DdpOptions opt;
  opt.bucket_cap_mb = 0.002;  // several buckets
  opt.first_bucket_cap_mb = 0.001;
  opt.static_graph = has_flag(flags, "static");
  opt.join_divide_by_initial_world_size = has_flag(flags, "initial");
  opt.join_throw_on_early_termination = has_flag(flags, "throw");

  Mlp model({10, 32, 32, 5});
  model.init(100 + static_cast<uint64_t>(pg.rank()));
  Registered reg(model, opt.static_graph);
  DistributedDataParallel ddp(pg, reg.params(model), opt);
  register_flag_hook(ddp, flags);
  std::vector<std::pair<int, bool>> seen;  // (divisor, joined) per hook launch
  if (has_flag(flags, "userhook"))
    ddp.register_comm_hook(make_comm_hook(
        [&](GradBucket& b) {
          seen.emplace_back(b.divisor, b.joined);
          return b.group->allreduce_async(b.data, b.numel, b.dtype, ReduceOp::kSum, b.timeout);
        },
        [](GradBucket& b) {
          float* g = static_cast<float*>(b.data);
          for (size_t k = 0; k < b.numel; ++k) g[k] /= static_cast<float>(b.divisor);
        },
        "join checker"));
  Sgd sgd(0.05f, 0.0f);  // no momentum: a rank that joined early has stale optimizer state
  std::vector<float> x, t;
  std::vector<uint64_t> idx(batch);
  const int world = pg.size(), mine = counts[pg.rank()];
  const int most = *std::max_element(counts.begin(), counts.end());
  auto mark = [&](size_t i) { ddp.mark_ready(reg.inv[i]); };
  if (opt.join_throw_on_early_termination) {
    const int fewest = *std::min_element(counts.begin(), counts.end());
    for (int trained = 0; trained <= most; ++trained) {
      const bool have = trained < mine;
      try {
        if (!ddp.join_iteration(have)) return fail("join_iteration() returned false");
      } catch (const DdpError& e) {
        std::printf("early termination at step %d: %s\n", trained, e.what());
        if (trained != fewest) return fail("DdpError at the wrong step");
        if (!std::strstr(e.what(), "ran out of input")) return fail("unclear message");
        std::printf("PASS join\n");
        return 0;
      }
      if (trained == fewest) return fail("no DdpError when a rank ran out of input");
      for (size_t k = 0; k < batch; ++k) idx[k] = (trained * world + pg.rank()) * batch + k;
      model.make_batch(idx, x, t);
      model.forward(x.data(), t.data(), batch);
      ddp.zero_grad();
      reg.refresh(ddp);
      model.backward(reg.grads, mark);
      ddp.finalize();
    }
    return fail("the loop ended without DdpError");
  }
  for (int round = 0; round < 2; ++round) {
    int trained = 0, calls = 0;
    // Bounded: the other ranks' steps plus the final call.
    for (; calls <= most + 1; ++calls) {
      const bool have = trained < mine;
      if (!ddp.join_iteration(have)) break;
      if (!have) return fail("join_iteration(false) returned true");
      for (size_t k = 0; k < batch; ++k)
        idx[k] = (static_cast<uint64_t>(round * most + trained) * world + pg.rank()) * batch + k;
      model.make_batch(idx, x, t);
      model.forward(x.data(), t.data(), batch);
      ddp.zero_grad();
      reg.refresh(ddp);
      model.backward(reg.grads, mark);
      ddp.finalize();
      reg.refresh(ddp);
      sgd.step(model, reg.cgrads);
      ++trained;
    }
    if (trained != mine)
      return fail("round " + std::to_string(round) + ": trained " + std::to_string(trained) +
                  " of " + std::to_string(mine) + " batches");
    if (has_flag(flags, "userhook")) {
      const size_t nb = ddp.buckets().size();
      if (seen.size() != nb * static_cast<size_t>(most))
        return fail("hook launched " + std::to_string(seen.size()) + " times, want " +
                    std::to_string(nb * most));
      for (int s = 0; s < most; ++s) {
        int active = 0;
        for (int c : counts) active += s < c;
        for (size_t b = 0; b < nb; ++b) {
          const auto [divisor, joined] = seen[s * nb + b];
          if (divisor != active || joined != (s >= mine))
            return fail("step " + std::to_string(s) + ": hook saw divisor " +
                        std::to_string(divisor) + (joined ? ", joined" : "") + "; want " +
                        std::to_string(active) + (s >= mine ? ", joined" : ""));
        }
      }
      seen.clear();
    }
    // Every rank leaves in the call after its last batch: the loop count is the same for all.
    int64_t left = calls, most_left = calls;
    pg.allreduce(&most_left, 1, DataType::kInt64, ReduceOp::kMax);
    std::printf("round %d: trained %d, left after %d calls\n", round, trained, calls);
    if (left != mine) return fail("left the loop after " + std::to_string(calls) + " calls");
    if (most_left != most) return fail("the longest rank did not run every step");
    if (int rc = check_same_everywhere(pg, model, "round " + std::to_string(round))) return rc;
  }
  if (int rc = write_params(pg, model, out)) return rc;
  std::printf("PASS join\n");
  return 0;
}

bool fp16_exact(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u & 0x1fffu) == 0;  // 10 explicit mantissa bits (normal and subnormal halves)
}
bool bf16_exact(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u & 0xffffu) == 0;
}

int hooks(ProcessGroup& pg) {
  const std::vector<size_t> sizes = {1000, 37, 513, 5, 260};
  std::vector<std::vector<float>> data;
  for (size_t n : sizes) data.emplace_back(n, 0.0f);
  auto make_params = [&] {
    std::vector<Parameter> p;
    for (size_t i = 0; i < sizes.size(); ++i)
      p.push_back({"p" + std::to_string(i), data[i].data(), sizes[i]});
    return p;
  };
  DdpOptions opt;
  opt.bucket_cap_mb = 0.002;  // ~2 KB: 3 buckets, {p4, p3}, {p2, p1}, {p0}
  opt.first_bucket_cap_mb = 0.001;
  const int world = pg.size();
  auto value = [&](int rank, size_t i, size_t k, int iter) {
    return static_cast<float>(std::sin(0.1 * k + i + 0.7 * rank + iter) * (1.0 + i) * 3.0);
  };
  auto fill = [&](DistributedDataParallel& ddp, int iter) {
    ddp.zero_grad();
    for (size_t i = sizes.size(); i-- > 0;) {
      float* g = ddp.grad_as<float>(i);
      for (size_t k = 0; k < sizes[i]; ++k) g[k] = value(pg.rank(), i, k, iter);
      ddp.mark_ready(i);
    }
    ddp.finalize();
  };
  // The plain average, for reference.
  std::vector<std::vector<float>> ref(2);
  {
    DistributedDataParallel plain(pg, make_params(), opt);
    for (int iter = 0; iter < 2; ++iter) {
      fill(plain, iter);
      for (size_t i = 0; i < sizes.size(); ++i)
        ref[iter].insert(ref[iter].end(), plain.grad_as<float>(i),
                         plain.grad_as<float>(i) + sizes[i]);
    }
  }
  struct Compressed {
    const char* name;
    std::shared_ptr<CommHook> hook;
    double eps;  // unit roundoff
    bool (*exact)(float);
  };
  const Compressed kinds[] = {{"fp16", fp16_compress_hook(), std::ldexp(1.0, -11), fp16_exact},
                              {"bf16", bf16_compress_hook(), std::ldexp(1.0, -8), bf16_exact}};
  for (const auto& kind : kinds) {
    DistributedDataParallel ddp(pg, make_params(), opt);
    ddp.register_comm_hook(kind.hook);
    for (int iter = 0; iter < 2; ++iter) {
      fill(ddp, iter);
      size_t flat = 0, inexact = 0;
      double worst = 0;
      for (size_t i = 0; i < sizes.size(); ++i) {
        const float* g = ddp.grad_as<float>(i);
        // The largest local gradient of any rank bounds every share and partial sum.
        double max_abs = 0;
        for (int r = 0; r < world; ++r)
          for (size_t k = 0; k < sizes[i]; ++k)
            max_abs = std::max(max_abs, std::fabs(double(value(r, i, k, iter))));
        // Each rank's share is rounded twice (the cast, then the division), each time by at
        // most eps * max_abs / world, and the running sum (|sum| <= max_abs) once per added
        // rank: at most (world + 1) * eps * max_abs in all.
        const double tol = (world + 1) * kind.eps * max_abs;
        for (size_t k = 0; k < sizes[i]; ++k, ++flat) {
          const double d = std::fabs(double(g[k]) - ref[iter][flat]);
          worst = std::max(worst, d / max_abs);
          if (d > tol)
            return fail(std::string(kind.name) + " param " + std::to_string(i) + "[" +
                        std::to_string(k) + "] = " + std::to_string(g[k]) + ", average " +
                        std::to_string(ref[iter][flat]) + " (tolerance " + std::to_string(tol) +
                        ")");
          if (!kind.exact(g[k])) ++inexact;
        }
      }
      std::printf("%s iter %d: worst error %.2e of the bucket's largest value\n", kind.name, iter,
                  worst);
      if (inexact > 0)
        return fail(std::string(kind.name) + ": " + std::to_string(inexact) +
                    " results are not representable in the 16-bit type: no compression happened");
    }
  }
  // A user hook: sum, then divide by the divisor; it records what it was handed.
  struct Call {
    size_t index;
    std::vector<size_t> params;
    std::vector<size_t> offsets;
    int divisor;
    bool joined;
    bool contents_ok;
  };
  std::vector<Call> calls;
  int finishes = 0;
  int iter_now = 0;
  auto launch = [&](GradBucket& b) {
    bool ok = b.numel > 0 && b.dtype == DataType::kFloat32 && b.device == Device::kCpu;
    for (size_t j = 0; j < b.params->size(); ++j) {
      const size_t i = (*b.params)[j];
      const float* g =
          reinterpret_cast<const float*>(static_cast<unsigned char*>(b.data) + (*b.offsets)[j]);
      for (size_t k = 0; k < sizes[i]; ++k) ok = ok && g[k] == value(pg.rank(), i, k, iter_now);
    }
    calls.push_back({b.index, *b.params, *b.offsets, b.divisor, b.joined, ok});
    return b.group->allreduce_async(b.data, b.numel, b.dtype, ReduceOp::kSum, b.timeout);
  };
  auto finish = [&](GradBucket& b) {
    ++finishes;
    float* g = static_cast<float*>(b.data);
    for (size_t k = 0; k < b.numel; ++k) g[k] /= static_cast<float>(b.divisor);
  };
  {
    DistributedDataParallel ddp(pg, make_params(), opt);
    ddp.register_comm_hook(make_comm_hook(launch, finish, "recording"));
    const std::string second = expect_error<DdpError>(
        "second hook", [&] { ddp.register_comm_hook(fp16_compress_hook()); }, {"once", "recording"},
        "a second register_comm_hook did not throw");
    if (!second.empty()) return fail(second);
    const auto& buckets = ddp.buckets();
    if (buckets.size() < 3) return fail("expected several buckets");
    for (int iter = 0; iter < 2; ++iter) {
      iter_now = iter;
      calls.clear();
      finishes = 0;
      fill(ddp, iter);
      if (calls.size() != buckets.size() || finishes != static_cast<int>(buckets.size()))
        return fail("hook called " + std::to_string(calls.size()) + " times (finish " +
                    std::to_string(finishes) + ") for " + std::to_string(buckets.size()) +
                    " buckets");
      for (size_t b = 0; b < calls.size(); ++b) {
        const Call& c = calls[b];
        if (c.index != b) return fail("buckets not handed to the hook in order");
        if (c.params != buckets[b].params) return fail("hook saw the wrong parameters");
        if (c.divisor != world || c.joined) return fail("hook saw the wrong divisor");
        if (!c.contents_ok) return fail("hook did not see this rank's local gradients");
        for (size_t j = 0; j < c.params.size(); ++j)
          if (static_cast<unsigned char*>(ddp.grad(c.params[j])) !=
              static_cast<unsigned char*>(ddp.grad(c.params[0])) + c.offsets[j] - c.offsets[0])
            return fail("hook offsets do not match grad()");
      }
      size_t flat = 0;
      for (size_t i = 0; i < sizes.size(); ++i)
        for (size_t k = 0; k < sizes[i]; ++k, ++flat)
          if (std::fabs(ddp.grad_as<float>(i)[k] - ref[iter][flat]) >
              1e-5 * (1 + std::fabs(ref[iter][flat])))
            return fail("user hook result differs from the average");
    }
  }
  // A hook that throws breaks the reducer with a message naming it.
  {
    DistributedDataParallel ddp(pg, make_params(), opt);
    ddp.register_comm_hook(make_comm_hook(
        [](GradBucket&) -> Work { throw std::runtime_error("boom"); }, {}, "throwing"));
    const std::string thrown = expect_error<DdpError>(
        "throwing hook",
        [&] {
          ddp.mark_ready(4);
          ddp.mark_ready(3);  // completes the first bucket
        },
        {"throwing", "boom"}, "a throwing hook did not surface");
    if (!thrown.empty()) return fail(thrown);
  }
  std::printf("PASS hooks\n");
  return 0;
}

int join_peer_dies(ProcessGroup& pg) {
  if (pg.size() != 2) return 2;
  std::vector<float> a(1000, 1.0f), b(10, 2.0f);
  DdpOptions opt;
  opt.timeout = std::chrono::seconds(5);
  DistributedDataParallel ddp(pg, {{"a", a.data(), a.size()}, {"b", b.data(), b.size()}}, opt);
  if (pg.rank() == 1) {
    for (int step = 0; step < 2; ++step) {
      if (!ddp.join_iteration(true)) return fail("join_iteration(true) returned false");
      ddp.zero_grad();
      ddp.mark_ready(1);
      if (step == 1) {
        std::fflush(stdout);
        ::_exit(7);  // dies with a bucket launched and one gradient missing
      }
      ddp.mark_ready(0);
      ddp.finalize();
    }
    return fail("unreachable");
  }
  const auto t0 = std::chrono::steady_clock::now();
  try {
    ddp.join_iteration(false);
    return fail("join_iteration(false) returned although the peer died");
  } catch (const CollectiveError& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("shadowing rank: %s (after %.1f s)\n", e.what(), s);
  }
  std::printf("PASS join_peer_dies\n");
  std::fflush(stdout);
  return 0;
}

int hook_dump(ProcessGroup& pg, int argc, char** argv) {
  if (argc != 4) return 2;
  const std::string out = argv[2];
  const size_t n = std::strtoul(argv[3], nullptr, 10);
  std::vector<float> w(n, 0.0f);
  const std::pair<const char*, std::shared_ptr<CommHook>> kinds[] = {
      {"none", nullptr}, {"fp16", fp16_compress_hook()}, {"bf16", bf16_compress_hook()}};
  for (const auto& [name, hook] : kinds) {
    DistributedDataParallel ddp(pg, {{"w", w.data(), n}});
    if (hook) ddp.register_comm_hook(hook);
    ddp.zero_grad();
    float* g = ddp.grad_as<float>(0);
    for (size_t k = 0; k < n; ++k)
      g[k] = static_cast<float>(static_cast<double>(static_cast<int>(k % 251) - 125) *
                                (pg.rank() + 1.5) / 13.0 *
                                std::ldexp(1.0, static_cast<int>(k % 20) - 14));
    ddp.mark_ready(0);
    ddp.finalize();
    if (pg.rank() == 0) {
      std::FILE* f = std::fopen((out + "." + name).c_str(), "wb");
      if (!f) return fail("cannot write " + out);
      std::fwrite(g, sizeof(float), n, f);
      std::fclose(f);
    }
  }
  std::printf("PASS hook_dump\n");
  return 0;
}

int powersgd(ProcessGroup& pg) {
  // Parameters: A 6x5, a bias of 7, B 8x6, C 4x4 (skipped at rate 1, rank 2: 16 >= 16).
  struct Shape {
    size_t rows, cols;
  };
  const std::vector<Shape> shapes = {{6, 5}, {7, 1}, {8, 6}, {4, 4}};
  std::vector<std::vector<float>> data;
  std::vector<Parameter> params;
  for (size_t i = 0; i < shapes.size(); ++i) {
    data.emplace_back(shapes[i].rows * shapes[i].cols, 0.0f);
    params.push_back({"m" + std::to_string(i), data[i].data(), data[i].size()});
  }
  const int world = pg.size();
  // value = sum_t c(rank, t, iter) u_t[i] v_t[j]: rank 2 for every rank and for the average.
  auto coeff = [](int rank, int t, int iter) {
    return t == 0 ? 1.0 + 0.5 * rank + 0.1 * iter : (0.6 - 0.3 * rank) * (1.0 + 0.05 * iter);
  };
  auto value = [&](int rank, size_t p, size_t i, size_t j, int iter) {
    if (shapes[p].cols == 1) return static_cast<float>(0.3 * i - rank + iter);
    double v = 0;
    for (int t = 0; t < 2; ++t)
      v += coeff(rank, t, iter) * std::sin(1.0 + i * (t + 1) + p) * std::cos(0.5 * j * (t + 2) + p);
    return static_cast<float>(v);
  };
  auto fill = [&](DistributedDataParallel& ddp, int iter) {
    ddp.zero_grad();
    for (size_t p = shapes.size(); p-- > 0;) {
      float* g = ddp.grad_as<float>(p);
      for (size_t i = 0; i < shapes[p].rows; ++i)
        for (size_t j = 0; j < shapes[p].cols; ++j)
          g[i * shapes[p].cols + j] = value(pg.rank(), p, i, j, iter);
      ddp.mark_ready(p);
    }
    ddp.finalize();
  };
  auto average = [&](size_t p, size_t i, size_t j, int iter) {
    double s = 0;
    for (int r = 0; r < world; ++r) s += value(r, p, i, j, iter);
    return s / world;
  };
  PowerSgdOptions po;
  po.matrix_approximation_rank = 2;
  po.start_powersgd_iter = 2;
  po.min_compression_rate = 1;
  po.seed = 11;
  for (size_t p = 0; p < shapes.size(); ++p) po.matrix_shapes[p] = {shapes[p].rows, shapes[p].cols};
  DdpOptions opt;
  opt.bucket_cap_mb = 0.0003;  // several buckets
  opt.first_bucket_cap_mb = 0.0003;
  {
    DistributedDataParallel ddp(pg, params, opt);
    ddp.register_comm_hook(powersgd_hook(po));
    for (int iter = 0; iter < 5; ++iter) {
      fill(ddp, iter);
      for (size_t p = 0; p < shapes.size(); ++p) {
        double worst = 0, scale = 0;
        for (size_t i = 0; i < shapes[p].rows; ++i)
          for (size_t j = 0; j < shapes[p].cols; ++j) {
            const double want = average(p, i, j, iter);
            scale = std::max(scale, std::fabs(want));
            worst =
                std::max(worst, std::fabs(ddp.grad_as<float>(p)[i * shapes[p].cols + j] - want));
          }
        if (worst > 1e-4 * scale)
          return fail("powersgd rank 2, iteration " + std::to_string(iter) + ": m" +
                      std::to_string(p) + " differs from the average by " + std::to_string(worst) +
                      " (scale " + std::to_string(scale) + ")");
      }
    }
  }
  // Rank 1, constant gradients (iteration 0's), 60 iterations after 2 plain ones.
  po.matrix_approximation_rank = 1;
  {
    DistributedDataParallel ddp(pg, params, opt);
    ddp.register_comm_hook(powersgd_hook(po));
    const size_t p = 2;  // B, 8 x 6
    const size_t rows = shapes[p].rows, cols = shapes[p].cols;
    std::vector<double> sum(rows * cols, 0.0);
    double first_err = 0, scale = 0;
    const int iters = 60;
    for (int iter = 0; iter < 2 + iters; ++iter) {
      fill(ddp, 0);
      if (iter < 2) continue;
      const float* g = ddp.grad_as<float>(p);
      // Rank 1: every 2x2 minor vanishes.
      double minor = 0, big = 0;
      for (size_t i = 1; i < rows; ++i)
        for (size_t j = 1; j < cols; ++j) {
          minor = std::max(minor,
                           std::fabs(double(g[0]) * g[i * cols + j] - double(g[j]) * g[i * cols]));
          big = std::max(big, std::fabs(double(g[i * cols + j])));
        }
      if (minor > 1e-4 * big * big) return fail("powersgd rank 1: B's result is not rank 1");
      uint32_t crc = crc32c(g, rows * cols * sizeof(float));
      int64_t mine = crc;
      std::vector<int64_t> all(world);
      pg.allgather(&mine, all.data(), 1, DataType::kInt64);
      for (int r = 0; r < world; ++r)
        if (all[r] != mine) return fail("powersgd rank 1: results differ between ranks");
      double err = 0;
      for (size_t k = 0; k < rows * cols; ++k) {
        sum[k] += g[k];
        const double want = average(p, k / cols, k % cols, 0);
        if (iter == 2) {
          scale = std::max(scale, std::fabs(want));
          first_err = std::max(first_err, std::fabs(g[k] - want));
        }
        err = std::max(err, std::fabs(sum[k] / (iter - 1) - want));
      }
      if (iter + 1 == 2 + iters) {
        std::printf(
            "powersgd rank 1: one iteration off by %.3g, mean of %d off by %.3g (scale %.3g)\n",
            first_err, iters, err, scale);
        if (!(first_err > 0.05 * scale))
          return fail("rank 1 was not lossy: the test proves nothing");
        if (!(err < 0.2 * first_err)) return fail("error feedback did not converge");
      }
    }
  }
  try {
    PowerSgdOptions bad = po;
    bad.start_powersgd_iter = 1;
    (void)powersgd_hook(bad);
    return fail("start_powersgd_iter 1 with error feedback accepted");
  } catch (const std::invalid_argument& e) {
    std::printf("bad options: %s\n", e.what());
  }
  std::printf("PASS powersgd\n");
  return 0;
}

int static_order(ProcessGroup& pg) {
  const size_t n = 6, numel = 40;  // 160 bytes each
  std::vector<std::vector<float>> data(n, std::vector<float>(numel, 0.0f));
  std::vector<Parameter> params;
  for (size_t i = 0; i < n; ++i) params.push_back({"q" + std::to_string(i), data[i].data(), numel});
  DdpOptions opt;
  opt.bucket_cap_mb = 0.0003;  // ~315 bytes: two parameters per bucket
  opt.first_bucket_cap_mb = 0.0003;
  opt.static_graph = true;
  opt.find_unused_parameters = true;
  DistributedDataParallel ddp(pg, params, opt);
  // Rank 0 marks 1,3,5,0,2 (4 unused); the others the reverse of that.
  std::vector<size_t> order = {1, 3, 5, 0, 2};
  if (pg.rank() != 0) std::reverse(order.begin(), order.end());
  const double mean_rank = (pg.size() - 1) / 2.0;
  for (int iter = 0; iter < 3; ++iter) {
    ddp.zero_grad();
    if (iter > 0) ddp.grad_as<float>(4)[0] = 777.0f;  // garbage in the unused slot
    for (size_t i : order) {
      float* g = ddp.grad_as<float>(i);
      for (size_t k = 0; k < numel; ++k) g[k] = static_cast<float>(pg.rank() + 10 * i + k);
      ddp.mark_ready(i);
    }
    ddp.finalize();
    for (size_t i : order)
      for (size_t k = 0; k < numel; ++k)
        if (std::fabs(ddp.grad_as<float>(i)[k] - (mean_rank + 10.0 * i + k)) > 1e-4)
          return fail("iteration " + std::to_string(iter) + ": wrong average for q" +
                      std::to_string(i));
    if (ddp.grad_as<float>(4)[0] != 0.0f) return fail("unused q4's gradient is not zero");
    const auto unused = ddp.unused_parameters();
    if (unused != std::vector<size_t>{4}) return fail("unused_parameters() is not {4}");
    if (iter == 0) {
      // Rank 0's order, the unused parameter last, on every rank.
      if (flat_bucket_order(ddp) != std::vector<size_t>{1, 3, 5, 0, 2, 4})
        return fail("buckets were not rebuilt in rank 0's arrival order");
      if (ddp.buckets().size() != 3) return fail("expected 3 buckets after the rebuild");
    }
  }
  ddp.zero_grad();
  const std::string unused = expect_error<DdpError>(
      "static unused", [&] { ddp.mark_ready(4); }, {"'q4'", "static"},
      "marking a statically unused parameter did not throw");
  if (!unused.empty()) return fail(unused);
  std::printf("PASS static_order\n");
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
  if (pg.size() > 1) {
    // The last rank registers a different fc.bias (count, then dtype): every rank refuses,
    // naming it, and the group stays usable.
    const int odd = pg.size() - 1;
    std::vector<double> wide(50);
    for (int variant = 0; variant < 2; ++variant) {
      auto params = make_params();
      if (pg.rank() == odd) {
        if (variant == 0) params[1].numel = 49;
        if (variant == 1) params[1] = {"fc.bias", wide.data(), wide.size(), DataType::kFloat64};
      }
      const std::string mismatch = expect_error<std::invalid_argument>(
          "mismatch", [&] { DistributedDataParallel ddp(pg, params, small); },
          {"'fc.bias'", "rank " + std::to_string(odd)},
          "parameters that differ across ranks were accepted");
      if (!mismatch.empty()) return fail(mismatch);
    }
    pg.barrier();
  }
  {
    DistributedDataParallel ddp(pg, make_params(), small);
    ddp.mark_ready(2);
    const std::string twice = expect_error<DdpError>(
        "double mark", [&] { ddp.mark_ready(2); }, {"'head'", "twice"},
        "marking twice did not throw");
    if (!twice.empty()) return fail(twice);
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
    const std::string incomplete = expect_error<DdpError>(
        "incomplete", [&] { ddp.finalize(); }, {"'fc.weight'", "find_unused"},
        "finalize with a missing gradient did not throw");
    if (!incomplete.empty()) return fail(incomplete);
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
    else if (mode == "join")
      rc = join(w.process_group(), argc, argv);
    else if (mode == "hooks")
      rc = hooks(w.process_group());
    else if (mode == "join_peer_dies")
      rc = join_peer_dies(w.process_group());
    else if (mode == "hook_dump")
      rc = hook_dump(w.process_group(), argc, argv);
    else if (mode == "powersgd")
      rc = powersgd(w.process_group());
    else if (mode == "static_order")
      rc = static_order(w.process_group());
    std::fflush(stdout);
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "unexpected exception: %s\n", e.what());
    return 3;
  }
}
