"""The Python twin of examples/libtorch_toy: the same ToyModel, seeds, data and steps, trained with
torch.nn.parallel.DistributedDataParallel on gloo under torchrun. Writes OUT/rank<R>.json with the
digest [sum of all parameters, sum of their squares] and whether every rank holds rank 0's
parameters. tests/torch/torch_test.cpp compares its digest with the C++ program's.

    torchrun --nproc_per_node=2 tests/torch/toy_ddp.py --out DIR [--steps 20] [--lr 0.01]
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

# The tutorial's ToyModel, as the launcher's compatibility test trains it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "launcher", "py"))
from ddp_toy import ToyModel  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.01)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(1234)
    model = ToyModel()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()
    gen = torch.Generator()
    gen.manual_seed(100 + rank)
    for _ in range(args.steps):
        x = torch.randn(16, 10, generator=gen)
        y = torch.randn(16, 5, generator=gen)
        opt.zero_grad()
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()

    with torch.no_grad():
        params = [p.detach() for p in model.parameters()]
        total = sum(p.double().sum().item() for p in params)
        squares = sum((p.double() * p.double()).sum().item() for p in params)
        mine = torch.cat([p.reshape(-1) for p in params])
        theirs = mine.clone()
        dist.broadcast(theirs, 0)
        differs = torch.tensor([0 if torch.equal(mine, theirs) else 1], dtype=torch.int32)
        dist.all_reduce(differs, op=dist.ReduceOp.MAX)
    with open(os.path.join(args.out, "rank%d.json" % rank), "w") as f:
        json.dump({"digest": [total, squares], "replicas_identical": differs.item() == 0,
                   "steps": args.steps, "world_size": world}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
