"""PyTorch 1.13 DDP (gloo) step-time overhead on the same MLP as ddp_bench: the peer of
scripts/bench_ddp.sh. Run under torchrun with /usr/bin/python3. Prints:
  torch mode=local ranks=N params=P step_ms=T
  torch mode=ddp ranks=N params=P cap_mb=C step_ms=T overhead=R
  torch mode=ddp_fp16 ranks=N params=P cap_mb=C step_ms=T overhead=R  (fp16_compress_hook)
A step: zero grads, forward, MSE loss, backward (DDP: bucketed allreduce overlapped with it),
SGD; its time is the slowest rank's, the median over the timed steps."""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    sizes = [int(s) for s in sys.argv[1].split(",")]
    batch, steps = int(sys.argv[2]), int(sys.argv[3])
    caps = [float(c) for c in sys.argv[4].split(",")]
    fp16_caps = [float(c) for c in sys.argv[5].split(",") if c] if len(sys.argv) > 5 else []
    torch.set_num_threads(1)  # one core per rank, as the C++ ranks
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i + 2 < len(sizes):
            layers.append(nn.ReLU())
    torch.manual_seed(1)
    model = nn.Sequential(*layers)
    params = sum(p.numel() for p in model.parameters())
    loss_fn = nn.MSELoss()

    # Modes interleaved step by step (the machine is shared; drift hits every mode alike). Each
    # DDP wrapper shares the module's parameters, as each C++ reducer shares the MLP's.
    modes = [("local", None, model)] + [("ddp", cap, DDP(model, bucket_cap_mb=cap)) for cap in caps]
    for cap in fp16_caps:
        wrapped = DDP(model, bucket_cap_mb=cap)
        wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
        modes.append(("ddp_fp16", cap, wrapped))
    opts = [torch.optim.SGD(m.parameters(), lr=1e-4) for _, _, m in modes]
    times = [[] for _ in modes]
    for s in range(steps + 2):
        for k, (_, _, m) in enumerate(modes):
            x = torch.randn(batch, sizes[0])
            y = torch.randn(batch, sizes[-1])
            dist.barrier()
            t0 = time.perf_counter()
            opts[k].zero_grad()
            loss_fn(m(x), y).backward()
            opts[k].step()
            dt = torch.tensor([(time.perf_counter() - t0) * 1e3], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if s >= 2:
                times[k].append(dt.item())
    if rank == 0:
        local = statistics.median(times[0])
        print(f"torch mode=local ranks={n} params={params} step_ms={local:.2f}", flush=True)
        for k in range(1, len(modes)):
            ms = statistics.median(times[k])
            print(f"torch mode={modes[k][0]} ranks={n} params={params} cap_mb={modes[k][1]:g} "
                  f"step_ms={ms:.2f} overhead={ms / local:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
