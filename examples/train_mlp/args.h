#pragma once
// train_mlp's command line (examples/train_mlp/README.md; `train_mlp --help`).

#include <cstddef>
#include <cstdint>
#include <string>

namespace trun::examples {

struct Args {
  std::string sizes = "10,10,5";
  uint64_t dataset_size = 2048;
  size_t batch_size = 32;  // per rank
  uint64_t epochs = 10;
  float lr = 0.01f;
  float momentum = 0.9f;
  uint64_t seed = 0;
  std::string ckpt_dir;  // default: $TMPDIR/train_mlp-ckpt (see default_ckpt_dir)
  uint64_t ckpt_every = 20;
  int keep = 3;
  bool async_ckpt = false;
  bool no_ckpt = false;
  bool fresh_start = false;  // set other jobs' checkpoints aside, quarantine damaged ones
  double bucket_cap_mb = 25.0;
  std::string backend = "cpu";
  uint64_t stop_after_steps = 0;  // 0: never
  int64_t crash_at_step = -1;     // rank crash_rank exits 1 at this step on the first attempt
  int crash_rank = 0;
  int64_t hang_at_step = -1;  // rank hang_rank hangs at this step on the first attempt
  int hang_rank = 0;
  std::string hang_kind = "spin";  // spin | mismatch
  bool print_steps = false;        // "hangbench" lines for scripts/bench_hang.sh
  int step_sleep_ms = 0;
  std::string sample_log;         // prefix of per-process sample logs
  uint64_t stop_check_every = 1;  // steps between stop agreements (trun/stop.h)
  std::string final_params;       // rank 0 writes the final parameters and momentum here
  bool classic = false;           // no resilient loop: a failure ends the process
};

// Parses the options; prints the usage and exits 2 on bad input, 0 on --help.
Args parse_args(int argc, char** argv);

}  // namespace trun::examples
