"""PyTorch 1.13's own DistributedDataParallel (gloo) on the model of bench/libtorch_bench.cpp, run
under torchrun by scripts/bench_libtorch.sh. Rank 0 prints two lines (local: steps under no_sync(), alternating with DDP steps):
    torch mode=ddp|local cap_mb=C ranks=N params=P step_ms=T
One thread per rank (torch.set_num_threads(1)).

    torchrun --nproc_per_node 2 bench/ddp_libtorch.py SIZES BATCH STEPS WARMUP CAP_MB
"""

import contextlib
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def main():
    sizes = [int(s) for s in sys.argv[1].split(",")]
    batch, steps, warmup = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    cap = float(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i + 2 < len(sizes):
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    params = sum(p.numel() for p in model.parameters())
    net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    x = torch.randn(batch, sizes[0])
    y = torch.randn(batch, sizes[-1])
    loss_fn = nn.MSELoss()
    # Local and DDP steps alternate (see bench/libtorch_bench.cpp); local: under no_sync().
    times = {"local": [], "ddp": []}
    for s in range(2 * (warmup + steps)):
        mode = "ddp" if s % 2 else "local"
        dist.barrier()
        t0 = time.perf_counter()
        ctx = net.no_sync() if mode == "local" else contextlib.nullcontext()
        with ctx:
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()
        t1 = time.perf_counter()
        if s // 2 >= warmup:
            times[mode].append((t1 - t0) * 1000)
    for mode in ("local", "ddp"):
        t = sorted(times[mode])
        med = torch.tensor([t[len(t) // 2]], dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            print("torch mode=%s cap_mb=%g ranks=%d params=%d step_ms=%.2f"
                  % (mode, cap, dist.get_world_size(), params, med.item()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
