#!/usr/bin/python3
"""The chaos scenario's schedule and its verification (tests/cluster/chaos.sh runs both).

  chaos.py schedule --seed S --seconds T [--store-host] [--workers-only]
      prints the schedule, one event a line: "AT_S EVENT NODE" (AT_S: seconds from the start, one
      decimal). The same seed and duration give the same schedule (random.Random(seed) only).
  chaos.py verify --logs PREFIX --epochs E --dataset-size D --verify-log FILE --agent-logs F...
      checks a finished run (see verify() below); exits 0 when every check passes, 1 otherwise,
      with one line per check.

Events (node 0 hosts the c10d store; node 3 is the extra node, absent at the start):
  kill_agent N     SIGKILL node N's agent (its workers die with it: parent-death signal)
  start_agent N    start node N's agent again after a kill_agent ("adds nodes back"), or node 3's
                   agent for the first time (the extra node)
  kill_worker N    SIGKILL one worker of node N (a failure: spends one restart of every agent)
  partition N      node N's veth link down (its lease lapses: declared dead)
  heal N           its link up again; if its agent gave up meanwhile (exit 3 after join_timeout),
                   the scenario starts it again
Bounds (why: see docs/rendezvous.md, "Chaos test"):
  - events are GAP_MIN..GAP_MAX s apart, so the group can re-form between two of them (a lost node
    is noticed within ~1.5 s, a round forms within last_call_timeout=1 s, the workers start and
    load the checkpoint in ~1 s);
  - at most one node is out (killed or partitioned) at a time, and node 3 once started counts as a
    node too: with 3 or 4 nodes and --nnodes 2:4, at least 2 nodes can always train;
  - a killed agent is started again START_MIN..START_MAX s later, a partition lasts PART_MIN..PART_MAX
    s (shorter and longer than join_timeout=8 s: the agent either rejoins or gives up and is
    started again);
  - node 0 (the store host) is killed or partitioned only with --store-host (CHAOS_STORE_HOST=1).
  - --workers-only: kill_worker events only, WORKER_GAP_MIN..WORKER_GAP_MAX s apart (the faults
    a resilient loop recovers from in place: the modes' comparison, CHAOS_MODES in chaos.sh);
  - nothing happens in the first WARMUP s (the first group forms and saves a checkpoint) nor in
    the last QUIET s.
"""
import argparse
import random
import re
import sys
from collections import defaultdict

GAP_MIN, GAP_MAX = 6.0, 14.0
START_MIN, START_MAX = 4.0, 15.0
PART_MIN, PART_MAX = 2.0, 12.0
WARMUP, QUIET = 8.0, 6.0
WORKER_GAP_MIN, WORKER_GAP_MAX = 4.0, 8.0


def schedule(seed, seconds, store_host, workers_only=False):
    rng = random.Random(seed)
    if workers_only:
        events = []
        t = WARMUP + rng.uniform(0, WORKER_GAP_MIN)
        while t <= seconds - QUIET:
            events.append((t, "kill_worker", rng.choice([0, 1, 2])))
            t += rng.uniform(WORKER_GAP_MIN, WORKER_GAP_MAX)
        return events
    # state per node: "up", "out" (killed or partitioned: the pending event brings it back),
    # "absent" (node 3 before it is started)
    state = {0: "up", 1: "up", 2: "up", 3: "absent"}
    pending = []  # (time, event, node): the start_agent/heal that ends an outage
    events = []
    t = WARMUP
    end = seconds - QUIET
    while True:
        t += rng.uniform(GAP_MIN, GAP_MAX)
        # an outage ends at its own time, but never closer than GAP_MIN to the next event
        while pending and pending[0][0] <= t:
            pt, ev, n = pending.pop(0)
            pt = max(pt, events[-1][0] + GAP_MIN) if events else pt
            if pt > end:
                break
            events.append((pt, ev, n))
            state[n] = "up"
            t = max(t, pt + GAP_MIN)
        if t > end:
            break
        up = [n for n in sorted(state) if state[n] == "up"]
        out = [n for n in state if state[n] == "out"]
        kinds = ["kill_worker"]
        victims = [n for n in up if n != 0 or store_host]
        if not out and len(up) >= 3 and victims:
            kinds += ["kill_agent", "partition"]
        if state[3] == "absent":
            kinds.append("start_agent")
        kind = rng.choice(kinds)
        if kind == "kill_worker":
            n = rng.choice(up)
        elif kind == "start_agent":
            n = 3
            state[3] = "up"
        else:
            n = rng.choice(victims)
            state[n] = "out"
            if kind == "kill_agent":
                pending.append((t + rng.uniform(START_MIN, START_MAX), "start_agent", n))
            else:
                pending.append((t + rng.uniform(PART_MIN, PART_MAX), "heal", n))
            pending.sort()
        events.append((t, kind, n))
    # Outages still open at the end are ended by the scenario itself ("final" events).
    return events


def parse_logs(paths):
    """Per group: world, starts {rank: (restart, step, resumed_from)}, steps {step: {rank: rec}}."""
    groups = {}
    bad = []
    for path in paths:
        with open(path) as f:
            for ln, line in enumerate(f, 1):
                w = line.split()
                if not w:
                    continue
                where = "%s:%d" % (path, ln)
                try:
                    if w[0] == "start":
                        kv = dict(zip(w[1::2], w[2::2]))
                        if int(kv["rank"]) in groups.get(kv["group"], {}).get("starts", {}):
                            bad.append("%s: a second start line of group %s rank %s" %
                                       (where, kv["group"], kv["rank"]))
                        g = groups.setdefault(kv["group"], {"world": int(kv["world"]), "starts": {},
                                                            "steps": defaultdict(dict)})
                        g["starts"][int(kv["rank"])] = (int(kv["restart"]), int(kv["step"]),
                                                        kv["resumed_from"], where)
                    elif w[0] == "epoch":
                        i = w.index("idx")
                        kv = dict(zip(w[0:i:2], w[1:i:2]))
                        g = groups.setdefault(kv["group"], {"world": int(kv["world"]), "starts": {},
                                                            "steps": defaultdict(dict)})
                        rank, step = int(kv["rank"]), int(kv["step"])
                        if rank in g["steps"][step]:
                            bad.append("%s: group %s rank %d logged step %d twice (first at %s)" %
                                       (where, kv["group"], rank, step,
                                        g["steps"][step][rank]["where"]))
                        g["steps"][step][rank] = {
                            "epoch": int(kv["epoch"]), "time": float(kv["time"]),
                            "world": int(kv["world"]), "idx": [int(x) for x in w[i + 1:]],
                            "where": where}
                    else:
                        bad.append("%s: unknown line %r" % (where, line[:80]))
                except (KeyError, ValueError, IndexError) as e:
                    bad.append("%s: malformed line (%s): %r" % (where, e, line[:80]))
    return groups, bad


def verify(a):
    ok = True

    def report(name, passed, detail):
        nonlocal ok
        ok = ok and passed
        print("check %-14s %s  %s" % (name, "PASS" if passed else "FAIL", detail))

    import glob
    paths = sorted(glob.glob(a.logs + ".*"))
    groups, bad = parse_logs(paths)
    report("logs", not bad and bool(groups),
           "%d files, %d groups%s" % (len(paths), len(groups), "; " + "; ".join(bad[:5]) if bad else ""))

    # 1. The final checkpoint loads: the verification run (train_mlp, world 1, same --ckpt-dir)
    # resumed from it; its sample log's start line names the step and the group that saved it.
    # It is the end of training when the run then trained nothing ("done: N steps" at the step it
    # resumed from) and its sampler was at the last epoch's end (epoch E-1 fully consumed, when the
    # last step was also a periodic save, or epoch E at offset 0).
    final = None
    try:
        with open(a.verify_log) as f:
            for line in f:
                w = line.split()
                if w and w[0] == "start":
                    kv = dict(zip(w[1::2], w[2::2]))
                    final = (int(kv["step"]), kv["resumed_from"])
    except OSError as e:
        report("checkpoint", False, "no verification log: %s" % e)
        return 1
    verify_out = open(a.verify_out).read() if a.verify_out else ""
    m = re.search(r"resumed from \S+ \(step (\d+), epoch (\d+), sample offset (\d+)", verify_out)
    d = re.search(r"\] done: (\d+) steps", verify_out)
    at_end = m is not None and (int(m.group(2)), int(m.group(3))) in (
        (a.epochs, 0), (a.epochs - 1, a.dataset_size))
    loaded = (final is not None and final[1] not in ("-", "?") and m is not None and
              int(m.group(1)) == final[0] and at_end and d is not None and
              int(d.group(1)) == final[0])
    report("checkpoint", loaded,
           "final checkpoint: step %s, saved by group %s; resumed at epoch %s offset %s "
           "(expected epoch %d offset 0 or epoch %d offset %d), then done at step %s" %
           (final[0] if final else "?", final[1] if final else "?", m.group(2) if m else "?",
            m.group(3) if m else "?", a.epochs, a.epochs - 1, a.dataset_size,
            d.group(1) if d else "? (not done)"))
    if final is None or final[1] not in groups:
        report("finished", False, "the group that saved the final checkpoint has no sample log")
        return 1
    n_final, g_final = final

    # 2. Training finished: rank 0 of the final group printed "done: N steps" with that N, and
    # every agent's exit status is one the scenario expected (chaos.sh passes them as
    # --agent-exit "node:incarnation:status:expected-set").
    done = []
    for p in a.agent_logs:
        done += [int(x) for x in re.findall(r"\] done: (\d+) steps", open(p, errors="replace").read())]
    exits_ok = True
    exit_detail = []
    for e in a.agent_exit:
        node, inc, rc, allowed = e.split(":")
        exit_detail.append("n%s#%s=%s" % (node, inc, rc))
        if rc not in allowed.split(","):
            exits_ok = False
            exit_detail[-1] += "(expected %s)" % allowed
    report("finished", n_final in done and exits_ok,
           "final step %d, 'done' lines %s; agent exits %s" % (n_final, done, " ".join(exit_detail)))

    # 3. Exactly once per epoch over the committed steps. The committed steps are found backwards
    # from the final checkpoint: the group G that saved it at step N resumed from the checkpoint
    # (step S) saved by group H (its start lines say so), so G's steps S+1..N are committed and the
    # rest of G's steps (after N) are not; then H's steps up to S, and so on to the group that
    # started from scratch (resumed_from "-", step 0). Every committed step must have one line from
    # each rank 0..world-1 of its group (each rank writes its line before the step's allreduce,
    # which completes only when every rank is in it).
    chain = []
    cur, end = g_final, n_final
    problems = []
    seen_groups = set()
    committed = []  # (group, step, world, rank, epoch, idx)
    while True:
        if cur in seen_groups or cur not in groups:
            problems.append("chain broken at group %s" % cur)
            break
        seen_groups.add(cur)
        g = groups[cur]
        starts = {r: s for r, s in g["starts"].items()}
        froms = {(s[1], s[2]) for s in starts.values()}
        if len(froms) != 1 or sorted(starts) != list(range(g["world"])):
            problems.append("group %s: start lines disagree or miss ranks: %s" % (cur, sorted(starts)))
            break
        s0, prev = froms.pop()
        chain.append("%s[%d..%d]w%d" % (cur, s0 + 1, end, g["world"]))
        for step in range(s0 + 1, end + 1):
            ranks = g["steps"].get(step, {})
            if sorted(ranks) != list(range(g["world"])):
                problems.append("group %s step %d: lines from ranks %s of world %d" %
                                (cur, step, sorted(ranks), g["world"]))
                continue
            for r, rec in ranks.items():
                committed.append((cur, step, g["world"], r, rec["epoch"], rec["idx"]))
        if prev == "-":
            if s0 != 0:
                problems.append("group %s started from scratch at step %d" % (cur, s0))
            break
        cur, end = prev, s0
    counts = defaultdict(lambda: defaultdict(int))
    for _, _, _, _, epoch, idx in committed:
        for i in idx:
            counts[epoch][i] += 1
    for e in range(a.epochs):
        c = counts.get(e, {})
        missing = [i for i in range(a.dataset_size) if c.get(i, 0) == 0]
        twice = [i for i, k in c.items() if k > 1]
        extra = [i for i in c if i < 0 or i >= a.dataset_size]
        if missing or twice or extra:
            problems.append("epoch %d: %d samples missing (e.g. %s), %d more than once (e.g. %s)%s" %
                            (e, len(missing), missing[:3], len(twice), twice[:3],
                             ", out of range %s" % extra[:3] if extra else ""))
    stray = sorted(set(counts) - set(range(a.epochs)))
    if stray:
        problems.append("committed steps of epochs %s (only 0..%d exist)" % (stray, a.epochs - 1))
    lost = sum(len(g["steps"]) for g in groups.values()) - len({(c[0], c[1]) for c in committed})
    report("exactly_once", not problems,
           "%d committed steps in a chain of %d groups, %d logged steps not committed (redone), "
           "epochs 0..%d x %d samples%s" %
           (len({(c[0], c[1]) for c in committed}), len(chain), lost, a.epochs - 1, a.dataset_size,
            "; " + "; ".join(problems[:6]) if problems else ""))
    print("chain (newest first): " + " <- ".join(chain))

    # 4. No two groups trained at once: each group's interval runs from its first step line to
    # its last (every group, committed or not); sorted by start, each must begin after every
    # earlier one ended.
    iv = []
    for gid, g in groups.items():
        ts = [rec["time"] for ranks in g["steps"].values() for rec in ranks.values()]
        if ts:
            iv.append((min(ts), max(ts), gid))
    iv.sort()
    overlaps = []
    last_end, last_g = float("-inf"), None
    for s, e, gid in iv:
        if s < last_end:
            overlaps.append("%s started at %.3f before %s ended at %.3f" % (gid, s, last_g, last_end))
        if e > last_end:
            last_end, last_g = e, gid
    gaps = [iv[i + 1][0] - iv[i][1] for i in range(len(iv) - 1)]
    report("no_overlap", not overlaps,
           "%d groups that trained; smallest gap between two %.3f s%s" %
           (len(iv), min(gaps) if gaps else 0.0, "; " + "; ".join(overlaps[:5]) if overlaps else ""))
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("schedule")
    s.add_argument("--seed", type=int, required=True)
    s.add_argument("--seconds", type=float, required=True)
    s.add_argument("--store-host", action="store_true")
    s.add_argument("--workers-only", action="store_true")
    v = sub.add_parser("verify")
    v.add_argument("--logs", required=True, help="the --sample-log prefix of the run")
    v.add_argument("--epochs", type=int, required=True)
    v.add_argument("--dataset-size", type=int, required=True)
    v.add_argument("--verify-log", required=True, help="the verification run's sample log")
    v.add_argument("--verify-out", help="the verification run's output")
    v.add_argument("--agent-logs", nargs="*", default=[])
    v.add_argument("--agent-exit", action="append", default=[],
                   help="node:incarnation:status:allowed,statuses")
    a = p.parse_args()
    if a.cmd == "schedule":
        if a.seconds < WARMUP + QUIET:
            sys.exit("chaos.py: --seconds must be at least %g" % (WARMUP + QUIET))
        for t, ev, n in schedule(a.seed, a.seconds, a.store_host, a.workers_only):
            print("%.1f %s %d" % (t, ev, n))
        return 0
    return verify(a)


if __name__ == "__main__":
    sys.exit(main())
