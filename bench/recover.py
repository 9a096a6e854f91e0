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

Part 2, the state transfer of 1 GiB (bench/state_transfer): between two local ranks (shared
memory), and between two ranks on two "nodes" (two agents on 127.0.0.1, each a node of one rank:
Gloo over loopback TCP), each against its reference measured in the same process (memcpy, and a
loopback TCP stream).

Prints a table and RESULT lines (see scripts/bench_recover.sh).
"""
import argparse
import os
import random
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time

START = re.compile(r"hangbench start rank=(\d+) local_rank=(\d+) attempt=(\d+) pid=(\d+) t=([\d.]+)")
STEP = re.compile(r"hangbench step=(\d+) rank=0 attempt=(\d+) t=([\d.]+)")


def trial(a, mode, kill_after, workdir, port):
    """One job: returns (recovery_s, steps_redone, detail) or raises RuntimeError."""
    ckpt = os.path.join(workdir, "ckpt-%s-%d" % (mode, port))
    cmd = [a.trun, "--standalone", "--nproc-per-node", "4", "--max-restarts", "3",
           a.train_mlp, "--print-steps",
           "--epochs", "100000", "--dataset-size", "4096", "--batch-size", "16",
           "--step-sleep-ms", str(a.step_sleep_ms), "--ckpt-every", str(a.ckpt_every),
           "--ckpt-dir", ckpt]
    if mode == "classic":
        cmd.append("--classic")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                         text=True, bufsize=1)
    pids = {}          # local rank -> pid, of the current attempt
    last_step = None   # rank 0's last step line before the kill
    killed_at = None
    killed_attempt = None
    result = None
    log = []
    deadline = time.time() + a.trial_timeout
    try:
        while time.time() < deadline and result is None:
            r, _, _ = select.select([p.stdout], [], [], 0.5)
            if not r:
                if p.poll() is not None:
                    break
                continue
            line = p.stdout.readline()
            if not line:
                break
            log.append(line)
            m = START.search(line)
            if m:
                pids[int(m.group(2))] = int(m.group(4))
                continue
            m = STEP.search(line)
            if not m:
                continue
            step, attempt, t = int(m.group(1)), int(m.group(2)), float(m.group(3))
            if killed_at is None:
                last_step = step
                if step >= kill_after and 2 in pids:
                    killed_attempt = attempt
                    killed_at = time.time()
                    os.kill(pids[2], signal.SIGKILL)
            elif attempt > killed_attempt and t > killed_at:
                result = (t - killed_at, max(0, last_step - (step - 1)),
                          "killed after step %d, first step after: %d" % (last_step, step))
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    if result is None:
        raise RuntimeError("%s trial: no recovery seen (exit %s); last lines:\n%s" %
                           (mode, p.returncode, "".join(log[-15:])))
    return result


def transfer(a, nodes):
    """bench/state_transfer on 2 local ranks (nodes=1) or 2 agents of one rank each (nodes=2)."""
    args = ["--mib", str(a.mib)]
    if nodes == 1:
        # --hang-detection off: rank 0's references (memcpy, the TCP stream) after the transfer are
        # no training steps, and a slow transfer must not be judged a hang.
        out = subprocess.run([a.trun, "--standalone", "--nproc-per-node", "2",
                              "--hang-detection", "off", a.state_transfer]
                             + args, capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        text = out.stdout + out.stderr
    else:
        port = 29740
        procs = []
        for node in range(2):
            cmd = [a.trun, "--nnodes", "2", "--nproc-per-node", "1", "--hang-detection", "off",
                   "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", "127.0.0.1:%d" % port, "--rdzv-id", "transfer",
                   "--rdzv-conf", "is_host=%d" % (1 if node == 0 else 0), a.state_transfer] + args
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, env=dict(os.environ, OMP_NUM_THREADS="1")))
        text = ""
        for p in procs:
            try:
                text += p.communicate(timeout=300)[0]
            except subprocess.TimeoutExpired:
                p.kill()
                text += p.communicate()[0]
    m = re.search(r"transfer ranks=(\d+) bytes=(\d+) seconds=([\d.]+) gbps=([\d.]+) "
                  r"memcpy_gbps=([\d.]+) tcp_gbps=([\d.]+) via=(\S+)", text)
    if not m:
        raise RuntimeError("state_transfer printed no result:\n" + text[-3000:])
    return {"bytes": int(m.group(2)), "seconds": float(m.group(3)), "gbps": float(m.group(4)),
            "memcpy_gbps": float(m.group(5)), "tcp_gbps": float(m.group(6)), "via": m.group(7)}


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
    a = ap.parse_args()
    rng = random.Random(a.seed)
    rows = {"loop": [], "classic": []}
    with tempfile.TemporaryDirectory(prefix="trun-recover-") as workdir:
        port = 29710
        for i in range(a.trials):
            kill_after = rng.randrange(25, 45)
            for mode in ("loop", "classic"):
                port += 1
                rec, redone, detail = trial(a, mode, kill_after, workdir, port)
                rows[mode].append((rec, redone))
                print("trial %d %-7s recovery %8.1f ms  steps redone %3d  (%s)" %
                      (i + 1, mode, rec * 1e3, redone, detail), flush=True)
    # Three transfers each, the median by rate (this 2-core machine is noisy).
    def median_of(runs):
        return sorted(runs, key=lambda r: r["gbps"])[len(runs) // 2]
    local = median_of([transfer(a, 1) for _ in range(3)])
    remote = median_of([transfer(a, 2) for _ in range(3)])

    def med(mode):
        return statistics.median(r[0] for r in rows[mode])

    print()
    print("one node, 4 ranks, SIGKILL of local rank 2 (%d trials each, %d ms steps, checkpoint "
          "every %d steps)" % (a.trials, a.step_sleep_ms, a.ckpt_every))
    print("%-9s %14s %14s %14s %12s" % ("path", "median ms", "max ms", "redone (mean)",
                                         "redone (max)"))
    for mode in ("loop", "classic"):
        rs = rows[mode]
        print("%-9s %14.1f %14.1f %14.2f %12d" % (
            mode, med(mode) * 1e3, max(r[0] for r in rs) * 1e3,
            statistics.mean(r[1] for r in rs), max(r[1] for r in rs)))
    print()
    print("state transfer of %d MiB (median of 3 by rate; references measured in the same run)"
          % a.mib)
    print("%-28s %10s %12s %12s" % ("between", "GB/s", "reference", "ref GB/s"))
    print("%-28s %10.2f %12s %12.2f" % ("2 local ranks (%s)" % local["via"], local["gbps"],
                                         "memcpy", local["memcpy_gbps"]))
    print("%-28s %10.2f %12s %12.2f" % ("2 nodes on loopback (%s)" % remote["via"],
                                         remote["gbps"], "TCP stream", remote["tcp_gbps"]))
    print()
    loop_ms, classic_ms = med("loop") * 1e3, med("classic") * 1e3
    loop_redone = max(r[1] for r in rows["loop"])
    classic_redone = statistics.mean(r[1] for r in rows["classic"])
    print("RESULT name=recover_one_node_ms value=%.1f unit=ms peer=%.1f ratio=%.2f" %
          (loop_ms, classic_ms, classic_ms / loop_ms))
    print("RESULT name=recover_steps_redone value=%d unit=steps peer=%.2f ratio=%.2f" %
          (loop_redone, classic_redone, (classic_redone + 1) / (loop_redone + 1)))
    print("RESULT name=state_transfer_local_gbps value=%.2f unit=GB/s peer=%.2f ratio=%.2f" %
          (local["gbps"], local["memcpy_gbps"], local["gbps"] / local["memcpy_gbps"]))
    print("RESULT name=state_transfer_nodes_gbps value=%.2f unit=GB/s peer=%.2f ratio=%.2f" %
          (remote["gbps"], remote["tcp_gbps"], remote["gbps"] / remote["tcp_gbps"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
