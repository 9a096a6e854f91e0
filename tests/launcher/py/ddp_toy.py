# The PyTorch DDP tutorial's ToyModel, trained for a few steps with gloo on CPU. Unmodified
# torchrun-style program: it reads everything from the environment the launcher sets.
# Writes <out dir>/result_<rank>.json with a parameter checksum and the worker environment.
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.01)
    for step in range(5):
        torch.manual_seed(1000 + 10 * step + rank)  # different data on each rank
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10))
        loss_fn(outputs, torch.randn(20, 5)).backward()
        optimizer.step()
    checksum = sum(float(p.double().sum()) for p in model.parameters())
    result = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "checksum": checksum,
        "env": dict(os.environ),
    }
    with open(os.path.join(out_dir, f"result_{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
