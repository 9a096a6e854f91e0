"""PyTorch gloo allreduce bandwidth: the peer of allreduce_bench (run under torchrun with
/usr/bin/python3). Prints per size: torch ranks=N size_mib=S algbw_gbps=A busbw_gbps=B"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def iterations_for(nbytes):
    return max(5, min(50, (1 << 30) // max(nbytes, 1)))


def main():
    sizes = [int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "1,4,16,64,256").split(",")]
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    for mib in sizes:
        nbytes = mib << 20
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        for _ in range(2):
            dist.all_reduce(t)
        times = []
        for _ in range(iterations_for(nbytes)):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times.append(dt.item())
        if rank == 0:
            algbw = nbytes / statistics.median(times) / 1e9
            busbw = algbw * 2 * (n - 1) / n
            print(f"torch ranks={n} size_mib={mib} algbw_gbps={algbw:.3f} busbw_gbps={busbw:.3f}",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
