"""The PyTorch 1.13 peer of examples/train_mlp for scripts/bench.sh goodput (issue 39): the same
elastic DDP training, run by torchrun. Run it with /usr/bin/python3 under torchrun:

  torchrun ... bench/goodput_torch.py --sizes 32,256,32 --ckpt-dir DIR --sample-log PREFIX ...
  python3 bench/goodput_torch.py --verify --ckpt-dir DIR ...   (no launcher: checks the newest
                                                                checkpoint loads, prints it)

What matches train_mlp (examples/train_mlp/main.cpp, mlp.cpp):
- the model: Linear layers of --sizes with ReLU between them, MSE loss, SGD with momentum;
- the synthetic data (train_mlp's make_batch: x[j] = sin(0.37 idx + 1.3 j), target[o] =
  sin(sum_j x[j] * (j odd ? 0.5 : -0.25) + 0.7 o)), --dataset-size samples;
- the sampler: each epoch has one global order of the dataset, a permutation that depends only on
  (seed, epoch); a step consumes the next batch * world positions, rank r taking positions
  offset + r, offset + r + world, ...; the state is (epoch, offset), so a restart at another world
  size resumes mid-epoch and every sample is trained once per epoch (the remaining positions are
  padded from the front of the order when they do not divide among the ranks, as trun's kPad);
- a checkpoint (rank 0, torch.save to a temporary file renamed into place) every --ckpt-every
  steps and on a stop request; on start every rank loads the newest one that loads;
- the stop agreement: a stop signal (SIGTERM, SIGINT) sets a flag, and every step the ranks
  allreduce it (one int, as trun's StopAgreement), so they stop at the same step; rank 0 saves
  it and every rank exits 75;
- --step-sleep-ms after each step (it stands in for accelerator compute);
- the sample log, exactly train_mlp's format (one parser, tests/cluster/chaos.py's, reads both):
  'start group G world W rank R restart N step S resumed_from H time T proc_start P
  init_seconds I load_seconds L', then per step, written before the step's allreduce,
  'epoch E step S world W rank R group G time T idx ...'. The group id is rank 0's
  '<pid>-<unix ms>', sent to the others with a broadcast; every checkpoint records the group
  that saved it.
Differences: the permutation is torch.randperm's, not trun's SplitMix64 (the order differs, the
exactly-once property does not); initialization is PyTorch's.
"""
import argparse
import datetime
import glob
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXIT_STOPPED_ON_REQUEST = 75

_stop_signal = []


def _on_stop_signal(signum, frame):
    if not _stop_signal:
        _stop_signal.append(signum)


def proc_start_time():
    """This process's start time (unix seconds, 10 ms resolution) from /proc: interpreter start
    and the imports count as restart time, as a C++ worker's exec and loading do."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime, field 22
        with open("/proc/stat") as f:
            btime = next(int(ln.split()[1]) for ln in f if ln.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return time.time()


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="10,10,5")
    p.add_argument("--dataset-size", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--step-sleep-ms", type=int, default=0)
    p.add_argument("--sample-log", default="")
    p.add_argument("--collective-timeout", type=float, default=1800.0,
                   help="init_process_group(timeout=...) in seconds (PyTorch's default: 30 min)")
    p.add_argument("--verify", action="store_true",
                   help="no training: load the newest checkpoint, print 'verify step S epoch E "
                        "offset O group G' and exit 0 (1 when none loads)")
    return p.parse_args()


def make_model(sizes, seed):
    torch.manual_seed(seed)
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i + 2 < len(sizes):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def make_dataset(n, d_in, d_out):
    idx = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    j = torch.arange(d_in, dtype=torch.float64).unsqueeze(0)
    x = torch.sin(0.37 * idx + 1.3 * j)
    w = torch.where(j % 2 == 1, torch.tensor(0.5, dtype=torch.float64),
                    torch.tensor(-0.25, dtype=torch.float64))
    s = (x * w).sum(dim=1, keepdim=True)
    o = torch.arange(d_out, dtype=torch.float64).unsqueeze(0)
    y = torch.sin(s + 0.7 * o)
    return x.float(), y.float()


class Sampler:
    """Global order per (seed, epoch); state (epoch, offset) in global positions."""

    def __init__(self, n, rank, world, seed):
        self.n, self.rank, self.world, self.seed = n, rank, world, seed
        self.epoch, self.offset = 0, 0
        self._order_epoch, self._order = None, None

    def epoch_done(self):
        return self.offset >= self.n

    def order(self):
        if self._order_epoch != self.epoch:
            g = torch.Generator()
            g.manual_seed(self.seed * 1000003 + self.epoch)
            self._order = torch.randperm(self.n, generator=g).tolist()
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self, batch):
        rem = self.n - self.offset
        per_rank = min(batch, int(math.ceil(rem / self.world)))
        order = self.order()
        idx = [order[(self.offset + self.rank + k * self.world) % self.n] for k in range(per_rank)]
        self.offset = min(self.n, self.offset + per_rank * self.world)
        return idx


def checkpoints(d):
    out = []
    for p in glob.glob(os.path.join(d, "step_*.pt")):
        try:
            out.append((int(os.path.basename(p)[5:-3]), p))
        except ValueError:
            pass
    return sorted(out, reverse=True)


def load_newest(d):
    for step, path in checkpoints(d):
        try:
            return torch.load(path), path
        except Exception as e:  # a torn or damaged file: the next older one
            print(f"[{os.getpid()}] cannot load {path}: {e}", file=sys.stderr, flush=True)
    return None, None


def save(d, ckpt, keep):
    path = os.path.join(d, "step_%d.pt" % ckpt["step"])
    tmp = path + ".tmp.%d" % os.getpid()
    torch.save(ckpt, tmp)
    os.replace(tmp, path)
    for _, old in checkpoints(d)[keep:]:
        try:
            os.remove(old)
        except OSError:
            pass


def verify(a):
    ckpt, path = load_newest(a.ckpt_dir)
    if ckpt is None:
        print("verify none")
        return 1
    sizes = [int(s) for s in a.sizes.split(",")]
    model = make_model(sizes, a.seed)
    model.load_state_dict(ckpt["model"])
    print("verify step %d epoch %d offset %d group %s path %s" %
          (ckpt["step"], ckpt["epoch"], ckpt["offset"], ckpt["group"], path), flush=True)
    return 0


def main():
    proc_start = proc_start_time()
    a = parse()
    if a.verify:
        return verify(a)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _on_stop_signal)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.collective_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    sizes = [int(s) for s in a.sizes.split(",")]
    model = make_model(sizes, a.seed + rank)
    ddp = DDP(model, bucket_cap_mb=25)  # broadcasts rank 0's parameters
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    sampler = Sampler(a.dataset_size, rank, world, a.seed)
    x_all, y_all = make_dataset(a.dataset_size, sizes[0], sizes[-1])
    loss_fn = nn.MSELoss()

    box = ["%d-%d" % (os.getpid(), int(time.time() * 1000))]
    dist.broadcast_object_list(box, src=0)
    group = box[0]
    load_begin = time.time()
    init_seconds = load_begin - proc_start
    os.makedirs(a.ckpt_dir, exist_ok=True)
    step, resumed_from = 0, "-"
    ckpt, path = load_newest(a.ckpt_dir)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        sampler.epoch, sampler.offset = ckpt["epoch"], ckpt["offset"]
        step, resumed_from = ckpt["step"], ckpt.get("group", "?")
        if rank == 0:
            print(f"[{os.getpid()}] resumed from {path} (step {step}, epoch {sampler.epoch}, "
                  f"sample offset {sampler.offset}, saved at world size {ckpt['world_size']}, "
                  f"now {world})", flush=True)
    load_seconds = time.time() - load_begin
    saved_step = step if ckpt is not None else -1

    log = None
    if a.sample_log:
        log = open("%s.%d" % (a.sample_log, os.getpid()), "a")
        log.write("start group %s world %d rank %d restart %d step %d resumed_from %s time %.6f "
                  "proc_start %.6f init_seconds %.6f load_seconds %.6f\n" %
                  (group, world, rank, restart, step, resumed_from, time.time(), proc_start,
                   init_seconds, load_seconds))
        log.flush()

    def checkpoint():
        if rank == 0:
            save(a.ckpt_dir, {"step": step, "epoch": sampler.epoch, "offset": sampler.offset,
                              "model": model.state_dict(), "optim": opt.state_dict(),
                              "group": group, "world_size": world, "sizes": a.sizes}, a.keep)

    flag = torch.zeros(1, dtype=torch.int32)
    if sampler.epoch_done():
        sampler.epoch, sampler.offset = sampler.epoch + 1, 0
    while sampler.epoch < a.epochs:
        while not sampler.epoch_done():
            idx = sampler.next_batch(a.batch_size)
            if log:
                log.write("epoch %d step %d world %d rank %d group %s time %.6f idx %s\n" %
                          (sampler.epoch, step + 1, world, rank, group, time.time(),
                           " ".join(map(str, idx))))
                log.flush()
            t = torch.tensor(idx, dtype=torch.long)
            opt.zero_grad()
            loss_fn(ddp(x_all[t]), y_all[t]).backward()
            opt.step()
            step += 1
            if step % a.ckpt_every == 0:
                checkpoint()
                saved_step = step
            if a.step_sleep_ms > 0:
                time.sleep(a.step_sleep_ms / 1000.0)
            flag[0] = 1 if _stop_signal else 0
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag[0]:
                if saved_step != step:
                    checkpoint()
                dist.barrier()  # rank 0's save is complete before anyone exits
                if rank == 0:
                    print(f"[{os.getpid()}] stopped on request at step {step}: checkpoint "
                          f"step_{step} saved", flush=True)
                if log:
                    log.close()
                return EXIT_STOPPED_ON_REQUEST
        sampler.epoch, sampler.offset = sampler.epoch + 1, 0
    if saved_step != step:
        checkpoint()
    if rank == 0:
        print(f"[{os.getpid()}] done: {step} steps, world size {world}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
