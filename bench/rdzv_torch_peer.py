"""Peer for bench/rdzv_bench: PyTorch 1.13's dynamic rendezvous with the c10d backend.

Usage: /usr/bin/python3 bench/rdzv_torch_peer.py [--budget S] N [N ...]

With --budget, the sizes run in order until one takes longer than S seconds (or fails): how far
PyTorch's rendezvous goes on this machine, measured in the same run as trun's.

For each N: a TCPStore server in this process, N agent processes (forked after importing torch,
so the import is not timed), each creating its TCPStore client, C10dRendezvousBackend and
DynamicRendezvousHandler and calling next_rendezvous() with min_nodes = max_nodes = N. Timed from
the moment all agents are released until the last one has its rank. Store calls are counted by
wrapping the store the backend uses (the backend is the only rendezvous store traffic).

Prints one line per N: "peer nodes=N seconds=S requests_per_agent=R ranks_ok=0|1".
"""
import multiprocessing as mp
import socket
import sys
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)


class CountingStore:
    """Forwards every call to a c10d store and counts it."""

    def __init__(self, store, counter):
        self._store = store
        self._counter = counter

    def __getattr__(self, name):
        target = getattr(self._store, name)
        if not callable(target):
            return target

        def call(*args, **kwargs):
            with self._counter.get_lock():
                self._counter.value += 1
            return target(*args, **kwargs)

        return call


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(port, n, run_id, go, results, counter):
    go.wait()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    backend = C10dRendezvousBackend(CountingStore(store, counter), run_id)
    handler = DynamicRendezvousHandler.from_backend(
        run_id, store, backend, min_nodes=n, max_nodes=n,
        timeout=RendezvousTimeout(join=timedelta(seconds=120)))
    try:
        _, rank, world = handler.next_rendezvous()
    except Exception as e:  # e.g. RendezvousTimeoutError: the round did not form in time
        results.put((None, -1, type(e).__name__))
        return
    results.put((time.monotonic(), rank, world))
    # Stay until everyone is done so no node's exit disturbs the others' rounds.
    go.wait()


def time_agents(n, agent_fn, endpoint, run_id):
    """Forks n processes running agent_fn(endpoint, n, run_id, go, results, counter), releases
    them at once and prints the peer line: time until the last one has its rank. Returns those
    seconds (None when the round did not complete or the ranks were wrong)."""
    ctx = mp.get_context("fork")
    go = ctx.Event()
    results = ctx.Queue()
    counter = ctx.Value("l", 0)
    procs = [ctx.Process(target=agent_fn, args=(endpoint, n, run_id, go, results, counter))
             for _ in range(n)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # let every process reach go.wait()
    start = time.monotonic()
    go.set()
    deadline = start + 150  # the agents give up at their 120 s join timeout
    done = []
    try:
        while len(done) < n:
            entry = results.get(timeout=max(0.1, deadline - time.monotonic()))
            if entry[0] is None:
                raise RuntimeError(entry[2])
            done.append(entry)
    except Exception as e:  # the round never completed (queue.Empty, or an agent's error)
        print("peer nodes=%d failed: %s" % (n, type(e).__name__ if not str(e) else e),
              file=sys.stderr, flush=True)
        for p in procs:
            p.kill()
            p.join()
        print("peer nodes=%d seconds=-1 requests_per_agent=0 ranks_ok=0" % n, flush=True)
        return None
    end = max(t for t, _, _ in done)
    ranks = sorted(r for _, r, _ in done)
    ok = ranks == list(range(n)) and all(w == n for _, _, w in done)
    requests = counter.value
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join()
    print("peer nodes=%d seconds=%.4f requests_per_agent=%.1f ranks_ok=%d"
          % (n, end - start, requests / n, 1 if ok else 0), flush=True)
    return end - start if ok else None


def run(n):
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=120))
    seconds = time_agents(n, agent, port, "peer%d" % n)
    del server
    return seconds


if __name__ == "__main__":
    args = sys.argv[1:]
    budget = None
    if args[:1] == ["--budget"]:
        budget = float(args[1])
        args = args[2:]
    for arg in args:
        seconds = run(int(arg))
        if budget is not None and (seconds is None or seconds > budget):
            print("peer stopped after nodes=%s (budget %.0f s)" % (arg, budget), file=sys.stderr)
            break
