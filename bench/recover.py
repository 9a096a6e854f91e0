#!/usr/bin/env python3
"""Recovery without lost work (issue 38): scripts/bench.sh recover.

Part 1, one node of 4 ranks: build/examples/train_mlp under `trun --standalone
--nproc-per-node 4`, with the resilient loop (the default) and with --classic, in the same run,
alternating. In each trial, once rank 0 has printed a step drawn from the seeded range, the bench
SIGKILLs local rank 2 and measures
  - recovery: from the kill to the first step that rank 0 completes in the re-formed group (a
    step line printed after the kill at a higher attempt number);
  - steps redone: the steps rank 0 had completed before the kill that the group trained again
    (its last step before the kill, minus the step before the first one after it).
Then trun gets SIGTERM and the job stops (train_mlp saves and exits 75).

Part 2, two nodes of 2 ranks (4 ranks) in network namespaces: a hub namespace with a bridge and
two node namespaces joined to it by veth pairs (10.78.0.1 and 10.78.0.2), one trun agent in each
(`--nnodes 2 --nproc-per-node 2`, the c10d rendezvous hosted by node 0's agent, a fresh rdzv id
and port per trial). The same trials and measures as part 1, loop and --classic alternating, with
the kill of local rank 1 on the node that does not hold rank 0 (the other node follows through
the round store's generation), and of the other rank on rank 0's node. The namespaces carry this
process's pid in their names (trecover<PID>hub, trecover<PID>n0, ...); they are removed at the
end, also on an error or a signal (SIGINT, SIGTERM, SIGHUP), with every process left inside them;
those of a dead run are removed at the next start. Without root or `ip netns`, part 2 is skipped
with a line that says why.

Part 3, the state transfer of 1 GiB (bench/state_transfer): between two local ranks (shared
memory), between two ranks on two "nodes" on loopback (two agents on 127.0.0.1, each a node of
one rank: Gloo over loopback TCP), and between two one-rank nodes in the namespaces of part 2;
each against its reference: memcpy and a loopback TCP stream measured in the same process, and
for the namespaces a TCP stream between them (state_transfer --stream-recv/--stream-send).

Every process the bench starts is ended by its pid; every wait is bounded. Prints a table and
RESULT lines (see scripts/bench_recover.sh).
"""
import argparse
import collections
import contextlib
import os
import random
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

START = re.compile(r"hangbench start rank=(\d+) local_rank=(\d+) attempt=(\d+) pid=(\d+) t=([\d.]+)")
STEP = re.compile(r"hangbench step=(\d+) rank=0 attempt=(\d+) t=([\d.]+)")
TRANSFER = re.compile(r"transfer ranks=(\d+) bytes=(\d+) seconds=([\d.]+) gbps=([\d.]+) "
                      r"memcpy_gbps=([\d.]+) tcp_gbps=([\d.]+) via=(\S+)")
# The rendezvous timeouts of the multi-node tests (tests/cluster/lib.sh).
RDZV_CONF = ("last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=3,"
             "join_timeout=8,read_timeout=3")
NS_PREFIX = "trecover"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(Exception):
    """A stop signal (SIGINT, SIGTERM, SIGHUP) arrived: unwinds through the cleanups."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def on_stop_signal(signum, frame):
    raise Stopped(signum)


@contextlib.contextmanager
def signals_held():
    """Cleanup that a second Ctrl-C must not cut short (it is bounded in time)."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill_if(pid, needle):
    """SIGKILL pid if it is still a process whose command line holds needle (not a reused pid)."""
    if needle in cmdline(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class Agents:
    """The trun agents of one job (one per node), started together; their output (stdout and
    stderr) read line by line from raw pipes."""

    def __init__(self, cmds, env):
        self.procs = []
        self.bufs = []
        self.open = set()
        self.tail = collections.deque(maxlen=40)
        try:
            for i, cmd in enumerate(cmds):
                self.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                                   stdout=subprocess.PIPE,
                                                   stderr=subprocess.STDOUT, env=env))
                self.bufs.append(b"")
                self.open.add(i)
        except BaseException:
            self.end(5)  # the ones started before a failure or a signal
            raise

    def lines(self, timeout):
        """The lines (node, text) that arrived within timeout seconds; [] if none."""
        fds = {self.procs[i].stdout.fileno(): i for i in self.open}
        if not fds:
            time.sleep(timeout)
            return []
        ready, _, _ = select.select(list(fds), [], [], timeout)
        out = []
        for fd in ready:
            i = fds[fd]
            data = os.read(fd, 65536)
            if not data:
                self.open.discard(i)
                continue
            *full, self.bufs[i] = (self.bufs[i] + data).split(b"\n")
            for raw in full:
                text = raw.decode(errors="replace")
                self.tail.append("[node %d] %s" % (i, text))
                out.append((i, text))
        return out

    def running(self):
        return any(p.poll() is None for p in self.procs)

    def end(self, grace):
        """SIGTERM to every agent still running, their output drained for up to grace seconds,
        then SIGKILL. Bounded."""
        with signals_held():
            for p in self.procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.time() + grace
            while self.running() and time.time() < deadline:
                self.lines(0.1)
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
                p.stdout.close()

    def text(self):
        return "\n".join(self.tail)


def run_to_end(cmds, env, timeout):
    """Runs the agents of one job to their end (at most timeout seconds): their output."""
    agents = Agents(cmds, env)
    out = []
    try:
        deadline = time.time() + timeout
        while time.time() < deadline:
            got = agents.lines(0.2)
            out += [text for _, text in got]
            if not got and not agents.running():
                break
    finally:
        agents.end(10)
    return "\n".join(out)


class Netns:
    """A hub namespace with a bridge and node namespaces joined to it by veth pairs, node i at
    10.78.0.(i+1)/24 (the tests use 10.77.0.0/24)."""

    def __init__(self, nodes):
        self.tag = "%s%d" % (NS_PREFIX, os.getpid())
        self.hub = self.tag + "hub"
        self.nodes = [self.tag + "n%d" % i for i in range(nodes)]
        self.made = []

    @staticmethod
    def addr(i):
        return "10.78.0.%d" % (i + 1)

    def prefix(self, i):
        return ["ip", "netns", "exec", self.nodes[i]]

    @staticmethod
    def ip(*args):
        r = subprocess.run(["ip"] + list(args), capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            raise RuntimeError("ip %s: %s" % (" ".join(args), r.stderr.strip()))

    def add(self, name):
        self.ip("netns", "add", name)
        self.made.append(name)

    def create(self):
        self.add(self.hub)
        self.ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        self.ip("-n", self.hub, "link", "set", "br0", "up")
        for i, ns in enumerate(self.nodes):
            self.add(ns)
            self.ip("-n", self.hub, "link", "add", "h%d" % i, "type", "veth", "peer", "name",
                    "eth0", "netns", ns)
            self.ip("-n", self.hub, "link", "set", "h%d" % i, "master", "br0")
            self.ip("-n", self.hub, "link", "set", "h%d" % i, "up")
            self.ip("-n", ns, "addr", "add", self.addr(i) + "/24", "dev", "eth0")
            self.ip("-n", ns, "link", "set", "eth0", "up")
            self.ip("-n", ns, "link", "set", "lo", "up")

    @staticmethod
    def end_inside(name):
        """SIGKILL every process still inside namespace name (by pid), waits up to 5 s."""
        for _ in range(50):
            r = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                               timeout=20)
            pids = [int(p) for p in r.stdout.split() if p.isdigit()]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.1)

    def remove(self):
        with signals_held():
            for name in reversed(self.made):
                self.end_inside(name)
                subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
            self.made = []

    @staticmethod
    def remove_stale():
        """The namespaces of runs of this bench that are gone (one pass over what exists)."""
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
        for line in r.stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            m = re.fullmatch(NS_PREFIX + r"(\d+)(hub|n\d+)", name)
            if not m or "recover.py" in cmdline(int(m.group(1))):
                continue
            print("removing namespace %s (its run, pid %s, is gone)" % (name, m.group(1)))
            Netns.end_inside(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


def netns_unavailable():
    """Why two network-namespace nodes cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "no 'ip' command (iproute2)"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        return "'ip netns list' failed: " + r.stderr.strip()
    return None


def mlp_args(a, ckpt, mode):
    args = [a.train_mlp, "--print-steps",
            "--epochs", "100000", "--dataset-size", "4096", "--batch-size", "16",
            "--step-sleep-ms", str(a.step_sleep_ms), "--ckpt-every", str(a.ckpt_every),
            "--ckpt-dir", ckpt]
    if mode == "classic":
        args.append("--classic")
    return args


def one_node_cmds(a, mode, workdir, port):
    ckpt = os.path.join(workdir, "ckpt-%s-%d" % (mode, port))
    return [[a.trun, "--standalone", "--nproc-per-node", "4", "--max-restarts", "3"]
            + mlp_args(a, ckpt, mode)]


def two_node_cmds(a, ns, mode, workdir, port):
    ckpt = os.path.join(workdir, "ckpt-%s-%d" % (mode, port))
    return [ns.prefix(i) + [a.trun, "--local-addr", ns.addr(i), "--nnodes", "2",
                            "--nproc-per-node", "2", "--max-restarts", "3",
                            "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", "%s:%d" % (ns.addr(0), port),
                            "--rdzv-id", "recover-%s-%d" % (mode, port),
                            "--rdzv-conf", RDZV_CONF] + mlp_args(a, ckpt, mode)
            for i in range(len(ns.nodes))]


def pick_victim(where, starts):
    """The (node, local rank) to kill: "one" local rank 2 of the one node; "other" local rank 1 of
    a node that does not hold rank 0; "same" the other rank of rank 0's node. None while the
    start lines do not tell yet."""
    if where == "one":
        return (0, 2)
    home = [(n, lr) for n, ranks in starts.items() for lr, (rank, _) in ranks.items() if rank == 0]
    if not home or len(starts) < 2:
        return None
    node0, lr0 = home[0]
    if where == "other":
        return (min(n for n in starts if n != node0), 1)
    return (node0, 1 if lr0 != 1 else 0)


def trial(a, cmds, env, mode, where, kill_after):
    """One job: returns (recovery_s, steps_redone, detail) or raises RuntimeError."""
    starts = {}        # node -> local rank -> (rank, pid), of the latest start line
    workers = set()    # every worker pid seen (ended at the end if left behind)
    last_step = None   # rank 0's last step line before the kill
    killed_at = None
    killed_attempt = None
    victim = None      # (node, local rank, rank, pid)
    replaced_t = None  # the victim's replacement's start line (its group formed)
    rank0_t = None     # rank 0's start line in the re-formed group
    result = None
    agents = Agents(cmds, env)
    deadline = time.time() + a.trial_timeout
    try:
        while time.time() < deadline and result is None:
            got = agents.lines(0.5)
            if not got and not agents.running():
                break
            for node, line in got:
                m = START.search(line)
                if m:
                    rank, lr, attempt = int(m.group(1)), int(m.group(2)), int(m.group(3))
                    pid, t = int(m.group(4)), float(m.group(5))
                    starts.setdefault(node, {})[lr] = (rank, pid)
                    workers.add(pid)
                    if killed_at is not None and attempt > killed_attempt:
                        if (node, lr) == victim[:2] and pid != victim[3] and replaced_t is None:
                            replaced_t = t
                        if rank == 0 and rank0_t is None:
                            rank0_t = t
                    continue
                m = STEP.search(line)
                if not m or result is not None:
                    continue
                step, attempt, t = int(m.group(1)), int(m.group(2)), float(m.group(3))
                if killed_at is None:
                    last_step = step
                    slot = pick_victim(where, starts)
                    if step >= kill_after and slot and slot[1] in starts.get(slot[0], {}):
                        rank, pid = starts[slot[0]][slot[1]]
                        victim = (slot[0], slot[1], rank, pid)
                        killed_attempt = attempt
                        killed_at = time.time()
                        os.kill(pid, signal.SIGKILL)
                elif attempt > killed_attempt and t > killed_at:
                    def after(x):
                        return "%.0f ms" % ((x - killed_at) * 1e3) if x else "-"
                    result = (t - killed_at, max(0, last_step - (step - 1)),
                              "rank %d on node %d killed after step %d, first step after: %d; "
                              "replacement formed +%s, rank 0 formed +%s" %
                              (victim[2], victim[0], last_step, step, after(replaced_t),
                               after(rank0_t)))
    finally:
        agents.end(30)
        with signals_held():
            for pid in workers:
                kill_if(pid, "train_mlp")
    if result is None:
        raise RuntimeError("%s trial (%s): no recovery seen (exits %s); last lines:\n%s" %
                           (mode, where, [p.returncode for p in agents.procs], agents.text()))
    return result


def parse_transfer(text):
    m = TRANSFER.search(text)
    if not m:
        raise RuntimeError("state_transfer printed no result:\n" + text[-3000:])
    return {"bytes": int(m.group(2)), "seconds": float(m.group(3)), "gbps": float(m.group(4)),
            "memcpy_gbps": float(m.group(5)), "tcp_gbps": float(m.group(6)), "via": m.group(7)}


def transfer(a, env, where, ns=None, port=29740):
    """bench/state_transfer on 2 local ranks (where="local"), 2 agents of one rank each on
    loopback ("loopback") or in the namespaces ("netns"). For "netns", the reference is a TCP
    stream from node 0 to node 1 (its tcp_gbps is replaced by it)."""
    args = ["--mib", str(a.mib)]
    if where == "local":
        # --hang-detection off: rank 0's references (memcpy, the TCP stream) after the transfer are
        # no training steps, and a slow transfer must not be judged a hang.
        return parse_transfer(run_to_end([[a.trun, "--standalone", "--nproc-per-node", "2",
                                           "--hang-detection", "off", a.state_transfer] + args],
                                         env, 300))
    cmds = []
    for node in range(2):
        if where == "loopback":
            prefix, addr = [], []
            endpoint = "127.0.0.1:%d" % port
            conf = "is_host=%d" % (1 if node == 0 else 0)
        else:
            prefix, addr = ns.prefix(node), ["--local-addr", ns.addr(node)]
            endpoint = "%s:%d" % (ns.addr(0), port)
            conf = RDZV_CONF
        cmds.append(prefix + [a.trun] + addr + [
            "--nnodes", "2", "--nproc-per-node", "1", "--hang-detection", "off",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", "transfer-%d" % port, "--rdzv-conf", conf, a.state_transfer] + args)
    r = parse_transfer(run_to_end(cmds, env, 300))
    if where == "netns":
        r["tcp_gbps"] = stream_between(a, env, ns, port + 1)
    return r


def stream_between(a, env, ns, port):
    """GB/s of a TCP stream of --mib MiB from node 0's namespace to node 1's."""
    where = "%s:%d" % (ns.addr(1), port)
    recv = Agents([ns.prefix(1) + [a.state_transfer, "--stream-recv", where, "--mib",
                                   str(a.mib)]], env)
    send = None
    out = []
    try:
        deadline = time.time() + 10
        while "listening" not in out and time.time() < deadline and recv.open:
            out += [text for _, text in recv.lines(0.2)]
        if "listening" not in out:
            raise RuntimeError("the stream receiver did not listen:\n" + recv.text())
        send = Agents([ns.prefix(0) + [a.state_transfer, "--stream-send", where, "--mib",
                                       str(a.mib)]], env)
        deadline = time.time() + 120
        while recv.open and time.time() < deadline:
            out += [text for _, text in recv.lines(0.2) + send.lines(0)]
    finally:
        recv.end(5)
        if send:
            send.end(5)
    m = re.search(r"stream bytes=\d+ seconds=[\d.]+ gbps=([\d.]+)", "\n".join(out))
    if not m:
        raise RuntimeError("the TCP stream between the namespaces gave no result:\n" +
                           recv.text() + "\n" + (send.text() if send else ""))
    return float(m.group(1))


def summary(rs):
    return {"median_ms": statistics.median(r[0] for r in rs) * 1e3,
            "max_ms": max(r[0] for r in rs) * 1e3,
            "redone_mean": statistics.mean(r[1] for r in rs),
            "redone_max": max(r[1] for r in rs)}


def print_case(title, rows):
    print(title)
    print("%-9s %14s %14s %14s %12s" % ("path", "median ms", "max ms", "redone (mean)",
                                         "redone (max)"))
    for mode in ("loop", "classic"):
        s = summary(rows[mode])
        print("%-9s %14.1f %14.1f %14.2f %12d" % (mode, s["median_ms"], s["max_ms"],
                                                   s["redone_mean"], s["redone_max"]))
    print()


def print_results(name_ms, name_redone, rows):
    loop, classic = summary(rows["loop"]), summary(rows["classic"])
    print("RESULT name=%s value=%.1f unit=ms peer=%.1f ratio=%.2f" %
          (name_ms, loop["median_ms"], classic["median_ms"],
           classic["median_ms"] / loop["median_ms"]))
    print("RESULT name=%s value=%d unit=steps peer=%.2f ratio=%.2f" %
          (name_redone, loop["redone_max"], classic["redone_mean"],
           (classic["redone_mean"] + 1) / (loop["redone_max"] + 1)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trun", required=True)
    ap.add_argument("--train-mlp", required=True)
    ap.add_argument("--state-transfer", required=True)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=38)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--step-sleep-ms", type=int, default=20)
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--trial-timeout", type=float, default=120)
    ap.add_argument("--parts", default="one-node,two-nodes,transfer",
                    help="comma-separated: one-node, two-nodes, transfer (default: all)")
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    if not parts or parts - {"one-node", "two-nodes", "transfer"}:
        ap.error("--parts takes one-node, two-nodes, transfer")
    for s in STOP_SIGNALS:
        signal.signal(s, on_stop_signal)

    skip_netns = netns_unavailable()
    if skip_netns:
        print("two network-namespace nodes: skipped (%s); the one-node and loopback results stand "
              "alone" % skip_netns, flush=True)
    else:
        Netns.remove_stale()
    cases = []  # (key, where)
    if "one-node" in parts:
        cases.append(("one", "one"))
    if "two-nodes" in parts and not skip_netns:
        cases += [("two_other", "other"), ("two_same", "same")]
    rng = random.Random(a.seed)
    rows = {key: {"loop": [], "classic": []} for key, _ in cases}
    local = remote = netns = None
    ns = None
    with tempfile.TemporaryDirectory(prefix="trun-recover-") as workdir:
        # TMPDIR: the agents' log directories stay inside workdir even if an agent is killed.
        env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=workdir)
        try:
            if not skip_netns and parts & {"two-nodes", "transfer"}:
                ns = Netns(2)
                ns.create()
            port = 29710
            for i in range(a.trials):
                kill_after = rng.randrange(25, 45)
                for key, where in cases:
                    for mode in ("loop", "classic"):
                        port += 1
                        if where == "one":
                            cmds = one_node_cmds(a, mode, workdir, port)
                        else:
                            cmds = two_node_cmds(a, ns, mode, workdir, port)
                        rec, redone, detail = trial(a, cmds, env, mode, where, kill_after)
                        rows[key][mode].append((rec, redone))
                        print("trial %d %-9s %-7s recovery %8.1f ms  steps redone %3d  (%s)" %
                              (i + 1, key, mode, rec * 1e3, redone, detail), flush=True)

            # Three transfers each, the median by rate (this 2-core machine is noisy).
            def median_of(runs):
                return sorted(runs, key=lambda r: r["gbps"])[len(runs) // 2]
            if "transfer" in parts:
                local = median_of([transfer(a, env, "local") for _ in range(3)])
                remote = median_of([transfer(a, env, "loopback") for _ in range(3)])
                if ns:
                    netns = median_of([transfer(a, env, "netns", ns, 29760 + 2 * k)
                                       for k in range(3)])
        finally:
            if ns:
                ns.remove()

    print()
    titles = {
        "one": "one node, 4 ranks, SIGKILL of local rank 2",
        "two_other": "two network-namespace nodes of 2 ranks, SIGKILL of local rank 1 of the node "
                     "without rank 0",
        "two_same": "two network-namespace nodes of 2 ranks, SIGKILL of the other rank on rank "
                    "0's node",
    }
    for key, _ in cases:
        print_case("%s (%d trials each, %d ms steps, checkpoint every %d steps)" %
                   (titles[key], a.trials, a.step_sleep_ms, a.ckpt_every), rows[key])
    if local:
        print("state transfer of %d MiB (median of 3 by rate; references measured in the same "
              "run)" % a.mib)
        print("%-32s %10s %24s %10s" % ("between", "GB/s", "reference", "ref GB/s"))
        print("%-32s %10.2f %24s %10.2f" % ("2 local ranks (%s)" % local["via"], local["gbps"],
                                             "memcpy", local["memcpy_gbps"]))
        print("%-32s %10.2f %24s %10.2f" % ("2 nodes on loopback (%s)" % remote["via"],
                                             remote["gbps"], "loopback TCP stream",
                                             remote["tcp_gbps"]))
        if netns:
            print("%-32s %10.2f %24s %10.2f" % ("2 netns nodes (%s)" % netns["via"],
                                                 netns["gbps"], "TCP stream between them",
                                                 netns["tcp_gbps"]))
        print()
    if "one" in rows:
        print_results("recover_one_node_ms", "recover_steps_redone", rows["one"])
    if "two_other" in rows:
        print_results("recover_two_nodes_ms", "recover_two_nodes_steps_redone", rows["two_other"])
        print_results("recover_two_nodes_rank0_node_ms",
                      "recover_two_nodes_rank0_node_steps_redone", rows["two_same"])
    if local:
        print("RESULT name=state_transfer_local_gbps value=%.2f unit=GB/s peer=%.2f ratio=%.2f" %
              (local["gbps"], local["memcpy_gbps"], local["gbps"] / local["memcpy_gbps"]))
        print("RESULT name=state_transfer_nodes_gbps value=%.2f unit=GB/s peer=%.2f ratio=%.2f" %
              (remote["gbps"], remote["tcp_gbps"], remote["gbps"] / remote["tcp_gbps"]))
    if netns:
        print("RESULT name=state_transfer_netns_gbps value=%.2f unit=GB/s peer=%.2f ratio=%.2f" %
              (netns["gbps"], netns["tcp_gbps"], netns["gbps"] / netns["tcp_gbps"]))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Stopped as e:
        print("recover: stopped by %s; its processes, namespaces and temporary files are removed"
              % e, flush=True)
        sys.exit(128 + e.signum)
