// libtrun_worker and libtorch in one process, built against the installed SDK only: libtorch
// carries its own Gloo (and more), and libtrun_worker exports nothing but its trun:: API, so
// neither binds to the other's copies. Each rank allreduces a torch tensor through the SDK's
// default group, checks it with torch, and catches a store exception thrown inside
// libtrun_worker by its type (the store's typeinfo crossing the library boundary).
#include <torch/torch.h>

#include <chrono>
#include <cstdio>

#include <trun/store/store.h>
#include <trun/worker.h>

int main() {
  using namespace trun::worker;
  Worker worker = init();
  ProcessGroup& pg = worker.process_group();

  torch::Tensor t = torch::full({1000}, static_cast<float>(worker.rank() + 1));
  pg.allreduce(t.data_ptr<float>(), static_cast<size_t>(t.numel()), DataType::kFloat32,
               ReduceOp::kSum);
  const int n = worker.world_size();
  const float expected = static_cast<float>(n * (n + 1) / 2);
  const bool sum_ok = torch::equal(t, torch::full({1000}, expected));

  bool timeout_caught = false;
  if (worker.store()) {
    try {
      worker.store()->get("torch_consumer/never_set", std::chrono::milliseconds(200));
    } catch (const trun::store::StoreTimeoutError&) {
      timeout_caught = true;
    }
  }
  pg.barrier();
  std::printf("torch consumer rank %d/%d sum=%g expected=%g store_timeout_caught=%d torch %s\n",
              worker.rank(), n, t[0].item<float>(), expected, timeout_caught, TORCH_VERSION);
  return sum_ok && timeout_caught ? 0 : 1;
}
