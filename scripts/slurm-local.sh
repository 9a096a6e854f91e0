#!/usr/bin/env bash
# slurm-local.sh - a real, throw-away SLURM cluster (slurmctld + slurmd + munged)
# (the project's copy of the shared slurm-setup.sh, so tests do not depend on it)
# on localhost, for tests. Debian 12 (bookworm), slurm-wlm 22.05, run as root.
#
#   eval "$(bash slurm-setup.sh up)"        # 1 node named "localhost"
#   eval "$(SLURMTEST_NODES=2 bash slurm-setup.sh up)"   # nodes n1,n2 (2 slurmds)
#   srun -N1 -n2 env | grep SLURM_          # ... run tests ...
#   bash slurm-setup.sh down "$SLURMTEST_DIR"
#
# `up` installs the packages if missing (apt), writes all config/state/logs into
# a fresh temp dir, starts munged, slurmctld and one slurmd per node as daemons,
# waits until `sinfo` shows every node idle, and prints to stdout only
#   export SLURM_CONF=<dir>/slurm.conf
#   export SLURMTEST_DIR=<dir>
# (so it can be eval'ed); progress and the daemon pids go to stderr.  The same
# two lines are in <dir>/env.sh and the pids in <dir>/pids ("name pid" lines).
# If `up` fails after creating the dir, it stops whatever it had started and
# keeps the dir (logs) for inspection.
# `down [DIR]` cancels jobs, kills exactly those pids (plus any slurmstepd that
# carries this instance's marker in its environment), removes the /etc/hosts
# line it added, and deletes DIR unless SLURMTEST_KEEP=1.
#
# Knobs (environment):
#   SLURMTEST_NODES=1        number of emulated nodes (>1 uses Debian's
#                            MULTIPLE_SLURMD build: n1..nN, one slurmd each)
#   SLURMTEST_WORKDIR=       dir to use (default: mktemp -d /tmp/slurm-test.XXXXXX);
#                            (SLURMTEST_DIR is only an output, never read by up)
#   SLURMTEST_PORT=16817     slurmctld port; slurmd ports are PORT+1 (1 node)
#                            or PORT+100 .. PORT+100+N-1 (multi-node)
#   SLURMTEST_ADD_HOSTS=     1 = add "127.0.0.1 n1 n2 ..." to /etc/hosts so the
#                            node names resolve (default 1 when NODES>1)
#   SLURMTEST_SKIP_INSTALL=  1 = never call apt
#   SLURMTEST_TIMEOUT=60     seconds to wait for the nodes to become idle
set -euo pipefail

PKGS=(slurmctld slurmd slurm-client munge)
HOSTS_MARK="# slurm-test"

log() { echo "[slurm-setup] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

install_pkgs() {
    if dpkg -s "${PKGS[@]}" >/dev/null 2>&1; then return 0; fi
    [ "${SLURMTEST_SKIP_INSTALL:-}" = 1 ] && die "packages missing: ${PKGS[*]}"
    [ "$(id -u)" = 0 ] || die "must be root to install ${PKGS[*]}"
    local t0=$SECONDS added_policy=0
    # Keep the packages' postinst from starting system-wide daemons
    # (no systemd here; the init.d scripts would try /etc/slurm/slurm.conf).
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d; added_policy=1
    fi
    log "apt-get update + install ${PKGS[*]} (log: /tmp/slurm-setup-apt.log)"
    {
        apt-get update &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${PKGS[@]}"
    } > /tmp/slurm-setup-apt.log 2>&1 || { [ $added_policy = 1 ] && rm -f /usr/sbin/policy-rc.d; tail -20 /tmp/slurm-setup-apt.log >&2; die "apt failed"; }
    [ $added_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
    log "installed in $((SECONDS - t0)) s"
}

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_pidfile() {  # file timeout_s
    local i
    for ((i = 0; i < $2 * 10; i++)); do
        [ -s "$1" ] && return 0
        sleep 0.1
    done
    return 1
}

up() {
    install_pkgs
    [ "$(id -u)" = 0 ] || die "run as root (SlurmUser=root, munged as root)"
    local nodes=${SLURMTEST_NODES:-1} port=${SLURMTEST_PORT:-16817}
    local timeout=${SLURMTEST_TIMEOUT:-60}
    local addhosts=${SLURMTEST_ADD_HOSTS:-}
    [ -z "$addhosts" ] && { [ "$nodes" -gt 1 ] && addhosts=1 || addhosts=0; }

    # ---- node list / ports ----
    local names=() nodeline p
    # Topology as slurmd sees it (configuring more than that would DRAIN the node).
    local topo sockets cores threads mem
    topo=$(slurmd -C | head -1)
    sockets=$(sed -n 's/.*SocketsPerBoard=\([0-9]*\).*/\1/p' <<<"$topo")
    cores=$(sed -n 's/.*CoresPerSocket=\([0-9]*\).*/\1/p' <<<"$topo")
    threads=$(sed -n 's/.*ThreadsPerCore=\([0-9]*\).*/\1/p' <<<"$topo")
    mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$topo")
    mem=$(( mem / nodes / 2 )); [ "$mem" -lt 100 ] && mem=100
    local hw="Sockets=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads RealMemory=$mem"
    local busy=($port)
    if [ "$nodes" -eq 1 ]; then
        names=(localhost)
        nodeline="NodeName=localhost NodeAddr=127.0.0.1 $hw State=UNKNOWN"
        local slurmdport="SlurmdPort=$((port + 1))"; busy+=($((port + 1)))
    else
        local first=$((port + 100)) last=$((port + 100 + nodes - 1)) i
        for ((i = 1; i <= nodes; i++)); do names+=("n$i"); busy+=($((first + i - 1))); done
        nodeline="NodeName=n[1-$nodes] NodeHostname=localhost NodeAddr=127.0.0.1 Port=$first-$last $hw State=UNKNOWN"
        local slurmdport="SlurmdPort=$((port + 1))"
    fi
    for p in "${busy[@]}"; do port_busy "$p" && die "port $p already in use (set SLURMTEST_PORT)"; done

    local dir=${SLURMTEST_WORKDIR:-}
    if [ -z "$dir" ]; then dir=$(mktemp -d /tmp/slurm-test.XXXXXX); else mkdir -p "$dir"; fi
    dir=$(cd "$dir" && pwd)
    chmod 755 "$dir"
    mkdir -p "$dir"/{state,spool,log,munge}
    chmod 755 "$dir/munge"   # munged insists the socket dir is world-executable
    : > "$dir/pids"
    # on any failure from here on: stop what was started, remove the dir
    UP_DIR=$dir
    trap 'rc=$?; if [ $rc != 0 ] && [ -n "${UP_DIR:-}" ]; then log "up failed: stopping its daemons, logs kept in $UP_DIR"; SLURMTEST_KEEP=1 down "$UP_DIR" || true; fi' EXIT
    for n in "${names[@]}"; do mkdir -p "$dir/spool/$n"; done

    cat > "$dir/slurm.conf" <<EOF
ClusterName=testcluster
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.sock
SlurmctldPort=$port
$slurmdport
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups anywhere: plain process tracking, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# batch jobs start immediately (default batch_sched_delay=3 s)
SchedulerParameters=batch_sched_delay=0
MailProg=/bin/true
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
$nodeline
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    export SLURM_CONF="$dir/slurm.conf"
    # Marker inherited by the daemons and every slurmstepd they spawn (see down()).
    export SLURMTEST_INSTANCE="$dir"

    # ---- munged (own key + socket, no /etc/munge or /run/munge needed) ----
    (umask 077; dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none)
    chmod 400 "$dir/munge/munge.key"
    /usr/sbin/munged --socket="$dir/munge/munge.sock" --key-file="$dir/munge/munge.key" \
        --log-file="$dir/munge/munged.log" --pid-file="$dir/munge/munged.pid" \
        --seed-file="$dir/munge/munged.seed" \
        || { cat "$dir/munge/munged.log" >&2; die "munged failed"; }
    wait_pidfile "$dir/munge/munged.pid" 10 || die "munged wrote no pid file"
    echo "munged $(cat "$dir/munge/munged.pid")" >> "$dir/pids"
    munge -S "$dir/munge/munge.sock" -n | unmunge -S "$dir/munge/munge.sock" >/dev/null \
        || die "munge round trip failed"

    # ---- slurmctld ----
    slurmctld -f "$SLURM_CONF" || { cat "$dir/log/slurmctld.log" >&2; die "slurmctld failed"; }
    wait_pidfile "$dir/slurmctld.pid" 10 || die "slurmctld wrote no pid file"
    echo "slurmctld $(cat "$dir/slurmctld.pid")" >> "$dir/pids"

    # ---- one slurmd per node ----
    for n in "${names[@]}"; do
        slurmd -f "$SLURM_CONF" -N "$n" || { cat "$dir/log/slurmd-$n.log" >&2; die "slurmd $n failed"; }
        wait_pidfile "$dir/slurmd-$n.pid" 10 || die "slurmd $n wrote no pid file"
        echo "slurmd-$n $(cat "$dir/slurmd-$n.pid")" >> "$dir/pids"
    done

    if [ "$addhosts" = 1 ] && [ "$nodes" -gt 1 ]; then
        local tag="$HOSTS_MARK $dir"
        echo "127.0.0.1 ${names[*]} $tag" >> /etc/hosts
        echo "$tag" > "$dir/hosts-tag"
    fi

    # ---- wait until every node is idle ----
    local i states= ok=0
    for ((i = 0; i < timeout * 5; i++)); do
        states=$(sinfo -h -N -o '%N %T' 2>/dev/null) || states=
        if [ -n "$states" ] && [ "$(grep -c ' idle$' <<<"$states")" -eq "$nodes" ]; then ok=1; break; fi
        sleep 0.2
    done
    if [ $ok != 1 ]; then
        sinfo -N >&2 || true
        tail -n 5 "$dir"/log/*.log >&2 || true
        die "nodes not idle after ${timeout}s (states: $(echo $states))"
    fi

    printf 'export SLURM_CONF=%q\nexport SLURMTEST_DIR=%q\n' "$SLURM_CONF" "$dir" > "$dir/env.sh"
    log "cluster up in $dir ($nodes node(s): ${names[*]}); pids:"
    sed 's/^/[slurm-setup]   /' "$dir/pids" >&2
    log "teardown: bash $0 down $dir"
    cat "$dir/env.sh"
    UP_DIR=
}

proc_alive() {  # pid -> true if running and not a zombie
    [ -r "/proc/$1/stat" ] || return 1
    local st; st=$(sed 's/^.*) \(.\).*/\1/' "/proc/$1/stat" 2>/dev/null) || return 1
    [ "$st" != Z ]
}

kill_pid() {  # pid name
    local pid=$1 i
    proc_alive "$pid" || return 0
    kill "$pid" 2>/dev/null || return 0
    for ((i = 0; i < 50; i++)); do proc_alive "$pid" || return 0; sleep 0.2; done
    log "$2 ($pid) ignored SIGTERM, sending SIGKILL"
    kill -9 "$pid" 2>/dev/null || true
}

down() {
    local dir=${1:-${SLURMTEST_DIR:-}}
    [ -n "$dir" ] && [ -f "$dir/pids" ] || die "usage: $0 down DIR (DIR must contain pids)"
    dir=$(cd "$dir" && pwd)
    export SLURM_CONF="$dir/slurm.conf"
    # cancel whatever is still queued/running on this test cluster only
    if timeout 10 scancel --user=root >/dev/null 2>&1; then
        local i
        for ((i = 0; i < 50; i++)); do
            [ -z "$(timeout 5 squeue -h 2>/dev/null | grep -v ' CG ' || true)" ] && break; sleep 0.2
        done
    fi
    # slurmds first, then slurmctld, munged last
    local name pid
    while read -r name pid; do
        case $name in slurmd-*) kill_pid "$pid" "$name"; log "stopped $name ($pid)";; esac
    done < "$dir/pids"
    while read -r name pid; do
        case $name in slurmctld) kill_pid "$pid" "$name"; log "stopped $name ($pid)";; esac
    done < "$dir/pids"
    # stray slurmstepd of this instance (inherit SLURMTEST_INSTANCE=$dir from slurmd)
    local p
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        [ "$( { cat "/proc/$p/comm"; } 2>/dev/null)" = slurmstepd ] && proc_alive "$p" || continue
        if { tr '\0' '\n' < "/proc/$p/environ"; } 2>/dev/null | grep -qxF "SLURMTEST_INSTANCE=$dir"; then
            kill_pid "$p" slurmstepd; log "stopped stray slurmstepd ($p)"
        fi
    done
    while read -r name pid; do
        case $name in munged) kill_pid "$pid" "$name"; log "stopped $name ($pid)";; esac
    done < "$dir/pids"
    if [ -f "$dir/hosts-tag" ]; then
        local tag; tag=$(cat "$dir/hosts-tag")
        # rewrite in place (works even if /etc/hosts is a bind mount)
        grep -vF -- "$tag" /etc/hosts > "$dir/hosts.new" || true
        cat "$dir/hosts.new" > /etc/hosts
    fi
    if [ "${SLURMTEST_KEEP:-}" = 1 ]; then log "kept $dir"; else rm -rf "$dir"; fi
}

case ${1:-} in
    up) up ;;
    down) shift; down "${1:-}" ;;
    install) install_pkgs ;;
    *) echo "usage: $0 up | down DIR | install" >&2; exit 2 ;;
esac
