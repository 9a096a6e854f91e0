"""PyTorch 1.13's DDP communication hooks on gloo, the reference for ddp_torch_test.cpp.

  python3 ddp_hooks_torch.py RANK WORLD INIT_FILE OUT_PREFIX N

Each rank's gradient is value(rank, k) for k < N (the same formula as ddp_worker's hook_dump
mode, computed in double and rounded to float32). Module: one parameter w of N elements and
loss sum(w * c), so w.grad is exactly c before DDP reduces it. For each hook (none, fp16) rank 0
writes the reduced w.grad (float32, raw) to OUT_PREFIX.<hook>.

PyTorch 1.13 refuses bf16_compress_hook without NCCL ("requires CUDA 11+ and NCCL 2.10+"), so
OUT_PREFIX.bf16 is that hook's arithmetic done by hand: c.to(bfloat16).div_(world), the shares
allgathered and summed in bfloat16 in rank order (what an allreduce of bfloat16 computes), cast
back to float32.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def value(rank, k):
    # Spans float16's subnormals to ~800, signs mixed; exact formula shared with the C++ side.
    return ((k % 251) - 125) * (rank + 1.5) / 13.0 * 2.0 ** ((k % 20) - 14)


class Linear1(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))

    def forward(self, c):
        return (self.w * c).sum()


def main():
    rank, world, init_file, out, n = sys.argv[1:6]
    rank, world, n = int(rank), int(world), int(n)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    c = torch.tensor([value(rank, k) for k in range(n)], dtype=torch.float32)
    hooks = {"none": None, "fp16": default_hooks.fp16_compress_hook}
    for name, hook in hooks.items():
        model = DDP(Linear1(n))
        if hook is not None:
            model.register_comm_hook(None, hook)
        model(c).backward()
        if rank == 0:
            with open(f"{out}.{name}", "wb") as f:
                f.write(model.module.w.grad.numpy().tobytes())
        dist.barrier()
    share = c.to(torch.bfloat16).div_(world)
    shares = [torch.empty(n, dtype=torch.float32) for _ in range(world)]
    dist.all_gather(shares, share.to(torch.float32))  # bfloat16 -> float32 is exact
    total = shares[0].to(torch.bfloat16)
    for s in shares[1:]:
        total = total + s.to(torch.bfloat16)
    if rank == 0:
        with open(f"{out}.bf16", "wb") as f:
            f.write(total.to(torch.float32).numpy().tobytes())
    # Every rank is done with gloo; skip the teardown, whose destructors (DDP's reducer, gloo's
    # threads) sometimes hang in PyTorch 1.13 when the peer has already exited.
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
