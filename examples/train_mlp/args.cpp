// train_mlp's command line.
#include "examples/train_mlp/args.h"

#include <cstdio>
#include <cstdlib>

namespace trun::examples {
namespace {

void usage() {
  std::fprintf(
      stderr,
      "usage: train_mlp [options]\n"
      "  --sizes A,B,...        layer sizes (default 10,10,5)\n"
      "  --dataset-size N       synthetic samples (default 2048)\n"
      "  --batch-size B         samples per rank per step (default 32)\n"
      "  --epochs E             (default 10)\n"
      "  --lr X --momentum M    SGD (default 0.01, 0.9)\n"
      "  --seed S               init and shuffle seed (default 0)\n"
      "  --ckpt-dir DIR         checkpoints (default $TMPDIR/train_mlp-ckpt under a launcher;\n"
      "                         without a run id, a directory of this run's own: no resume)\n"
      "  --ckpt-every K         save every K steps (default 20)\n"
      "  --keep K               checkpoints to keep (default 3)\n"
      "  --async-ckpt           write checkpoints on a background thread\n"
      "  --no-ckpt              neither save nor resume\n"
      "  --fresh-start          start over: set aside another job's checkpoints (kept, renamed\n"
      "                         step_<n>.set-aside-<ms>) and quarantine damaged ones (default:\n"
      "                         continue the newest checkpoint; refuse if all are damaged)\n"
      "  --adopt-checkpoints    accepted for compatibility: continuing another (finished)\n"
      "                         job's checkpoints is the default\n"
      "  --bucket-cap-mb X      DDP bucket cap (default 25)\n"
      "  --backend cpu|nccl|auto  (default cpu; the model runs on the CPU)\n"
      "  --step-sleep-ms T      sleep per step (to watch restarts)\n"
      "  --stop-after-steps N   exit 0 after N steps of this run (a preemption)\n"
      "  --crash-at-step N [--crash-rank R]  rank R exits 1 at step N on attempt 0\n"
      "  --hang-at-step N [--hang-rank R] [--hang-kind spin|mismatch]  on attempt 0, rank R\n"
      "                         hangs after step N: spin = a busy loop in user code, forever;\n"
      "                         mismatch = it broadcasts 10 floats where the others allreduce\n"
      "                         1024, then goes on (scripts/bench_hang.sh)\n"
      "  --print-steps          every rank prints 'hangbench start ...' with its pid, rank 0\n"
      "                         'hangbench step=N ... t=UNIX' after each step\n"
      "  --sample-log PREFIX    append the sample indices of each step to PREFIX.<pid>\n"
      "                         (with the group, step and time; see the README)\n"
      "  --stop-check-every K   agree on stop requests every K steps (default 1)\n"
      "  --classic              without the resilient loop: a peer's failure ends this process\n"
      "                         too, and trun restarts the whole group (default: the loop keeps\n"
      "                         running and takes the replacement in; trun/resilient.h)\n"
      "  --final-params FILE    rank 0 writes the final parameters and momentum (raw\n"
      "                         float32, in registration order) to FILE\n"
      "On a stop signal (TORCHELASTIC_SIGNALS_TO_HANDLE; default SIGTERM, SIGINT, SIGHUP,\n"
      "SIGQUIT, and SIGUSR1 under SLURM) every rank stops at the same step, rank 0 saves it\n"
      "and every rank exits 75.\n");
}

}  // namespace

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "train_mlp: %s needs a value\n", k.c_str());
        usage();
        std::exit(2);
      }
      return argv[++i];
    };
    auto num = [&](const std::string& v) -> double {
      char* end = nullptr;
      const double d = std::strtod(v.c_str(), &end);
      if (v.empty() || *end) {
        std::fprintf(stderr, "train_mlp: %s: '%s' is not a number\n", k.c_str(), v.c_str());
        std::exit(2);
      }
      return d;
    };
    auto count = [&](const std::string& v) -> uint64_t {
      const double d = num(v);
      if (d < 0 || d != static_cast<double>(static_cast<uint64_t>(d))) {
        std::fprintf(stderr, "train_mlp: %s: '%s' is not a non-negative integer\n", k.c_str(),
                     v.c_str());
        std::exit(2);
      }
      return static_cast<uint64_t>(d);
    };
    if (k == "--sizes")
      a.sizes = val();
    else if (k == "--dataset-size")
      a.dataset_size = count(val());
    else if (k == "--batch-size")
      a.batch_size = count(val());
    else if (k == "--epochs")
      a.epochs = count(val());
    else if (k == "--lr")
      a.lr = static_cast<float>(num(val()));
    else if (k == "--momentum")
      a.momentum = static_cast<float>(num(val()));
    else if (k == "--seed")
      a.seed = count(val());
    else if (k == "--ckpt-dir")
      a.ckpt_dir = val();
    else if (k == "--ckpt-every")
      a.ckpt_every = count(val());
    else if (k == "--keep")
      a.keep = static_cast<int>(count(val()));
    else if (k == "--async-ckpt")
      a.async_ckpt = true;
    else if (k == "--no-ckpt")
      a.no_ckpt = true;
    else if (k == "--fresh-start")
      a.fresh_start = true;
    else if (k == "--adopt-checkpoints") {
      // The default now (CheckpointerOptions::adopt); kept so that old command lines work.
    } else if (k == "--bucket-cap-mb")
      a.bucket_cap_mb = num(val());
    else if (k == "--backend")
      a.backend = val();
    else if (k == "--step-sleep-ms")
      a.step_sleep_ms = static_cast<int>(count(val()));
    else if (k == "--stop-after-steps")
      a.stop_after_steps = count(val());
    else if (k == "--crash-at-step")
      a.crash_at_step = static_cast<int64_t>(count(val()));
    else if (k == "--crash-rank")
      a.crash_rank = static_cast<int>(count(val()));
    else if (k == "--hang-at-step")
      a.hang_at_step = static_cast<int64_t>(count(val()));
    else if (k == "--hang-rank")
      a.hang_rank = static_cast<int>(count(val()));
    else if (k == "--hang-kind") {
      a.hang_kind = val();
      if (a.hang_kind != "spin" && a.hang_kind != "mismatch") {
        std::fprintf(stderr, "train_mlp: --hang-kind must be spin or mismatch, got '%s'\n",
                     a.hang_kind.c_str());
        std::exit(2);
      }
    } else if (k == "--print-steps")
      a.print_steps = true;
    else if (k == "--sample-log")
      a.sample_log = val();
    else if (k == "--stop-check-every")
      a.stop_check_every = count(val());
    else if (k == "--final-params")
      a.final_params = val();
    else if (k == "--classic")
      a.classic = true;
    else if (k == "-h" || k == "--help") {
      usage();
      std::exit(0);
    } else {
      std::fprintf(stderr, "train_mlp: unknown option '%s'\n", k.c_str());
      usage();
      std::exit(2);
    }
  }
  if (a.batch_size == 0 || a.dataset_size == 0 || a.ckpt_every == 0 || a.keep < 1 ||
      a.stop_check_every == 0) {
    std::fprintf(stderr,
                 "train_mlp: --batch-size, --dataset-size, --ckpt-every, --keep and "
                 "--stop-check-every must be positive\n");
    std::exit(2);
  }
  return a;
}

}  // namespace trun::examples
