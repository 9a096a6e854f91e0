"""PyTorch gloo allreduce bandwidth: the peer of allreduce_bench (run under torchrun with
/usr/bin/python3). Prints per size: torch ranks=N size_mib=S algbw_gbps=A busbw_gbps=B
With a second argument M (MiB): also all_to_all_single and send/recv, measured as
allreduce_bench --p2p-mib M does: torch_all_to_all / torch_sendrecv ranks=N size_mib=M algbw_gbps=A"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def iterations_for(nbytes):
    return max(5, min(50, (1 << 30) // max(nbytes, 1)))


def timed(op, iters):
    """Median over iterations of the slowest rank's time of op() (after 2 warm-up calls)."""
    for _ in range(2):
        op()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        op()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(dt.item())
    return statistics.median(times)


def p2p(mib):
    rank, n = dist.get_rank(), dist.get_world_size()
    nbytes = mib << 20
    block = nbytes // 4 // n
    send = torch.ones(block * n, dtype=torch.float32)
    recv = torch.zeros(block * n, dtype=torch.float32)
    t = timed(lambda: dist.all_to_all_single(recv, send), iterations_for(nbytes))
    if rank == 0:
        print(f"torch_all_to_all ranks={n} size_mib={mib} algbw_gbps={block * n * 4 / t / 1e9:.3f}",
              flush=True)
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    peer = rank ^ 1

    def sendrecv():
        if peer >= n:
            return
        if rank % 2 == 0:
            dist.send(buf, peer)
        else:
            dist.recv(buf, peer)

    t = timed(sendrecv, iterations_for(nbytes))
    if rank == 0:
        print(f"torch_sendrecv ranks={n} size_mib={mib} algbw_gbps={nbytes / t / 1e9:.3f}",
              flush=True)


def main():
    sizes = [int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "1,4,16,64,256").split(",")]
    p2p_mib = int(sys.argv[2]) if len(sys.argv) > 2 else 0
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
    if p2p_mib:
        p2p(p2p_mib)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
