// Joins a trun job (or runs alone as a world of size 1), averages a vector over all ranks and
// prints the result: the smallest complete use of libtrun_worker.
#include <cstdio>
#include <vector>

#include <trun/config.h>
#include <trun/error_file.h>
#include <trun/worker.h>

int main() {
  using namespace trun::worker;
  return record([] {
    Worker worker = init();
    ProcessGroup& pg = worker.process_group();
    std::vector<float> grads(1000, static_cast<float>(worker.rank() + 1));
    pg.allreduce(grads.data(), grads.size(), DataType::kFloat32, ReduceOp::kAvg);
    std::printf("consumer rank %d/%d backend %s nccl_compiled=%d avg=%g\n", worker.rank(),
                worker.world_size(), pg.backend_description().c_str(), TRUN_HAVE_NCCL, grads[0]);
    return 0;
  });
}
