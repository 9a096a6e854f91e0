#!/usr/bin/python3
"""Goodput (ETTR) of trun and torchrun under one seeded fault schedule (issue 39; driven by
scripts/bench_goodput.sh, which creates the network namespaces and cleans up).

  goodput.py schedule --seed S --seconds T [--short]
      the fault schedule, one fault a line: "AT KIND NODE LOCAL_RANK DURATION" (AT: seconds from
      the side's start; DURATION: seconds until the node comes back (kill_agent,
      kill_store_agent), the link heals (partition) or the slowdown ends (slow); 0 otherwise).
      A pure function of the seed and the duration (random.Random(seed) only).
  goodput.py run-side --side NAME --dir DIR --seconds W --ns-prefix P ...
      runs one side in the namespaces P n0..n3 (agents, supervisor, faults), writes DIR/NAME/.
  goodput.py report --dir DIR --sides A,B,... [--short]
      the accounting of every side (DIR/accounting.json), the tables and the RESULT lines; with
      --short, the checks of the CI form (exit 1 when one fails).

Kinds of fault (each at least once in a full run; --short: kill_worker, kill_agent, partition):
  kill_worker       SIGKILL one worker (node, local rank)
  kill_agent        SIGKILL a node's agent (the node is lost; a spare takes over); the supervisor
                    starts it again DURATION s later (it becomes the spare)
  hang              SIGSTOP one worker, left stopped: the launcher must deal with it
  slow              SIGSTOP/SIGCONT duty cycle on one worker (30 % stopped, 1 s period) for
                    DURATION s
  kill_store_agent  SIGKILL node 0's agent (it hosts the c10d store); started again DURATION s later
  partition         the node's veth down, up again DURATION s later
A victim is named by node index and local rank. When that node runs no worker at the time (it is
the spare, excluded or down), the next node (by index, never node 0 for the kinds that spare it)
that runs workers is the victim; the side's faults.json says which one was hit.

The supervisor rule (both sides): an agent that exits is started again 1 s later (a SLURM requeue,
a Kubernetes restart policy), except a node whose agent a fault killed: it comes back at its
scheduled time. A SIGKILLed torchrun agent leaves its workers running (torchrun sets no
parent-death signal): that is torchrun's real behaviour and they are left alone (the namespace
cleanup ends them).
"""
import argparse
import glob
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "cluster"))
import chaos  # noqa: E402  (parse_logs: the sample-log parser shared with the chaos test)

CAUSES = ["startup", "detection", "stopping", "rendezvous", "restart", "checkpoint_load", "redone",
          "slow", "other"]
ALL_KINDS = ["kill_worker", "kill_agent", "hang", "slow", "kill_store_agent", "partition"]
SHORT_KINDS = ["kill_worker", "kill_agent", "partition"]


# ---------------------------------------------------------------------------------------------
# The schedule
def schedule(seed, seconds, short):
    """[(at, kind, node, local_rank, duration)], sorted by time. Faults are spread evenly over
    [warm-up, seconds - quiet] with jitter, far enough apart for the job to re-form between two;
    every kind of the run's list comes once (shuffled), extra slots get kill_worker, partition or
    slow."""
    rng = random.Random(seed)
    kinds = list(SHORT_KINDS if short else ALL_KINDS)
    rng.shuffle(kinds)
    warm, quiet, gap = (8.0, 12.0, 13.0) if short else (30.0, 25.0, 40.0)
    span = seconds - warm - quiet
    n = max(len(kinds), int(span // gap))
    while len(kinds) < n:
        kinds.append(rng.choice(["kill_worker", "partition", "slow"]))
    slot = span / n
    out = []
    for i, kind in enumerate(kinds):
        at = warm + i * slot + rng.uniform(0.0, 0.25 * slot)
        lr = rng.randrange(2)
        if kind == "kill_worker":
            node, dur = rng.randrange(3), 0.0
        elif kind == "kill_store_agent":
            node, dur = 0, rng.uniform(10.0, 18.0)
        else:
            node = rng.choice([1, 2])
            dur = {"kill_agent": rng.uniform(8.0, 12.0) if short else rng.uniform(15.0, 25.0),
                   "hang": 0.0, "slow": 15.0, "partition": rng.uniform(3.0, 6.0)}[kind]
        # a node that is brought back must be back before the next fault
        dur = min(dur, 0.8 * slot)
        out.append((round(at, 1), kind, node, lr, round(dur, 1)))
    return out


# ---------------------------------------------------------------------------------------------
# Running one side
class Side:
    def __init__(self, a):
        self.a = a
        self.dir = os.path.join(a.dir, a.side)
        os.makedirs(self.dir, exist_ok=True)
        self.tmp = os.path.join(self.dir, "tmp")
        os.makedirs(self.tmp, exist_ok=True)
        self.ns = ["%sn%d" % (a.ns_prefix, i) for i in range(4)]
        self.addr = ["%s.%d" % (a.subnet, i + 1) for i in range(4)]
        self.host = ["%sn%d" % (a.ns_prefix, i) for i in range(4)]
        self.procs = {}        # node -> Popen of the current incarnation
        self.inc = {i: 0 for i in range(4)}
        self.exited_at = {}    # node -> time its agent exited (for the 1 s restart)
        self.held = {}         # node -> time a fault-killed agent comes back
        self.parted = set()
        self.stopping = False
        self.all_agents = []   # every agent pid started (cleanup of /dev/shm segments)
        self.lifetimes = []    # (node, incarnation, pid, start, end or None, rc, how)
        self.lock = threading.Lock()
        self.threads = []

    def trun_cmd(self, i):
        a = self.a
        conf = ("last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=3,"
                "join_timeout=30,read_timeout=3")
        eps = ",".join("%s:%d" % (x, a.port) for x in self.addr)
        return [a.trun, "--nnodes", "2:3", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", eps, "--rdzv-id", a.rdzv_id, "--rdzv-conf", conf,
                "--local-addr", self.addr[i], "--max-restarts", "1000", "--shutdown-timeout", "5",
                "--hang-timeout", "3", "--straggler-action", "exclude", "--straggler-window", "5",
                "--event-log", os.path.join(self.dir, "events_%d.jsonl" % i),
                "--metrics-port", str(a.metrics_port),
                a.train_mlp] + self.worker_args()

    def torchrun_cmd(self, i, best):
        a = self.a
        cmd = [a.python, a.torchrun, "--nnodes", "2:3", "--nproc_per_node", "2",
               "--rdzv_backend", "c10d", "--rdzv_endpoint", "%s:%d" % (self.host[0], a.port),
               "--rdzv_id", a.rdzv_id, "--max_restarts", "1000",
               # torchrun 1.13 on Python 3.11 crashes with the default --redirects/--tee; 9:1
               # names a local rank that does not exist and keeps the plain console
               "--redirects", "9:1", "--tee", "9:1"]
        if best:
            cmd += ["--monitor_interval", "0.1", "--rdzv_conf",
                    "join_timeout=30,last_call_timeout=1,close_timeout=5,read_timeout=5"]
        cmd += [a.torch_script] + self.worker_args()
        if best:
            cmd += ["--collective-timeout", "20"]
        return cmd

    def worker_args(self):
        a = self.a
        return ["--sizes", a.sizes, "--dataset-size", str(a.dataset_size), "--batch-size",
                str(a.batch_size), "--epochs", "100000", "--ckpt-dir", os.path.join(self.dir, "ckpt"),
                "--ckpt-every", str(a.ckpt_every), "--step-sleep-ms", str(a.step_sleep_ms),
                "--sample-log", os.path.join(self.dir, "samples", "s")]

    def start_agent(self, i, how):
        a = self.a
        if a.launcher == "trun":
            cmd = self.trun_cmd(i)
        else:
            cmd = self.torchrun_cmd(i, a.launcher == "torchrun_best")
        # A UTS namespace of its own with the node's host name (ip netns exec bind-mounts the
        # namespace's /etc/netns/NS/hosts, which resolves every node's name): torchrun gives its
        # workers the host name of group rank 0 as MASTER_ADDR and tells the store host by it.
        full = ["ip", "netns", "exec", self.ns[i], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.host[i]] + cmd
        env = dict(os.environ, TMPDIR=self.tmp, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0",
                   LOGLEVEL="INFO", PYTHONUNBUFFERED="1", TRUN_JOB_ID=a.rdzv_id)
        self.inc[i] += 1
        p = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[i] = p
        self.all_agents.append(p.pid)
        self.lifetimes.append([i, self.inc[i], p.pid, time.time(), None, None, how])
        log = open(os.path.join(self.dir, "agent_%d.log" % i), "a")
        log.write("%.6f === incarnation %d pid %d (%s)\n" % (time.time(), self.inc[i], p.pid, how))
        log.flush()
        t = threading.Thread(target=self.reader, args=(p, log), daemon=True)
        t.start()
        self.threads.append(t)

    @staticmethod
    def reader(p, log):
        # Every line timestamped as it arrives: torchrun's detection times come from these.
        for raw in p.stdout:
            log.write("%.6f %s" % (time.time(), raw.decode(errors="replace")))
            log.flush()
        log.close()

    def note_exit(self, i, rc, how):
        for lt in self.lifetimes:
            if lt[0] == i and lt[4] is None:
                lt[4], lt[5] = time.time(), rc
                if how:
                    lt[6] += "; " + how

    def supervise(self):
        """One pass: agents that exited are started again after 1 s (not those held down)."""
        now = time.time()
        for i in range(4):
            p = self.procs.get(i)
            if p is not None and p.poll() is not None:
                self.note_exit(i, p.returncode, "")
                self.exited_at[i] = now
                del self.procs[i]
            if i in self.procs or self.stopping:
                continue
            if i in self.held:
                if now < self.held[i]:
                    continue
                del self.held[i]
                self.start_agent(i, "back after the fault")
            elif now - self.exited_at.get(i, 0) >= 1.0:
                self.start_agent(i, "restarted by the supervisor")

    def workers(self, i):
        """{local_rank: pid} of node i's current agent's workers."""
        p = self.procs.get(i)
        if p is None or p.poll() is not None:
            return {}
        out = {}
        kids = []
        for f in glob.glob("/proc/%d/task/*/children" % p.pid):
            try:
                kids += open(f).read().split()
            except OSError:
                pass
        for k in kids:
            try:
                env = open("/proc/%s/environ" % k, "rb").read().split(b"\0")
                lr = [e for e in env if e.startswith(b"LOCAL_RANK=")]
                if lr and open("/proc/%s/stat" % k).read().split(")")[1].split()[0] not in "ZX":
                    out[int(lr[0].split(b"=")[1])] = int(k)
            except (OSError, ValueError):
                pass
        return out

    def resolve(self, kind, node):
        if kind == "kill_store_agent":
            return 0
        order = [(node + k) % 4 for k in range(4)]
        if kind != "kill_worker":
            order = [n for n in order if n != 0]
        for n in order:
            if self.workers(n) and n not in self.parted:
                return n
        return None

    def inject(self, at, kind, node, lr, dur, t0):
        rec = {"at": at, "kind": kind, "node": node, "local_rank": lr, "duration": dur}
        victim = self.resolve(kind, node)
        rec["time"] = time.time()
        rec["victim_node"] = victim
        if victim is None:
            rec["what"] = "skipped: no node runs workers"
            return rec
        w = self.workers(victim)
        pid = w.get(lr, next(iter(w.values()), None))
        if kind == "kill_worker":
            os.kill(pid, signal.SIGKILL)
            rec["what"] = "SIGKILL worker pid %d" % pid
        elif kind in ("kill_agent", "kill_store_agent"):
            p = self.procs[victim]
            self.held[victim] = t0 + at + dur
            os.kill(p.pid, signal.SIGKILL)
            rec["what"] = "SIGKILL agent pid %d (back at +%.1f s)" % (p.pid, at + dur)
        elif kind == "hang":
            os.kill(pid, signal.SIGSTOP)
            rec["what"] = "SIGSTOP worker pid %d (left stopped)" % pid
        elif kind == "slow":
            th = threading.Thread(target=self.duty_cycle, args=(pid, time.time() + dur), daemon=True)
            th.start()
            self.threads.append(th)
            rec["what"] = "30%% SIGSTOP duty cycle on worker pid %d for %.1f s" % (pid, dur)
        elif kind == "partition":
            subprocess.run(["ip", "-n", self.a.hub, "link", "set", "h%d" % victim, "down"], check=True)
            self.parted.add(victim)
            th = threading.Thread(target=self.heal, args=(victim, time.time() + dur), daemon=True)
            th.start()
            self.threads.append(th)
            rec["what"] = "link h%d down for %.1f s" % (victim, dur)
        rec["pid"] = pid
        return rec

    def duty_cycle(self, pid, until):
        try:
            while time.time() < until and not self.stopping:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.3)
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.7)
        except ProcessLookupError:
            pass
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def heal(self, node, when):
        while time.time() < when:
            time.sleep(0.05)
        subprocess.run(["ip", "-n", self.a.hub, "link", "set", "h%d" % node, "up"], check=False)
        self.heal_time = time.time()
        self.parted.discard(node)
        with open(os.path.join(self.dir, "heals.txt"), "a") as f:
            f.write("%.6f %d\n" % (time.time(), node))

    def scrape(self):
        """/metrics of the agent that has run longest without a fault hitting its node (killed,
        partitioned) since it started, read from inside its namespace."""
        best = None
        for i in sorted(self.procs):
            lt = [x for x in self.lifetimes if x[0] == i and x[4] is None]
            if not lt:
                continue
            start = lt[-1][3]
            hit = any(f.get("victim_node") == i and f["time"] >= start and
                      f["kind"] in ("kill_agent", "kill_store_agent", "partition") for f in self.faults)
            if not hit and (best is None or start < best[1]):
                best = (i, start)
        if best is None:
            return None
        i, start = best
        url = "http://%s:%d/metrics" % (self.addr[i], self.a.metrics_port)
        r = subprocess.run(["ip", "netns", "exec", self.ns[i], "curl", "-s", "-m", "3", url],
                           capture_output=True, timeout=10)
        return {"node": i, "agent_start": start, "time": time.time(),
                "text": r.stdout.decode(errors="replace")}

    def run(self):
        a = self.a
        os.makedirs(os.path.join(self.dir, "samples"), exist_ok=True)
        sched = [] if a.fault_free else [tuple(x) for x in json.load(open(a.schedule))]
        self.faults = []
        t0 = time.time()
        for i in range(4):
            self.start_agent(i, "first start")
        end = t0 + a.seconds
        k = 0
        scraped = None
        while True:
            now = time.time()
            if now >= end:
                break
            self.supervise()
            if k < len(sched) and now >= t0 + sched[k][0]:
                self.faults.append(self.inject(*sched[k], t0))
                k += 1
            if a.launcher == "trun" and scraped is None and now >= end - 1.0 and not a.fault_free:
                scraped = self.scrape() or {}
            time.sleep(0.05)
        self.stopping = True
        t_end = time.time()
        # The end: SIGTERM to every agent (each stops its workers, which save a final checkpoint
        # when they can), at most 45 s, then SIGKILL of anything left in the namespaces.
        for i, p in list(self.procs.items()):
            try:
                os.kill(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + 45
        while time.time() < deadline and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.1)
        for i, p in list(self.procs.items()):
            if p.poll() is None:
                p.kill()
            p.wait()
            self.note_exit(i, p.returncode, "stopped at the end")
        for ns in self.ns:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for t in self.threads:
            t.join(timeout=5)
        for pid in self.all_agents:  # progress boards of SIGKILLed trun agents
            for f in glob.glob("/dev/shm/trun-progress-%d-*" % pid):
                try:
                    os.unlink(f)
                except OSError:
                    pass
        json.dump({"start": t0, "end": t_end, "seconds": a.seconds, "launcher": a.launcher,
                   "faults": self.faults, "lifetimes": self.lifetimes, "scrape": scraped,
                   "fault_free": a.fault_free},
                  open(os.path.join(self.dir, "side.json"), "w"), indent=1)


# ---------------------------------------------------------------------------------------------
# Accounting
def load_events(d, launcher):
    """[(time, kind)] from the launcher's own records: kind is 'detect', 'join' or 'formed'."""
    ev = []
    if launcher == "trun":
        detect = {"trun.agent.failure", "trun.hang", "trun.agent.straggler", "trun.rdzv.node_left",
                  "trun.rdzv.membership_lost", "trun.rdzv.store_lost", "trun.rdzv.worker_failed",
                  "trun.rdzv.failover", "trun.agent.excluded"}
        for path in glob.glob(os.path.join(d, "events_*.jsonl")):
            for line in open(path, errors="replace"):
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                name, t, md = e.get("name"), e.get("timestamp", 0) / 1000.0, e.get("metadata", {})
                # a rendezvous that failed because its store went away noticed the store host's
                # loss (a spare's join timeout is no news)
                store_gone = name == "trun.rdzv.failed" and "store" in str(md.get("error_trace", ""))
                if name in detect or store_gone or (name == "trun.agent.worker_exited" and
                                                    md.get("state") == "FAILED"):
                    ev.append((t, "detect", name))
                elif name == "trun.rdzv.join":
                    ev.append((t, "join", name))
                elif name == "trun.rdzv.round_formed":
                    ev.append((t, "formed", name))
    else:
        agent = re.compile(r"^(INFO|WARNING|ERROR):torch\.distributed\.elastic|^torch\.distributed\.elastic")
        detect = re.compile(r"failed \(exitcode|FAILED|Detected \d+ new nodes|Stopping worker group|"
                            r"Rendezvous\w*Error|Closing process|has failed")
        for path in glob.glob(os.path.join(d, "agent_*.log")):
            for line in open(path, errors="replace"):
                ts, _, rest = line.partition(" ")
                try:
                    t = float(ts)
                except ValueError:
                    continue
                if not agent.search(rest):
                    continue
                if "Rendezvous complete for workers" in rest:
                    ev.append((t, "formed", rest.strip()[:80]))
                elif "Rendezvous'ing worker group" in rest:
                    ev.append((t, "join", rest.strip()[:80]))
                elif detect.search(rest):
                    ev.append((t, "detect", rest.strip()[:80]))
    return sorted(ev)


def groups_of(d):
    paths = sorted(glob.glob(os.path.join(d, "samples", "s.*")))
    groups, bad = chaos.parse_logs(paths)
    # the extra keys of the start lines (chaos.parse_logs ignores them)
    extra = {}
    for p in paths:
        for line in open(p):
            if line.startswith("start "):
                w = line.split()
                kv = dict(zip(w[1::2], w[2::2]))
                e = extra.setdefault(kv["group"], {"ready": [], "proc": [], "load": []})
                e["ready"].append(float(kv["time"]))
                e["proc"].append(float(kv.get("proc_start", kv["time"])))
                e["load"].append(float(kv.get("load_seconds", 0)))
    for g, v in groups.items():
        v["extra"] = extra.get(g, {"ready": [], "proc": [], "load": []})
        v["step_start"] = {s: min(r["time"] for r in ranks.values()) for s, ranks in v["steps"].items()}
    return groups, bad


def step_time(d):
    groups, _ = groups_of(d)
    durs = []
    for g in groups.values():
        ss = sorted(g["step_start"].items())
        durs += [b[1] - a[1] for a, b in zip(ss[10:], ss[11:]) if b[0] == a[0] + 1]
    return statistics.median(durs) if durs else None, len(durs)


def committed_chain(groups, final_step, final_group):
    """[(group, step)] of the steps that led to the final checkpoint, and problems found."""
    out, problems, seen = [], [], set()
    cur, end = final_group, final_step
    while True:
        if cur in seen or cur not in groups:
            problems.append("chain broken at group %s" % cur)
            break
        seen.add(cur)
        g = groups[cur]
        froms = {(s[1], s[2]) for s in g["starts"].values()}
        if len(froms) != 1:
            problems.append("group %s: start lines disagree" % cur)
            break
        s0, prev = froms.pop()
        for step in range(s0 + 1, end + 1):
            ranks = g["steps"].get(step, {})
            if sorted(ranks) != list(range(g["world"])):
                problems.append("group %s step %d: lines from ranks %s of world %d" %
                                (cur, step, sorted(ranks), g["world"]))
            out.append((cur, step))
        if prev == "-":
            break
        cur, end = prev, s0
    return out, problems


def exactly_once(groups, chain, dataset_size):
    counts = {}
    max_world = max((groups[g]["world"] for g, _ in chain), default=1)
    for gid, step in chain:
        for r in groups[gid]["steps"].get(step, {}).values():
            c = counts.setdefault(r["epoch"], {})
            for i in r["idx"]:
                c[i] = c.get(i, 0) + 1
    problems = []
    last = max(counts) if counts else -1
    for e in range(last + 1):
        c = counts.get(e, {})
        twice = [i for i, k in c.items() if k > 1]
        missing = [i for i in range(dataset_size) if i not in c] if e < last else []
        # The tail policy (kPad, both programs): when the positions left at the end of an epoch
        # do not divide among the ranks (a group of another world size consumed part of it),
        # fewer than world_size samples are repeated, once each, at the very end.
        pad_ok = len(twice) < max_world and all(c[i] == 2 for i in twice)
        if (twice and not pad_ok) or missing:
            problems.append("epoch %d: %d samples twice, %d missing" % (e, len(twice), len(missing)))
    return problems, last


def account(d, side, t0, w_start, w_end, final):
    """Splits [w_start, w_end] into productive time and badput by cause; per fault too."""
    groups, _ = groups_of(d)
    events = load_events(d, side["launcher"])
    faults = sorted([f for f in side["faults"] if f.get("victim_node") is not None],
                    key=lambda f: f["time"])
    chain, _ = committed_chain(groups, final[0], final[1]) if final else ([], [])
    committed = set(chain)
    # step intervals, in time order, clipped so they never overlap
    steps = []
    for gid, g in groups.items():
        ss = sorted(g["step_start"].items())
        for k, (s, t) in enumerate(ss):
            e = ss[k + 1][1] if k + 1 < len(ss) and ss[k + 1][0] == s + 1 else t + t0
            steps.append([t, e, (gid, s) in committed, gid, s])
    steps.sort()
    for k in range(len(steps) - 1):
        steps[k][1] = min(steps[k][1], steps[k + 1][0])
    steps = [s for s in steps if s[1] > w_start and s[0] < w_end]
    for s in steps:
        s[0], s[1] = max(s[0], w_start), min(s[1], w_end)

    pieces = []  # (start, end, cause)
    slow = []    # (time, seconds, cause): steps shorter than t0 (negative excess)
    detects = [t for t, k, _ in events if k == "detect"]
    n_comm = 0
    for s0, s1, comm, gid, st in steps:
        n_comm += comm
        base = min(s1, s0 + t0)
        if not comm:
            pieces.append((s0, base, "redone"))
        if s1 - s0 < t0:
            slow.append((s0, (s1 - s0) - t0, "slow"))
            continue
        # The step's time beyond t0. When a fault hit during the step and the launcher noticed
        # before the step ended (a partition healed under a stalled collective), the part after
        # the fault is detection, then stopping; otherwise it is slow.
        inside = [f["time"] for f in faults if s0 <= f["time"] < s1]
        x = base
        if inside:
            tf = inside[0]
            d = next((t for t in detects if t >= tf), None)
            if d is not None and d < s1:
                x = max(base, tf)
                pieces.append((base, x, "slow"))
                pieces.append((x, max(x, d), "detection"))
                pieces.append((max(x, d), s1, "stopping"))
                continue
        pieces.append((base, s1, "slow"))

    # gaps between steps
    first_step = {gid: min(g["step_start"].values()) for gid, g in groups.items() if g["step_start"]}
    group_at = {t: gid for gid, t in first_step.items()}
    gaps = []
    prev_end = w_start
    prev_start = w_start
    for s0, s1, _, _, _ in steps:
        if s0 > prev_end + 1e-6:
            gaps.append((prev_end, s0, prev_start))
        prev_end, prev_start = max(prev_end, s1), s0
    if w_end > prev_end + 1e-6:
        gaps.append((prev_end, w_end, prev_start))
    first_ever = min(first_step.values()) if first_step else w_end
    for a, b, last_step_start in gaps:
        if a <= side["start"] + 1e-6 and b <= first_ever + 1e-6:
            pieces.append((a, b, "startup"))
            continue
        gid = group_at.get(b)
        # A small state machine over what happened in the gap: a fault -> detection until the
        # launcher noticed (its first record after the fault) -> stopping until a node joins the
        # next round (the first join) -> rendezvous until the round formed -> restart; a fault
        # or a failure noticed during a restart or a rendezvous starts the cycle again. The gap
        # starts in detection when a fault hit the last step and nothing noticed it yet, else in
        # stopping (the group stopped for a membership change, or was already stopping).
        hit = [f["time"] for f in faults if last_step_start <= f["time"] <= a]
        noticed = hit and any(hit[-1] <= t <= a for t, k, _ in events if k == "detect")
        label = "detection" if hit and not noticed else "stopping"
        marks = sorted([(f["time"], "fault") for f in faults if a < f["time"] < b] +
                       [(t, k) for t, k, _ in events if a < t < b])
        cur = a
        for t, k in marks:
            nxt = label
            if k == "fault" and label in ("rendezvous", "restart", "stopping"):
                nxt = "detection" if label != "stopping" else "stopping"
            elif k == "detect" and label != "stopping":
                nxt = "stopping"
            elif k == "join" and label == "stopping":
                nxt = "rendezvous"
            elif k == "formed" and label in ("rendezvous", "stopping"):
                nxt = "restart"
            if nxt != label:
                pieces.append((cur, t, label))
                cur, label = t, nxt
        pieces.append((cur, b, label))
        if gid is not None and groups[gid]["extra"]["ready"]:
            # the group that trains next: its checkpoint load, then start line to first step
            ready = min(max(groups[gid]["extra"]["ready"]), b)
            load = max(groups[gid]["extra"]["load"])
            if ready > a:
                pieces.append((max(a, ready - load), ready, "checkpoint_load!"))
                pieces.append((ready, b, "restart!"))

    # Overrides (cause ending in "!") replace what the state machine said for their span.
    over = [(x0, x1, c_[:-1]) for x0, x1, c_ in pieces if c_.endswith("!")]
    plain = [(x0, x1, c_) for x0, x1, c_ in pieces if not c_.endswith("!")]
    pieces = list(over)
    for x0, x1, c_ in plain:
        segs = [(x0, x1)]
        for o0, o1, _ in over:
            segs = [piece for u, v in segs
                    for piece in ((u, min(v, o0)), (max(u, o1), v)) if piece[1] > piece[0]]
        pieces += [(u, v, c_) for u, v in segs]

    total = {c_: 0.0 for c_ in CAUSES}
    bounds = [f["time"] for f in faults]
    per_fault = [{c_: 0.0 for c_ in CAUSES} for _ in faults]
    before = {c_: 0.0 for c_ in CAUSES}

    def add(t, secs, cause):
        total[cause] += secs
        k = sum(1 for x in bounds if x <= t) - 1
        (per_fault[k] if k >= 0 else before)[cause] += secs

    for x0, x1, cause in pieces:
        x0, x1 = max(x0, w_start), min(x1, w_end)
        if x1 <= x0:
            continue
        # split at fault times
        cuts = [x0] + [x for x in bounds if x0 < x < x1] + [x1]
        for u, v in zip(cuts, cuts[1:]):
            add(u, v - u, cause)
    for t, secs, cause in slow:
        add(t, secs, cause)
    wall = w_end - w_start
    productive = n_comm * t0
    total["other"] += wall - productive - sum(total.values())
    detect_after = []
    for f in faults:
        nxt = [t for t, k, _ in events if k == "detect" and t >= f["time"]]
        detect_after.append(nxt[0] - f["time"] if nxt else None)
    return {"wall": wall, "productive": productive, "ettr": productive / wall,
            "committed_steps": n_comm, "badput": total, "before_first_fault": before,
            "per_fault": [dict(f, badput=pf, noticed_after=da)
                          for f, pf, da in zip(faults, per_fault, detect_after)]}


def final_state(sdir, launcher):
    """(step, group) of the final checkpoint, from the verification run's output."""
    try:
        out = open(os.path.join(sdir, "verify.txt")).read()
    except OSError:
        return None
    if launcher == "trun":
        for p in glob.glob(os.path.join(sdir, "verify", "v.*")):
            for line in open(p):
                if line.startswith("start "):
                    w = line.split()
                    kv = dict(zip(w[1::2], w[2::2]))
                    return int(kv["step"]), kv["resumed_from"]
        return None
    m = re.search(r"verify step (\d+) epoch \d+ offset \d+ group (\S+)", out)
    return (int(m.group(1)), m.group(2)) if m else None


def parse_metrics(text):
    out = {"badput": {}}
    for line in text.splitlines():
        m = re.match(r'^(trun_goodput_ratio|trun_goodput_wall_seconds_total|trun_goodput_productive_seconds_total)\s+(\S+)', line)
        if m:
            out[m.group(1)] = float(m.group(2))
        m = re.match(r'^trun_badput_seconds_total\{cause="(\w+)"\}\s+(\S+)', line)
        if m:
            out["badput"][m.group(1)] = float(m.group(2))
    return out if "trun_goodput_ratio" in out else None


def report(a):
    sides = a.sides.split(",")
    res = {}
    ok = True
    checks = []

    def check(name, passed, detail):
        nonlocal ok
        ok = ok and passed
        checks.append("check %-16s %s  %s" % (name, "PASS" if passed else "FAIL", detail))

    for name in sides:
        sdir = os.path.join(a.dir, name)
        side = json.load(open(os.path.join(sdir, "side.json")))
        t0_from = "fault-free"
        if os.path.isdir(os.path.join(a.dir, name + "_faultfree")):
            t0, n = step_time(os.path.join(a.dir, name + "_faultfree"))
        else:  # no fault-free run (GOODPUT_FAULT_FREE=0): the run's own median step
            t0, n = step_time(sdir)
            t0_from = "the run's own"
        if t0 is None:
            print("goodput: no step time (%s run) for %s" % (t0_from, name))
            ok = False
            continue
        final = final_state(sdir, side["launcher"])
        groups, bad = groups_of(sdir)
        chain, problems = committed_chain(groups, *final) if final and final[1] in groups else \
            ([], ["no final checkpoint with a sample log (%s)" % (final,)])
        once, last_epoch = exactly_once(groups, chain, a.dataset_size) if chain else (["no chain"], -1)
        acc = account(sdir, side, t0, side["start"], side["start"] + side["seconds"], final)
        acc.update(t0=t0, t0_samples=n, t0_from=t0_from, final=final, chain_problems=problems[:5],
                   exactly_once_problems=once[:5], epochs=last_epoch + 1, log_problems=bad[:5],
                   launcher=side["launcher"], lifetimes=side["lifetimes"])
        sc = side.get("scrape")
        if sc and sc.get("text") is not None:
            live = parse_metrics(sc["text"])
            off = account(sdir, side, t0, sc["agent_start"], sc["time"], final)
            # The agent's reference step time is the median step of the run itself, not of a
            # fault-free run: the same offline accounting with that reference, to tell a
            # difference of reference from one of accounting.
            t_run, _ = step_time(sdir)
            off_run = account(sdir, side, t_run, sc["agent_start"], sc["time"], final)
            acc["live"] = {"node": sc["node"], "metrics": live, "offline_ettr": off["ettr"],
                           "offline_wall": off["wall"], "offline_badput": off["badput"],
                           "run_t0": t_run, "offline_ettr_run_t0": off_run["ettr"],
                           "offline_badput_run_t0": off_run["badput"]}
        res[name] = acc
    json.dump(res, open(os.path.join(a.dir, "accounting.json"), "w"), indent=1, default=str)

    for name, acc in res.items():
        print()
        print("== %s: wall %.1f s, %s step t0 %.1f ms (median of %d), %d committed steps, "
              "%d epochs" % (name, acc["wall"], acc["t0_from"], acc["t0"] * 1e3, acc["t0_samples"],
                             acc["committed_steps"], acc["epochs"]))
        print("   final checkpoint: step %s of group %s; chain %s; exactly once per epoch: %s" %
              (acc["final"][0] if acc["final"] else "?", acc["final"][1] if acc["final"] else "?",
               "ok" if not acc["chain_problems"] else "; ".join(acc["chain_problems"]),
               "ok" if not acc["exactly_once_problems"] else "; ".join(acc["exactly_once_problems"])))
        hdr = "%-26s %7s" % ("", "total") + "".join(" %9s" % c[:9] for c in CAUSES)
        print(hdr)
        print("%-26s %7.1f" % ("productive", acc["productive"]))
        print("%-26s %7.1f" % ("badput", sum(acc["badput"].values())) +
              "".join(" %9.1f" % acc["badput"][c] for c in CAUSES))
        b = acc["before_first_fault"]
        print("%-26s %7.1f" % ("  before the first fault", sum(b.values())) +
              "".join(" %9.1f" % b[c] for c in CAUSES))
        for f in acc["per_fault"]:
            label = "  +%.0fs %s n%s" % (f["at"], f["kind"], f["victim_node"])
            print("%-26s %7.1f" % (label[:26], sum(f["badput"].values())) +
                  "".join(" %9.1f" % f["badput"][c] for c in CAUSES) +
                  "   noticed after %s" % ("%.2f s" % f["noticed_after"]
                                           if f["noticed_after"] is not None else "never"))
        print("%-26s %7.3f" % ("ETTR", acc["ettr"]))
        if "live" in acc:
            lv = acc["live"]
            if lv["metrics"] is None:
                print("   live metrics: not exported by this trun")
            else:
                m = lv["metrics"]
                live = m["trun_goodput_ratio"]
                rel = abs(live - lv["offline_ettr"]) / lv["offline_ettr"] if lv["offline_ettr"] else 1
                rel2 = abs(live - lv["offline_ettr_run_t0"]) / max(lv["offline_ettr_run_t0"], 1e-9)
                print("   live metrics of node %d's agent (its %.1f s; trun_goodput_wall_seconds_total "
                      "%.1f): ETTR %.3f live vs %.3f offline (t0 %.1f ms, %s run), relative "
                      "difference %.1f %%; vs %.3f offline with the run's own median step as t0 "
                      "(%.1f ms, the agent's reference), %.1f %%" %
                      (lv["node"], lv["offline_wall"], m.get("trun_goodput_wall_seconds_total", 0), live,
                       lv["offline_ettr"], acc["t0"] * 1e3, acc["t0_from"], rel * 100,
                       lv["offline_ettr_run_t0"],
                       lv["run_t0"] * 1e3, rel2 * 100))
                print("   live badput:    " + " ".join("%s=%.1f" % (c, m["badput"].get(c, 0))
                                                       for c in CAUSES))
                print("   offline badput: " + " ".join("%s=%.1f" % (c, lv["offline_badput_run_t0"][c])
                                                       for c in CAUSES) + " (run's t0)")

    tr = res.get("trun")
    best = res.get("torchrun_best")
    dflt = res.get("torchrun_default")
    print()
    if a.short:
        if tr is None:
            check("accounting", False, "no trun side")
        else:
            tot = tr["productive"] + sum(v for k, v in tr["badput"].items())
            other = tr["badput"]["other"]
            check("adds_up", abs(tot - tr["wall"]) <= 0.01 * tr["wall"] and
                  abs(other) <= 0.05 * tr["wall"],
                  "productive %.1f + badput %.1f = %.1f of wall %.1f; other %.1f s" %
                  (tr["productive"], tot - tr["productive"], tot, tr["wall"], other))
            nf = [f for f in tr["per_fault"]]
            check("faults", len(nf) >= 3 and all(sum(f["badput"].values()) > 0 for f in nf),
                  "%d faults injected, badput per fault %s" %
                  (len(nf), ["%.1f" % sum(f["badput"].values()) for f in nf]))
            check("final_model", tr["final"] is not None and not tr["chain_problems"] and
                  not tr["exactly_once_problems"] and tr["committed_steps"] > 0,
                  "final step %s, %d committed steps, %s" %
                  (tr["final"], tr["committed_steps"],
                   "; ".join(tr["chain_problems"] + tr["exactly_once_problems"]) or "exactly once"))
            lv = tr.get("live")
            if lv is None or lv["metrics"] is None:
                req = os.environ.get("GOODPUT_REQUIRE_LIVE", "0") == "1"
                check("live_metrics", not req,
                      "not exported by this trun%s" % ("" if req else
                                                       " (not required: GOODPUT_REQUIRE_LIVE=1 requires them)"))
            else:
                live = lv["metrics"]["trun_goodput_ratio"]
                rel = abs(live - lv["offline_ettr_run_t0"]) / max(lv["offline_ettr_run_t0"], 1e-9)
                check("live_metrics", rel <= 0.15,
                      "live ETTR %.3f vs offline %.3f with the same reference step (%.1f %%, "
                      "bound 15 %%)" % (live, lv["offline_ettr_run_t0"], rel * 100))
        print("\n".join(checks))
    if tr:
        def ratio(v, p):
            return "%.2f" % (v / p) if p else "none"
        pe = best["ettr"] if best else None
        print("RESULT name=goodput_ettr value=%.3f unit=ratio peer=%s ratio=%s" %
              (tr["ettr"], "%.3f" % pe if pe is not None else "none",
               ratio(tr["ettr"], pe) if pe else "none"))
        if dflt:
            print("RESULT name=goodput_ettr_torchrun_default value=%.3f unit=ratio peer=none "
                  "ratio=none" % dflt["ettr"])
        for c in CAUSES:
            v = tr["badput"][c]
            p = best["badput"][c] if best else None
            r = "%.2f" % (p / v) if p is not None and v > 0.05 else "none"
            print("RESULT name=goodput_badput_%s value=%.1f unit=s peer=%s ratio=%s" %
                  (c, v, "%.1f" % p if p is not None else "none", r))
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("schedule")
    s.add_argument("--seed", type=int, required=True)
    s.add_argument("--seconds", type=float, required=True)
    s.add_argument("--short", action="store_true")
    s.add_argument("--json", action="store_true")
    r = sub.add_parser("run-side")
    r.add_argument("--side", required=True)
    r.add_argument("--launcher", required=True, choices=["trun", "torchrun_best", "torchrun_default"])
    r.add_argument("--dir", required=True)
    r.add_argument("--seconds", type=float, required=True)
    r.add_argument("--schedule")
    r.add_argument("--fault-free", action="store_true")
    r.add_argument("--ns-prefix", required=True)
    r.add_argument("--hub", required=True)
    r.add_argument("--subnet", required=True)
    r.add_argument("--port", type=int, default=29650)
    r.add_argument("--metrics-port", type=int, default=29651)
    r.add_argument("--rdzv-id", required=True)
    r.add_argument("--trun", default="")
    r.add_argument("--train-mlp", default="")
    r.add_argument("--python", default="/usr/bin/python3")
    r.add_argument("--torchrun", default="/usr/bin/torchrun")
    r.add_argument("--torch-script", default="")
    for x in (r,):
        x.add_argument("--sizes", default="32,256,32")
        x.add_argument("--dataset-size", type=int, default=6144)
        x.add_argument("--batch-size", type=int, default=32)
        x.add_argument("--ckpt-every", type=int, default=20)
        x.add_argument("--step-sleep-ms", type=int, default=40)
    q = sub.add_parser("report")
    q.add_argument("--dir", required=True)
    q.add_argument("--sides", required=True)
    q.add_argument("--short", action="store_true")
    q.add_argument("--dataset-size", type=int, default=6144)
    a = p.parse_args()
    if a.cmd == "schedule":
        sc = schedule(a.seed, a.seconds, a.short)
        if a.json:
            print(json.dumps(sc))
        else:
            for x in sc:
                print("%.1f %s %d %d %.1f" % x)
        return 0
    if a.cmd == "run-side":
        Side(a).run()
        return 0
    return report(a)


if __name__ == "__main__":
    sys.exit(main())
