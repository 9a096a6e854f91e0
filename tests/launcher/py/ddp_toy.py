# The PyTorch DDP tutorial's ToyModel, trained for a few steps with gloo on CPU (or, with
# DDP_TOY_BACKEND=nccl, with NCCL on GPU local_rank % device_count). Unmodified torchrun-style
# program: it reads everything from the environment the launcher sets.
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
    backend = os.environ.get("DDP_TOY_BACKEND", "gloo")
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = ToyModel().to(device)
    ddp_model = DDP(model, device_ids=[device.index] if backend == "nccl" else None)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.01)
    for step in range(5):
        torch.manual_seed(1000 + 10 * step + rank)  # different data on each rank
        optimizer.zero_grad()
        inputs, targets = torch.randn(20, 10), torch.randn(20, 5)
        outputs = ddp_model(inputs.to(device))
        loss_fn(outputs, targets.to(device)).backward()
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
