#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, from Debian's packages, for trying and testing
# `hydra/launcher=slurm` without a real cluster.
#
#   scripts/slurm_local_cluster.sh up DIR [--install]   # start munged, slurmctld, slurmd; print the env to use
#   scripts/slurm_local_cluster.sh down DIR             # stop them (DIR keeps the logs)
#
# Everything lives under DIR (config, keys, state, spool, logs, pids), nothing under /etc or /var, so it can
# run beside a real installation. Clients find it through SLURM_CONF=DIR/slurm.conf, which `up` prints as the
# last line (`export SLURM_CONF=...`). --install apt-installs slurmctld, slurmd, slurm-client and munge first
# (root, Debian/Ubuntu). The node gets this machine's real CPUs and memory (`slurmd -C`); processes are tracked
# by /proc walks (proctrack/linuxproc) and tasks are not confined (task/none), so no cgroups or systemd are
# needed: containers and CI machines run it as they are.
set -euo pipefail

usage() { echo "usage: $0 up DIR [--install] | down DIR" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
action=$1
dir=$(mkdir -p "$2" && cd "$2" && pwd)
install=${3:-}

stop() {
    for pidfile in "$dir"/slurmd.pid "$dir"/slurmctld.pid "$dir"/munged.pid; do
        [[ -s $pidfile ]] || continue
        pid=$(cat "$pidfile")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
        rm -f "$pidfile"
    done
}

if [[ $action == down ]]; then
    stop
    echo "local SLURM cluster under $dir stopped"
    exit 0
fi
[[ $action == up ]] || usage

if [[ $install == --install ]] && ! command -v slurmctld >/dev/null; then
    [[ $(id -u) == 0 ]] || { echo "--install needs root (apt-get)" >&2; exit 3; }
    command -v apt-get >/dev/null || { echo "--install needs apt-get (Debian/Ubuntu)" >&2; exit 3; }
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >"$dir/apt.log" 2>&1
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >>"$dir/apt.log" 2>&1 \
        || { echo "apt-get install failed; see $dir/apt.log" >&2; exit 3; }
fi
for cmd in munged mungekey slurmctld slurmd sbatch; do
    command -v "$cmd" >/dev/null || { echo "$cmd not found (install slurmctld slurmd slurm-client munge)" >&2; exit 3; }
done

stop  # a previous cluster in the same DIR
mkdir -p "$dir"/{munge,state,spool}
chmod 700 "$dir/munge"
host=$(hostname -s)
user=$(id -un)

# munge: its own key, socket and files, so it does not need (or disturb) a system munged
[[ -s $dir/munge/munge.key ]] || mungekey --create --keyfile="$dir/munge/munge.key" 2>/dev/null \
    || dd if=/dev/urandom bs=1 count=1024 of="$dir/munge/munge.key" status=none
chmod 400 "$dir/munge/munge.key"
munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
    --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge/munged.seed"

# two free TCP ports for slurmctld and slurmd
read -r ctld_port slurmd_port < <(python3 - <<'EOF'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
)
node=$(slurmd -C | head -1 | sed 's/^NodeName=[^ ]* //')  # CPUs=.. Boards=.. ... RealMemory=..
cat >"$dir/slurm.conf" <<EOF
# written by scripts/slurm_local_cluster.sh: one node, this machine
ClusterName=kvbench-local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=$user
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=2
MinJobAge=30
NodeName=$host NodeAddr=127.0.0.1 $node State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$dir/slurm.conf
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"

for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -Eq '^(idle|mixed|allocated)'; then
        echo "local SLURM cluster up: node $host ($node), logs in $dir"
        echo "export SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.5
done
echo "the node did not come up; see $dir/slurmctld.log and $dir/slurmd.log" >&2
sinfo -N -l >&2 || true
exit 4
