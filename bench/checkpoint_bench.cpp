// Checkpoint save throughput and async blocking time (scripts/bench_checkpoint.sh runs it next
// to `dd ... conv=fsync` of the same size in the same directory).
//
//   checkpoint_bench DIR [--size-mib 256] [--repeats 3] [--mode both|sync]
//
// sync:  Checkpointer::save (fsync on) of SIZE MiB in 16 tensors, `repeats` times; prints
//          ckpt mode=sync size_mib=S save_ms=T mbps=X        (median; MB = 1e6 bytes)
// async: a training loop of 20 steps that each compute for half a sync save's time, saving every
//        4 steps in async mode, against the same loop without checkpoints; prints
//          ckpt mode=async size_mib=S blocked_ms=B blocked_max_ms=M snapshot_ms=C wait_ms=W
//               first_save_ms=F sync_save_ms=T loop_ms=L baseline_loop_ms=L0
//        blocked = median time a save held the training loop (saves 2-5; the first, F, also
//        allocates and faults in the staging buffer): waiting for the previous write (wait_ms)
//        plus the snapshot copy into host memory (snapshot_ms).

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <trun/checkpoint.h>

using Clock = std::chrono::steady_clock;
using namespace trun::worker;

namespace {

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Stands in for a training step: real work for about `ms` milliseconds.
void compute(double ms, std::vector<float>& scratch) {
  const auto t0 = Clock::now();
  float acc = 0;
  while (ms_since(t0) < ms)
    for (size_t i = 0; i < scratch.size(); i += 16) acc += scratch[i] * 1.0001f;
  scratch[0] = acc;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: checkpoint_bench DIR [--size-mib N] [--repeats N]\n");
    return 2;
  }
  const std::string dir = argv[1];
  size_t size_mib = 256;
  int repeats = 3;
  std::string mode = "both";
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--size-mib")
      size_mib = std::stoul(argv[i + 1]);
    else if (k == "--repeats")
      repeats = std::stoi(argv[i + 1]);
    else if (k == "--mode")
      mode = argv[i + 1];
    else {
      std::fprintf(stderr, "checkpoint_bench: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  constexpr int kTensors = 16;
  const size_t per = (size_mib << 20) / kTensors / sizeof(float);
  std::vector<std::vector<float>> data(kTensors, std::vector<float>(per));
  for (int t = 0; t < kTensors; ++t)
    for (size_t i = 0; i < per; ++i) data[t][i] = static_cast<float>((i * 2654435761u + t) % 9973);
  auto request = [&](uint64_t step) {
    SaveRequest r;
    r.step = step;
    for (int t = 0; t < kTensors; ++t)
      r.model.push_back({"t" + std::to_string(t),
                         DataType::kFloat32,
                         {static_cast<int64_t>(per)},
                         data[t].data()});
    return r;
  };
  const double bytes = static_cast<double>(per * sizeof(float) * kTensors);

  std::vector<double> sync_ms;
  {
    CheckpointerOptions o;
    o.keep_last = 1;
    Checkpointer ck(dir + "/sync", o);
    for (int r = 0; r < repeats; ++r) {
      const auto t0 = Clock::now();
      ck.save(request(r + 1));
      sync_ms.push_back(ms_since(t0));
    }
  }
  const double sync_med = median(sync_ms);
  std::printf("ckpt mode=sync size_mib=%zu save_ms=%.1f mbps=%.1f\n", size_mib, sync_med,
              bytes / (sync_med / 1e3) / 1e6);
  std::fflush(stdout);
  std::error_code ec;
  std::filesystem::remove_all(dir + "/sync", ec);
  if (mode == "sync") return 0;

  // Async: compute per step = half a sync save, a save every 4 steps: the writer has two sync
  // saves' worth of time to finish before the next save needs it.
  const double step_ms = sync_med / 2;
  const int kEvery = 4;
  std::vector<float> scratch(1 << 16, 1.0f);
  const int kSteps = 20;  // 5 saves: the first allocates the staging buffer, 4 are steady state
  auto t0 = Clock::now();
  for (int s = 0; s < kSteps; ++s) compute(step_ms, scratch);
  const double baseline = ms_since(t0);
  std::vector<double> blocked, waited, snapshot;
  double loop_ms = 0;
  {
    CheckpointerOptions o;
    o.keep_last = 1;
    o.async = true;
    Checkpointer ck(dir + "/async", o);
    t0 = Clock::now();
    for (int s = 1; s <= kSteps; ++s) {
      compute(step_ms, scratch);
      if (s % kEvery == 0) {
        // save() waits for the previous write, then snapshots: time the two apart.
        const auto b0 = Clock::now();
        ck.wait();
        waited.push_back(ms_since(b0));
        const auto b1 = Clock::now();
        ck.save(request(s));
        snapshot.push_back(ms_since(b1));
        blocked.push_back(ms_since(b0));
      }
    }
    loop_ms = ms_since(t0);
    ck.wait();
  }
  const double first = blocked.front();
  blocked.erase(blocked.begin());
  snapshot.erase(snapshot.begin());
  waited.erase(waited.begin());
  std::printf(
      "ckpt mode=async size_mib=%zu blocked_ms=%.1f blocked_max_ms=%.1f snapshot_ms=%.1f "
      "wait_ms=%.1f first_save_ms=%.1f sync_save_ms=%.1f loop_ms=%.1f "
      "baseline_loop_ms=%.1f\n",
      size_mib, median(blocked), *std::max_element(blocked.begin(), blocked.end()),
      median(snapshot), median(waited), first, sync_med, loop_ms, baseline);
  std::filesystem::remove_all(dir + "/async", ec);
  return 0;
}
