"""Peer for bench/rdzv_bench --etcd: PyTorch 1.13's dynamic rendezvous with its etcd backend
(torchrun's `--rdzv-backend=etcd-v2`: EtcdRendezvousBackend over python-etcd, etcd's v2 API).

Usage: /usr/bin/python3 bench/rdzv_torch_etcd_peer.py PORT N [N ...]

PORT is an etcd on 127.0.0.1 started with --enable-v2. For each N: N agent processes (forked
after importing torch, so the import is not timed), each creating its etcd client, backend and
DynamicRendezvousHandler and calling next_rendezvous() with min_nodes = max_nodes = N. Timed from
the moment all agents are released until the last one has its rank. etcd requests are counted by
wrapping the client the backend uses (the backend is the only rendezvous traffic).

Prints one line per N: "peer nodes=N seconds=S requests_per_agent=R ranks_ok=0|1".
"""
import os
import sys
import time
from datetime import timedelta

import etcd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rdzv_torch_peer import CountingStore, time_agents  # noqa: E402
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)
from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend
from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore


def agent(port, n, run_id, go, results, counter):
    go.wait()
    client = etcd.Client("127.0.0.1", port, read_timeout=60)
    backend = EtcdRendezvousBackend(CountingStore(client, counter), run_id,
                                    key_prefix="/torch/elastic/bench")
    store = EtcdStore(client, "/torch/elastic/bench-store/" + run_id)
    handler = DynamicRendezvousHandler.from_backend(
        run_id, store, backend, min_nodes=n, max_nodes=n,
        timeout=RendezvousTimeout(join=timedelta(seconds=120)))
    _, rank, world = handler.next_rendezvous()
    results.put((time.monotonic(), rank, world))
    go.wait()  # stay until everyone is done


if __name__ == "__main__":
    for arg in sys.argv[2:]:
        n = int(arg)
        time_agents(n, agent, int(sys.argv[1]), "peer-etcd-%d-%d" % (n, os.getpid()))
