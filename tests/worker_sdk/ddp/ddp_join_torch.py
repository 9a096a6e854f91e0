"""PyTorch 1.13's Join context with DDP on gloo, the reference for ddp_torch_test.cpp's join case.

  python3 ddp_join_torch.py RANK WORLD INIT_FILE PARAMS_IN COUNTS BATCH OUT

The MLP of examples/train_mlp (10-32-32-5, ReLU, MSE loss) with the parameters in PARAMS_IN
(float32 W0, b0, W1, b1, W2, b2 as the C++ Mlp stores them, which is nn.Linear's layout), the
same synthetic samples (Mlp::make_batch) and the same schedule as ddp_worker's join mode: rank r
has COUNTS[r] batches of BATCH per round, 2 rounds, plain SGD (lr 0.05), each round inside
Join([ddp], divide_by_initial_world_size=False). Rank 0 writes the final parameters to OUT.
"""
import math
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

SIZES = [10, 32, 32, 5]


def make_batch(indices):
    xs, ts = [], []
    for idx in indices:
        x = [math.sin(0.37 * idx + 1.3 * j) for j in range(SIZES[0])]
        s = sum(v * (0.5 if j % 2 else -0.25) for j, v in enumerate(x))
        xs.append(x)
        ts.append([math.sin(s + 0.7 * o) for o in range(SIZES[-1])])
    return (torch.tensor(xs, dtype=torch.float32), torch.tensor(ts, dtype=torch.float32))


def main():
    rank, world, init_file, params_in, counts, batch, out = sys.argv[1:8]
    rank, world, batch = int(rank), int(world), int(batch)
    counts = [int(c) for c in counts.split(",")]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    layers = []
    for i in range(len(SIZES) - 1):
        layers.append(nn.Linear(SIZES[i], SIZES[i + 1]))
        if i + 2 < len(SIZES):
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    flat = np.fromfile(params_in, dtype=np.float32)
    at = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(flat[at:at + p.numel()].copy()).view_as(p))
            at += p.numel()
    assert at == flat.size
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    loss_fn = nn.MSELoss()
    most = max(counts)
    for rnd in range(2):
        with Join([ddp], divide_by_initial_world_size=False):
            for s in range(counts[rank]):
                idx = [((rnd * most + s) * world + rank) * batch + k for k in range(batch)]
                x, t = make_batch(idx)
                opt.zero_grad()
                loss_fn(ddp(x), t).backward()
                opt.step()
    if rank == 0:
        with open(out, "wb") as f:
            for p in model.parameters():
                f.write(p.detach().numpy().astype(np.float32).tobytes())
    # Every rank is done with gloo; skip the teardown, whose destructors (DDP's reducer, gloo's
    # threads) sometimes hang in PyTorch 1.13 when the peer has already exited.
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
