#!/usr/bin/env python3
# Hang recovery (issue 36), run by scripts/bench_hang.sh (see its header for usage): for each
# launcher {trun, torchrun with its default gloo timeout, torchrun with a short timeout}, fault
# {sigstop, spin, mismatch} and topology {1 node x 4 ranks, 2 netns nodes x 2 ranks}, start a job,
# let it train, fault one rank, and time from the fault to the replacement group's first step.
#
# Workers: build/examples/train_mlp --print-steps (trun) and bench/hang_torch.py (torchrun), both
# printing "hangbench start ... pid=P", "hangbench step=N rank=0 attempt=A t=UNIX" and, from the
# faulty rank, "hangbench fault kind=K ... t=UNIX". The fault's time is that line's t (spin,
# mismatch) or the moment this script sent SIGSTOP to the rank's pid; recovery is the first step
# line with attempt >= 1. For trun the culprit is read from the --event-log's trun.hang event
# (metadata "rank" or "culprits") or else from a log line with "hang" in it.
#
# Cleanup: every launcher runs in a session of its own; at the end of a trial the launchers get
# SIGTERM, then (after 5 s) their sessions and every process seen below them get SIGKILL, by pid.
# The two-node rows run in network namespaces hb<pid>hub/n0/n1 (the layout of
# tests/cluster/lib.sh: a bridge in the hub, one veth per node, 10.78.0.x/24), created once and
# deleted at the end, on Ctrl-C and on SIGTERM. lib.sh itself is not sourced: its stale-run sweep
# deletes namespaces whose creator is not cluster.sh/chaos.sh, which would include these.
import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HANG_RANK = 3          # the faulty rank: the last one (on node 1 in the two-node rows)
MAX_RESTARTS = 3
KINDS = ["sigstop", "spin", "mismatch"]
TOPOS = ["1x4", "2x2"]
LAUNCHERS = ["trun", "torch_default", "torch_short"]
LAUNCHER_TITLE = {"trun": "trun (defaults)", "torch_default": "torchrun, default timeout",
                  "torch_short": "torchrun, short timeout"}
TORCH_DEFAULT_TIMEOUT_S = 1800  # gloo's default (torch.distributed.init_process_group docs)

LINE = re.compile(r"hangbench (start|step=\d+|fault) (.*)")


def now():
    return time.time()


class Interrupted(Exception):
    pass


def on_signal(signum, _frame):
    raise Interrupted(f"signal {signum}")


# --- processes -------------------------------------------------------------------------------

def children_map():
    kids = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
            ppid = int(s[s.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(pids):
    kids = children_map()
    out, todo = set(), list(pids)
    while todo and len(out) < 10000:
        p = todo.pop()
        for c in kids.get(p, []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def kill(pid, sig):
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Node:
    """One launcher process (in a namespace or not) and its log."""

    def __init__(self, cmd, log, cwd, env):
        self.log_path = log
        self.logf = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.logf, stderr=subprocess.STDOUT, cwd=cwd,
                                     env=env, start_new_session=True)
        self.seen = set()  # every process seen below the launcher
        self.offset = 0
        self.buf = b""

    def new_lines(self):
        with open(self.log_path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        data = self.buf + data
        lines = data.split(b"\n")
        self.buf = lines.pop()
        return [ln.decode("utf-8", "replace") for ln in lines]

    def watch(self):
        if self.proc.poll() is None:
            self.seen |= descendants([self.proc.pid])

    def stop(self):
        self.watch()
        if self.proc.poll() is None:
            kill(self.proc.pid, signal.SIGTERM)

    def finish(self, deadline):
        while self.proc.poll() is None and now() < deadline:
            time.sleep(0.05)
        self.seen |= descendants([self.proc.pid] + list(self.seen))
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            kill(self.proc.pid, signal.SIGKILL)
        for p in self.seen:
            kill(p, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.logf.close()


# --- network namespaces ----------------------------------------------------------------------

class Netns:
    def __init__(self):
        self.tag = f"hb{os.getpid()}"
        self.hub = self.tag + "hub"
        self.names = []

    def ns(self, i):
        return f"{self.tag}n{i}"

    @staticmethod
    def addr(i):
        return f"10.78.0.{i + 1}"

    def ip(self, *args):
        subprocess.run(["ip", *args], check=True, stdout=subprocess.DEVNULL)

    @staticmethod
    def remove_stale():
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for line in out.splitlines()[:1000]:
            name = line.split()[0] if line.split() else ""
            m = re.fullmatch(r"hb(\d+)(hub|n\d+)", name)
            if not m:
                continue
            try:
                with open(f"/proc/{m.group(1)}/cmdline", "rb") as f:
                    if b"hang_bench" in f.read():
                        continue
            except OSError:
                pass
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                  text=True).stdout.split()
            for p in pids:
                kill(int(p), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], stderr=subprocess.DEVNULL)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
            print(f"removed namespace {name} (its run is gone)", file=sys.stderr)

    def hostname(self, i):
        return self.ns(i)

    def create(self, n):
        self.remove_stale()
        # torchrun's c10d agent gives its workers MASTER_ADDR = its host name, and gloo binds to
        # what the host name resolves to: each node runs in a UTS namespace of its own (see
        # commands()) with a name that `ip netns exec` resolves, through /etc/netns/NS/hosts
        # (bind-mounted over /etc/hosts), to the node's address.
        hosts = "127.0.0.1 localhost\n" + "".join(f"{self.addr(i)} {self.hostname(i)}\n"
                                                  for i in range(n))
        self.ip("netns", "add", self.hub)
        self.names.append(self.hub)
        self.ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        self.ip("-n", self.hub, "link", "set", "br0", "up")
        self.ip("-n", self.hub, "link", "set", "lo", "up")
        for i in range(n):
            ns = self.ns(i)
            self.ip("netns", "add", ns)
            self.names.append(ns)
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(hosts)
            self.ip("-n", self.hub, "link", "add", f"h{i}", "type", "veth", "peer", "name", "eth0",
                    "netns", ns)
            self.ip("-n", self.hub, "link", "set", f"h{i}", "master", "br0")
            self.ip("-n", self.hub, "link", "set", f"h{i}", "up")
            self.ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            self.ip("-n", ns, "link", "set", "eth0", "up")
            self.ip("-n", ns, "link", "set", "lo", "up")

    def kill_inside(self):
        for name in self.names:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                  text=True).stdout.split()
            for p in pids:
                kill(int(p), signal.SIGKILL)

    def delete(self):
        self.kill_inside()
        for name in reversed(self.names):
            subprocess.run(["ip", "netns", "del", name], stderr=subprocess.DEVNULL)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        self.names = []


# --- one trial -------------------------------------------------------------------------------

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def commands(a, launcher, kind, topo, work, port, rdzv_id, netns):
    """[(argv, log name)] for the launchers of one trial."""
    fault = [] if kind == "sigstop" else ["--hang-at-step", str(a.hang_at_step), "--hang-rank",
                                          str(HANG_RANK), "--hang-kind", kind]
    ckpt = os.path.join(work, "ckpt")
    if launcher == "trun":
        worker = [a.train_mlp, "--print-steps", "--step-sleep-ms", str(a.step_sleep_ms),
                  "--epochs", "1000000", "--ckpt-dir", ckpt, "--ckpt-every", "20", *fault]
    else:
        worker = [a.hang_torch, "--step-sleep-ms", str(a.step_sleep_ms),
                  "--ckpt-dir", ckpt, "--ckpt-every", "20", *fault]
        if launcher == "torch_short":
            worker += ["--timeout-s", str(a.torch_timeout)]
    out = []
    if topo == "1x4":
        if launcher == "trun":
            argv = [a.trun, "--standalone", "--nproc-per-node", "4", "--max-restarts",
                    str(MAX_RESTARTS), "--event-log", os.path.join(work, "events_0.jsonl"),
                    *worker]
        else:
            argv = [a.python, a.torchrun, "--nnodes", "1", "--nproc_per_node", "4",
                    "--max_restarts", str(MAX_RESTARTS), "--master_addr", "127.0.0.1",
                    "--master_port", str(port), "--redirects", "9:1", "--tee", "9:1", *worker]
        out.append((argv, "node_0.log"))
        return out
    for i in range(2):
        pre = ["ip", "netns", "exec", netns.ns(i)]
        endpoint = f"{netns.addr(0)}:{port}"
        if launcher == "trun":
            argv = pre + [a.trun, "--nnodes", "2", "--nproc-per-node", "2", "--max-restarts",
                          str(MAX_RESTARTS), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                          "--rdzv-id", rdzv_id, "--local-addr", netns.addr(i), "--event-log",
                          os.path.join(work, f"events_{i}.jsonl"), *worker]
        else:
            uts = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', netns.hostname(i)]
            argv = pre + uts + [a.python, a.torchrun, "--nnodes", "2", "--nproc_per_node", "2",
                          "--max_restarts", str(MAX_RESTARTS), "--rdzv_backend", "c10d",
                          "--rdzv_endpoint", endpoint, "--rdzv_id", rdzv_id, "--rdzv_conf",
                          f"is_host={1 if i == 0 else 0}", "--redirects", "9:1", "--tee", "9:1",
                          *worker]
        out.append((argv, f"node_{i}.log"))
    return out


def parse_fields(rest):
    return dict(kv.split("=", 1) for kv in rest.split() if "=" in kv)


def trun_culprit(work, logs):
    """(culprit ranks or None, verdict text) from the event logs, else the agents' logs."""
    for i in range(2):
        path = os.path.join(work, f"events_{i}.jsonl")
        if not os.path.exists(path):
            continue
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev.get("name") != "trun.hang":
                    continue
                md = ev.get("metadata", {})
                val = md.get("culprits", md.get("rank"))
                ranks = [int(x) for x in re.findall(r"-?\d+", json.dumps(val))] if val is not None else []
                summary = str(md.get("summary", ""))
                if not ranks:
                    m = re.match(r"ranks? (\d+)", summary)
                    ranks = [int(m.group(1))] if m else []
                return ranks, summary
    for path in logs:
        with open(path, errors="replace") as f:
            for line in f:
                if "hang" in line.lower() and "made no progress" in line:
                    m = re.search(r"\branks? (\d+) \(", line)
                    return ([int(m.group(1))] if m else []), line.strip()
    # No hang verdict: the libtrun_worker error that ended the attempt. A mismatch found by the
    # shared-memory path names the local ranks whose call differs from the majority's ("local
    # rank 1 entered broadcast #124 ..., where local ranks 0 and 2-3 entered allreduce ..."); the
    # node's "hangbench start rank=R local_rank=L" lines of attempt 0 turn them into global ranks.
    # Else how the attempt ended.
    # The node that found it first: the one whose log has the faulty rank's "hangbench fault"
    # line (the other node may repeat the message with its own local ranks).
    failed = ""
    texts = []
    for path in logs:
        with open(path, errors="replace") as f:
            texts.append(f.read())
    texts.sort(key=lambda t: "hangbench fault" not in t)
    for text in texts:
        m = re.search(r"differs across local ranks: local ranks? ([\d, and-]+?) entered .*|"
                      r": local ranks? ([\d, and-]+?) passed .*", text)
        if m:
            local = []
            for a, b in re.findall(r"(\d+)(?:-(\d+))?", m.group(1) or m.group(2)):
                local.extend(range(int(a), int(b or a) + 1))
            to_global = {int(l): int(r) for r, l in
                         re.findall(r"hangbench start rank=(\d+) local_rank=(\d+) attempt=0", text)}
            ranks = [to_global[l] for l in local if l in to_global]
            return (ranks or None), "no hang verdict; " + m.group(0).strip()[:300]
        for line in text.splitlines():
            m = re.search(r"worker group failed \(attempt 0\): (.*)", line)
            if m and not failed:
                failed = "no hang verdict; failed: " + m.group(1).strip()
    return None, failed


def torch_first_failure(logs, pids):
    """The rank torchrun blames, as (rank, text): its first 'failed (exitcode: X) local_rank: L
    (pid: P)' line (node 0's log first: the lines carry no time), the rank found by the pid."""
    rank_of = {pid: rank for (_, rank), pid in pids.items()}
    for path in logs:
        with open(path, errors="replace") as f:
            for line in f:
                m = re.search(r"failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: (\d+)\)", line)
                if m:
                    rank = rank_of.get(int(m.group(2)), -1)
                    return rank, f"reports rank {rank} failed (exitcode {m.group(1)})"
    return None


def run_trial(a, launcher, kind, topo, cap, trial, netns, tmp):
    work = os.path.join(tmp, f"{launcher}-{kind}-{topo}-{trial}")
    os.makedirs(work)
    env = dict(os.environ, TMPDIR=work, OMP_NUM_THREADS="1")
    port = free_port() if topo == "1x4" else 29700 + trial + 10 * KINDS.index(kind) + \
        100 * LAUNCHERS.index(launcher)
    rdzv_id = f"hb-{os.getpid()}-{launcher}-{kind}-{trial}"
    nodes = [Node(argv, os.path.join(work, log), work, env)
             for argv, log in commands(a, launcher, kind, topo, work, port, rdzv_id, netns)]
    res = {"recovery": None, "fault": None, "steps": [], "note": "", "culprit": None,
           "verdict": "", "work": work}
    pids = {}  # (attempt, rank) -> pid
    t_start = now()
    t_fault = None
    last_step = 0
    try:
        while True:
            t = now()
            for nd in nodes:
                nd.watch()
                for line in nd.new_lines():
                    m = LINE.search(line)
                    if not m:
                        continue
                    f = parse_fields(m.group(2))
                    if m.group(1) == "start":
                        pids[(int(f["attempt"]), int(f["rank"]))] = int(f["pid"])
                    elif m.group(1) == "fault":
                        if t_fault is None:
                            t_fault = float(f["t"])
                    else:
                        step, att, ts = int(m.group(1)[5:]), int(f["attempt"]), float(f["t"])
                        if att == 0:
                            res["steps"].append(ts)
                            last_step = step
                        elif res["recovery"] is None and t_fault is not None:
                            res["recovery"] = ts - t_fault
            if res["recovery"] is not None:
                break
            if kind == "sigstop" and t_fault is None and last_step >= a.hang_at_step:
                pid = pids.get((0, HANG_RANK))
                if pid:
                    os.kill(pid, signal.SIGSTOP)
                    t_fault = now()
            if t_fault is None and t - t_start > a.start_cap:
                res["note"] = f"no fault within {a.start_cap:.0f} s of the start (step {last_step})"
                break
            if t_fault is not None and t - t_fault > cap:
                res["note"] = f">{cap:.0f}"
                break
            if all(nd.proc.poll() is not None for nd in nodes):
                res["note"] = "launcher exited (" + ",".join(str(nd.proc.returncode)
                                                             for nd in nodes) + ")"
                break
            time.sleep(0.05)
    finally:
        for nd in nodes:
            nd.stop()
        deadline = now() + 5
        for nd in nodes:
            nd.finish(deadline)
        for p in pids.values():  # a stopped rank whose launcher left it behind
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    cmdline = f.read()
                if b"train_mlp" in cmdline or b"hang_torch" in cmdline:
                    kill(p, signal.SIGKILL)
            except OSError:
                pass
        if netns is not None and topo == "2x2":
            netns.kill_inside()
    res["fault"] = t_fault
    logs = [nd.log_path for nd in nodes]
    if launcher == "trun":
        res["culprit"], res["verdict"] = trun_culprit(work, logs)
    else:
        ff = torch_first_failure(logs, pids)
        if ff:
            res["culprit"], res["verdict"] = [ff[0]], ff[1]
    return res


# --- the table -------------------------------------------------------------------------------

def p99(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else None


def fmt_s(x):
    return f"{x:.1f}" if x is not None else "-"


def main():
    ap = argparse.ArgumentParser(description="hang recovery, trun vs torchrun (issue 36)")
    ap.add_argument("--trun", required=True)
    ap.add_argument("--train-mlp", required=True)
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--torchrun", default="/usr/bin/torchrun")
    ap.add_argument("--hang-torch", default="bench/hang_torch.py")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cap", type=float, default=90.0)
    ap.add_argument("--default-cap", type=float, default=60.0)
    ap.add_argument("--start-cap", type=float, default=60.0)
    # The short timeout. PyTorch's documentation of init_process_group(timeout=...) sets no lower
    # bound; 2 s is the shortest whole second that works here: the same timeout bounds the
    # workers' connection to rank 0's TCPStore, and at 1 s that failed at the start of every
    # two-node row (the nodes' workers start up to a second or so apart); 1 s passed on one node.
    # Even 2 s is near the edge on 2 busy cores: 1 trial in 18 timed out before its fault.
    ap.add_argument("--torch-timeout", type=float, default=2.0)
    ap.add_argument("--hang-at-step", type=int, default=60)
    ap.add_argument("--step-sleep-ms", type=int, default=50)
    ap.add_argument("--launchers", default=",".join(LAUNCHERS))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--topos", default=",".join(TOPOS))
    a = ap.parse_args()
    a.trun, a.train_mlp, a.hang_torch = (os.path.abspath(x) for x in
                                         (a.trun, a.train_mlp, a.hang_torch))
    if a.quick:
        a.trials = 1
        a.default_cap = min(a.default_cap, 30.0)
    launchers = [x for x in a.launchers.split(",") if x]
    kinds = [x for x in a.kinds.split(",") if x]
    topos = [x for x in a.topos.split(",") if x]
    for x, allowed in ((launchers, LAUNCHERS), (kinds, KINDS), (topos, TOPOS)):
        bad = [y for y in x if y not in allowed]
        if bad:
            sys.exit(f"hang_bench: unknown {bad}; choose from {allowed}")

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    tmp = tempfile.mkdtemp(prefix="trun-bench-hang-")
    netns = None
    rows = {}
    try:
        if "2x2" in topos:
            if os.geteuid() != 0:
                print("hang_bench: 2x2 rows need root (network namespaces); skipped",
                      file=sys.stderr)
                topos = [t for t in topos if t != "2x2"]
            else:
                netns = Netns()
                netns.create(2)
        for topo in topos:
            for kind in kinds:
                for launcher in launchers:
                    n = 1 if launcher == "torch_default" else a.trials
                    cap = a.default_cap if launcher == "torch_default" else a.cap
                    results = []
                    for trial in range(n):
                        r = run_trial(a, launcher, kind, topo, cap, trial, netns, tmp)
                        results.append(r)
                        print(f"[{time.strftime('%H:%M:%S')}] {launcher} {kind} {topo} trial "
                              f"{trial + 1}/{n}: recovery {fmt_s(r['recovery'])} s {r['note']} "
                              f"culprit {r['culprit']} | {r['verdict'][:200]}",
                              file=sys.stderr, flush=True)
                    rows[(launcher, kind, topo)] = (cap, results)
    except Interrupted as e:
        print(f"hang_bench: interrupted ({e}); cleaning up", file=sys.stderr)
        raise SystemExit(130)
    finally:
        if netns is not None:
            netns.delete()
        if os.environ.get("HANG_BENCH_KEEP"):
            print(f"hang_bench: logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    # The table.
    print()
    print(f"Hang recovery: time from the fault of rank {HANG_RANK} to the replacement group's "
          f"first step (s), median [min-max] over trials")
    hdr = (f"{'topology':<8} {'fault':<9} {'launcher':<26} {'n':>2} {'recovery':>18} "
           f"{'p99 step':>8} {'target':>6} {'in target':>9} {'culprit':>8}  verdict (trial 1)")
    print(hdr)
    print("-" * len(hdr))
    summary = {}
    named_ok = named_n = 0
    named_by_kind = {}
    for (launcher, kind, topo), (cap, results) in rows.items():
        rec = [r["recovery"] for r in results if r["recovery"] is not None]
        capped = len(results) - len(rec)
        steps = [y - x for r in results for x, y in zip(r["steps"], r["steps"][1:])]
        p = p99(steps)
        target = max(10.0, 3 * p) + 1 if p is not None else None
        if rec:
            med = statistics.median(rec)
            col = f"{med:.1f} [{min(rec):.1f}-{max(rec):.1f}]"
            if capped:
                col += f" +{capped}>{cap:.0f}"
        else:
            med = None
            col = f">{cap:.0f}"
            if launcher == "torch_default":
                col += f" (doc: {TORCH_DEFAULT_TIMEOUT_S})"
        within = sum(1 for x in rec if target is not None and x <= target)
        ok = sum(1 for r in results if r["culprit"] == [HANG_RANK])
        if launcher == "trun":
            named_ok += ok
            named_n += len(results)
            k_ok, k_n = named_by_kind.get(kind, (0, 0))
            named_by_kind[kind] = (k_ok + ok, k_n + len(results))
        notes = {r["note"] for r in results if r["note"] and not r["note"].startswith(">")}
        verdict = results[0]["verdict"][:110] if results else ""
        if notes:
            verdict = "; ".join(sorted(notes)) + (" | " + verdict if verdict else "")
        print(f"{topo:<8} {kind:<9} {LAUNCHER_TITLE[launcher]:<26} {len(results):>2} {col:>18} "
              f"{(f'{p:.2f}' if p is not None else '-'):>8} {fmt_s(target):>6} {f'{within}/{len(results)}':>9} "
              f"{f'{ok}/{len(results)}':>8}  {verdict}")
        summary[(launcher, kind, topo)] = med
    print()
    print(f"Faults: sigstop = SIGSTOP to rank {HANG_RANK}'s pid after step {a.hang_at_step}; spin "
          f"= rank {HANG_RANK} loops in user code after step {a.hang_at_step}; mismatch = rank "
          f"{HANG_RANK} broadcasts 10 floats where the others allreduce 1024, then goes on.")
    print(f"Every job: --max-restarts {MAX_RESTARTS}, a checkpoint every 20 steps, steps of about "
          f"{a.step_sleep_ms} ms; trun with no hang option; torchrun with its default "
          "--monitor_interval (5 s).")
    print("A recovery without a hang verdict (culprit 0/n, 'no hang verdict; failed: ...') is a "
          "crash the fault led to, restarted as any failure is.")
    print(f"target: max(10 s, 3 x p99 step) + 1 s (issue 36). culprit: trun's trun.hang verdict "
          f"(or, for a mismatch, libtrun_worker's CollectiveError) names rank {HANG_RANK}; for torchrun, the first failure it reports (the rank it "
          "would blame).")
    print(f"torchrun, default timeout: init_process_group's documented default for gloo is "
          f"30 min ({TORCH_DEFAULT_TIMEOUT_S} s); this run waits {a.default_cap:.0f} s (--default-cap).")
    print(f"torchrun, short timeout: init_process_group(timeout=timedelta(seconds="
          f"{a.torch_timeout:g})). PyTorch's documentation sets no lower bound; 2 s (the default of "
          "--torch-timeout) is the shortest whole second that works on this machine: the same "
          "timeout bounds the workers' connection to rank 0's store, and 1 s failed at the start "
          "of the two-node rows (a 'no fault' trial is such a false positive).")
    print()
    for topo in topos:
        for kind in kinds:
            v = summary.get(("trun", kind, topo))
            peer = summary.get(("torch_short", kind, topo))
            ratio = f"{peer / v:.2f}" if v and peer else "none"
            vs = f"{v:.2f}" if v is not None else "none"
            ps = f"{peer:.2f}" if peer is not None else "none"
            print(f"RESULT name=hang_recovery_{kind}_{topo} value={vs} unit=s peer={ps} "
                  f"ratio={ratio}")
    for kind, (k_ok, k_n) in named_by_kind.items():
        print(f"RESULT name=hang_culprit_named_{kind} value={k_ok}/{k_n} unit=trials peer=none "
              "ratio=none")
    if named_n:
        print(f"RESULT name=hang_culprit_named value={named_ok}/{named_n} unit=trials peer=none "
              "ratio=none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
