# The PyTorch peer of scripts/bench_hang.sh: the DDP tutorial's ToyModel (nn.Linear(10, 10), ReLU,
# nn.Linear(10, 5); SGD, MSE on random data) under torchrun with gloo, the same "hangbench" lines
# and the same faults as examples/train_mlp (--print-steps, --hang-at-step/--hang-rank/--hang-kind),
# and a checkpoint every K steps (torch.save by rank 0, torch.load by every rank at start) so that
# a restarted group resumes.
#
#   torchrun --nproc_per_node 4 --max_restarts 3 bench/hang_torch.py --ckpt-dir DIR \
#     [--timeout-s S] [--step-sleep-ms 50] [--hang-at-step N --hang-rank R --hang-kind spin|mismatch]
#
# --timeout-s S: init_process_group(timeout=timedelta(seconds=S)); without it, PyTorch's default
# (30 min for gloo). The faults happen on the first attempt only (TORCHELASTIC_RESTART_COUNT 0):
# spin = rank R loops in Python forever; mismatch = rank R broadcasts 10 floats where the others
# allreduce 1024, then goes on.
import argparse
import os
import sys
import time
from datetime import timedelta

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


def say(line):
    print(line, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--timeout-s", type=float, default=0.0)
    ap.add_argument("--step-sleep-ms", type=int, default=50)
    ap.add_argument("--steps", type=int, default=1000000)
    ap.add_argument("--hang-at-step", type=int, default=-1)
    ap.add_argument("--hang-rank", type=int, default=0)
    ap.add_argument("--hang-kind", choices=["spin", "mismatch"], default="spin")
    args = ap.parse_args()

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kw = {"timeout": timedelta(seconds=args.timeout_s)} if args.timeout_s > 0 else {}
    dist.init_process_group("gloo", **kw)
    rank, world = dist.get_rank(), dist.get_world_size()
    say(f"hangbench start rank={rank} local_rank={os.environ.get('LOCAL_RANK')} "
        f"attempt={attempt} pid={os.getpid()} t={time.time():.3f}")

    torch.manual_seed(rank)
    model = ToyModel()
    opt = optim.SGD(model.parameters(), lr=0.001)
    step = 0
    path = os.path.join(args.ckpt_dir, "ckpt.pt")
    if os.path.exists(path):
        state = torch.load(path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    ddp = DDP(model)
    loss_fn = nn.MSELoss()

    while step < args.steps:
        opt.zero_grad()
        loss = loss_fn(ddp(torch.randn(20, 10)), torch.randn(20, 5))
        loss.backward()
        opt.step()
        step += 1
        if rank == 0:
            say(f"hangbench step={step} rank=0 attempt={attempt} t={time.time():.3f}")
        if step == args.hang_at_step and attempt == 0:
            culprit = rank == args.hang_rank
            if culprit:
                say(f"hangbench fault kind={args.hang_kind} rank={rank} step={step} "
                    f"attempt={attempt} pid={os.getpid()} t={time.time():.3f}")
            if args.hang_kind == "spin" and culprit:
                n = 0
                while True:  # user code that never returns and calls nothing
                    n += 1
            if args.hang_kind == "mismatch":
                if culprit:
                    dist.broadcast(torch.ones(10), src=0)
                else:
                    dist.all_reduce(torch.ones(1024))
        if rank == 0 and step % args.ckpt_every == 0:
            os.makedirs(args.ckpt_dir, exist_ok=True)
            tmp = path + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "step": step}, tmp)
            os.replace(tmp, path)
        if args.step_sleep_ms > 0:
            time.sleep(args.step_sleep_ms / 1000.0)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
