"""PyTorch 1.13 gloo's results for the collectives that collectives_torch_test.cpp compares with
libtrun_worker's (pg_worker's "dump" scenario computes the same with trun, from the same input
formulas). Run under torchrun; writes each result as raw little-endian bytes to
<dir>/<rank>/<name>.bin (a rank writes only the results it holds: reduce on its root, gather on
its root)."""
import os
import sys

import torch
import torch.distributed as dist

N = 37  # elements per rank and collective
DTYPES = {"int32": torch.int32, "int64": torch.int64, "int8": torch.int8, "uint8": torch.uint8,
          "float32": torch.float32}
OPS = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
       "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR,
       "bxor": dist.ReduceOp.BXOR}
PROD = [1, -1, 2, 1, -2, 1, 1]


def value(kind, dtype, rank, i):
    """Element i of rank's input: the same formulas as pg_worker's dump_input()."""
    if kind == "bits":
        return (rank * 2654435761 + i * 40503 + 12345) % 2147483647
    if kind == "product":
        v = PROD[(rank * 3 + i) % 7]
        return abs(v) if dtype == "uint8" else v
    v = (rank * 31 + i * 17) % 23 - 11
    return v + 11 if dtype == "uint8" else v


def tensor(kind, dtype, rank, n=N, base=0):
    vals = [value(kind, dtype, rank, base + i) for i in range(n)]
    # Through int64: .to() wraps integers to the narrower type, as trun's store() does.
    return torch.tensor(vals, dtype=torch.int64).to(DTYPES[dtype])


def kind_of(op):
    return "bits" if op in ("band", "bor", "bxor") else ("product" if op == "product" else "plain")


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(f"{out}/{rank}", exist_ok=True)

    def save(name, t):
        with open(f"{out}/{rank}/{name}.bin", "wb") as f:
            f.write(t.contiguous().numpy().tobytes())

    for dt in DTYPES:
        for op in OPS:
            if dt == "float32" and kind_of(op) == "bits":
                continue
            t = tensor(kind_of(op), dt, rank)
            dist.all_reduce(t, op=OPS[op])
            save(f"allreduce_{op}_{dt}", t)
            t = tensor(kind_of(op), dt, rank)
            dist.reduce(t, dst=1, op=OPS[op])
            if rank == 1:
                save(f"reduce_{op}_{dt}", t)
        # gather to rank 2, scatter from rank 0
        t = tensor("plain", dt, rank)
        lst = [torch.zeros_like(t) for _ in range(world)] if rank == 2 else None
        dist.gather(t, gather_list=lst, dst=2)
        if rank == 2:
            save(f"gather_{dt}", torch.cat(lst))
        recv = torch.zeros_like(t)
        chunks = list(tensor("plain", dt, 0, N * world).chunk(world)) if rank == 0 else None
        dist.scatter(recv, scatter_list=chunks, src=0)
        save(f"scatter_{dt}", recv)
        # uneven all_to_all: (N + 3 * src + 5 * dst) % (2 * N + 1) elements src -> dst
        split = lambda s, d: (N + 3 * s + 5 * d) % (2 * N + 1)
        sc = [split(rank, d) for d in range(world)]
        rc = [split(s, rank) for s in range(world)]
        send = torch.cat([tensor("plain", dt, rank, sc[d], 1000 * d) for d in range(world)])
        recv = torch.zeros(sum(rc), dtype=DTYPES[dt])
        dist.all_to_all_single(recv, send, output_split_sizes=rc, input_split_sizes=sc)
        save(f"all_to_all_v_{dt}", recv)
        # a ring of send/recv
        nxt, prv = (rank + 1) % world, (rank + world - 1) % world
        send = tensor("plain", dt, rank + 100)
        recv = torch.zeros_like(send)
        reqs = [dist.isend(send, nxt), dist.irecv(recv, prv)]
        for r in reqs:
            r.wait()
        save(f"sendrecv_{dt}", recv)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
