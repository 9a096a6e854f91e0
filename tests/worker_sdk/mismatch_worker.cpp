// A rank program for collective_mismatch_test: 20 matching allreduces, then a 21st collective
// in which the last rank passes something else than the others (CASE), as a training program
// with a rank-dependent bug would.
//
//   mismatch_worker CASE
//
// CASE: count (8 float32 elements against 16), dtype (float64 against float32), op (max
// against sum), broadcast (8 against 16 elements), root (broadcast from rank 1 against rank 0),
// allgather and reduce_scatter (8 against 16 elements), kind (broadcast against allreduce) or
// barrier (barrier against allreduce). Prints "FAILED: <error>" when the mismatched collective
// (or, for the rank in barrier, the next one) throws CollectiveError, then checks that a later
// collective fails at once too ("LATER: ..."), and exits 0. "NO FAILURE" and exit 4 when nothing
// failed; "TIMEOUT: ..." and exit 16 on CollectiveTimeoutError; 1 on anything else.

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include <trun/worker.h>

using namespace trun::worker;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The 21st collective; true when this rank's call returned normally.
void mismatched(ProcessGroup& pg, const std::string& kind) {
  const bool odd = pg.rank() == pg.size() - 1;  // the rank that differs
  const size_t n = odd ? 8 : 16;
  std::vector<float> f(16 * static_cast<size_t>(pg.size()), 1.0f);
  std::vector<float> out(16 * static_cast<size_t>(pg.size()));
  if (kind == "count") {
    pg.allreduce(f.data(), n, DataType::kFloat32, ReduceOp::kSum);
  } else if (kind == "dtype") {
    std::vector<double> d(16, 1.0);
    if (odd)
      pg.allreduce(d.data(), 16, DataType::kFloat64, ReduceOp::kSum);
    else
      pg.allreduce(f.data(), 16, DataType::kFloat32, ReduceOp::kSum);
  } else if (kind == "op") {
    pg.allreduce(f.data(), 16, DataType::kFloat32, odd ? ReduceOp::kMax : ReduceOp::kSum);
  } else if (kind == "broadcast") {
    pg.broadcast(f.data(), n, DataType::kFloat32, 0);
  } else if (kind == "root") {
    pg.broadcast(f.data(), 16, DataType::kFloat32, odd ? 1 : 0);
  } else if (kind == "allgather") {
    pg.allgather(f.data(), out.data(), n, DataType::kFloat32);
  } else if (kind == "reduce_scatter") {
    pg.reduce_scatter(f.data(), out.data(), n, DataType::kFloat32, ReduceOp::kSum);
  } else if (kind == "kind") {
    if (odd)
      pg.broadcast(f.data(), 16, DataType::kFloat32, 0);
    else
      pg.allreduce(f.data(), 16, DataType::kFloat32, ReduceOp::kSum);
  } else if (kind == "barrier") {
    if (odd) {
      pg.barrier();  // a barrier does not compare calls: the next collective fails
      pg.allreduce(f.data(), 16, DataType::kFloat32, ReduceOp::kSum);
    } else {
      pg.allreduce(f.data(), 16, DataType::kFloat32, ReduceOp::kSum);
    }
  } else {
    throw std::invalid_argument("unknown case " + kind);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc < 2) {
    std::fprintf(stderr, "usage: mismatch_worker CASE\n");
    return 2;
  }
  const std::string kind = argv[1];
  try {
    InitOptions io;
    io.backend = Backend::kCpu;
    io.install_error_handler = false;
    io.timeout = std::chrono::seconds(30);
    Worker w = init(io);
    ProcessGroup& pg = w.process_group();
    std::printf("rank %d/%d backend %s\n", pg.rank(), pg.size(), pg.backend_description().c_str());
    for (int i = 0; i < 20; ++i) {
      std::vector<float> v(16, static_cast<float>(pg.rank() + i));
      pg.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
      const float want = static_cast<float>(pg.size() * (pg.size() - 1) / 2 + pg.size() * i);
      if (v[15] != want) {
        std::printf("allreduce %d gave %g, not %g\n", i, v[15], want);
        return 1;
      }
    }
    auto t0 = Clock::now();
    try {
      mismatched(pg, kind);
      std::printf("NO FAILURE\n");
      return 4;
    } catch (const CollectiveTimeoutError& e) {
      std::printf("TIMEOUT after %.3f s: %s\n", seconds_since(t0), e.what());
      return 16;
    } catch (const CollectiveError& e) {
      std::printf("FAILED after %.3f s: %s\n", seconds_since(t0), e.what());
    }
    t0 = Clock::now();
    try {
      float x = 1;
      pg.allreduce(&x, 1, DataType::kFloat32, ReduceOp::kSum);
      std::printf("LATER: NO FAILURE\n");
      return 4;
    } catch (const CollectiveError& e) {
      std::printf("LATER after %.3f s: %s\n", seconds_since(t0), e.what());
      return seconds_since(t0) < 5 ? 0 : 5;
    }
  } catch (const std::exception& e) {
    std::printf("ERROR: %s\n", e.what());
    return 1;
  }
}
