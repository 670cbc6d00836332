#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, for `pytest -m slurm tests/workflow/test_slurm.py`.
# Installs Debian's slurm-wlm and munge if missing, then starts munged, slurmctld and slurmd as root.
# No accounting database: Snakemake's SLURM plugin then polls with `squeue` (profiles/slurm sets
# status_command: squeue), which needs MinJobAge well above its polling interval (set to 600 s here).
# The node also has FAKE_GPUS (default 2) fake GPUs: GRES gpu entries whose device files are character
# devices like /dev/null (no NVIDIA hardware needed), so that jobs asking `--gpus=1` are scheduled, limited
# and given CUDA_VISIBLE_DEVICES as on a GPU cluster (tests/workflow/test_slurm.py checks GPU requests).
# Usage (as root): tests/support/slurm_single_node.sh [start|stop|status]
set -euo pipefail

ACTION=${1:-start}
HOST=$(hostname -s)
CONF_DIR=/etc/slurm
LOG_DIR=/var/log/slurm
FAKE_GPUS=${FAKE_GPUS:-2}

install() {
    if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
        apt-get update
        DEBIAN_FRONTEND=noninteractive apt-get install -y slurm-wlm munge
    fi
}

write_config() {
    local cpus mem
    cpus=$(nproc)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
    mkdir -p "$CONF_DIR" "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd
    : > "$CONF_DIR/gres.conf"
    for i in $(seq 0 $((FAKE_GPUS - 1))); do
        [ -e "/dev/fake-gpu$i" ] || mknod "/dev/fake-gpu$i" c 1 3   # same major/minor as /dev/null
        echo "Name=gpu File=/dev/fake-gpu$i" >> "$CONF_DIR/gres.conf"
    done
    cat > "$CONF_DIR/slurm.conf" <<CONF
ClusterName=dflash-eval-test
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
GresTypes=gpu
ReturnToService=2
MinJobAge=600
SchedulerParameters=sched_interval=2
NodeName=$HOST CPUs=$cpus RealMemory=$mem Gres=gpu:$FAKE_GPUS State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
}

start_munge() {
    mkdir -p /etc/munge /var/log/munge /var/lib/munge /run/munge
    if [ ! -s /etc/munge/munge.key ]; then
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown -R munge:munge /etc/munge /var/log/munge /var/lib/munge /run/munge
    chmod 0400 /etc/munge/munge.key
    chmod 0700 /etc/munge
    if ! munge -n >/dev/null 2>&1; then
        runuser -u munge -- /usr/sbin/munged
    fi
    for _ in $(seq 30); do munge -n >/dev/null 2>&1 && return 0; sleep 1; done
    echo "munged did not start (see /var/log/munge/munged.log)" >&2
    return 1
}

start() {
    install
    write_config
    start_munge
    [ -f /run/slurmctld.pid ] && kill -0 "$(cat /run/slurmctld.pid)" 2>/dev/null || slurmctld -c
    [ -f /run/slurmd.pid ] && kill -0 "$(cat /run/slurmd.pid)" 2>/dev/null || slurmd
    for _ in $(seq 60); do
        if sinfo -h -N -o '%T' 2>/dev/null | grep -q -E '^(idle|mixed|allocated)'; then
            scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true
            sinfo
            return 0
        fi
        scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true
        sleep 1
    done
    echo "the node did not become idle; see $LOG_DIR/slurmctld.log and $LOG_DIR/slurmd.log" >&2
    sinfo -N -l >&2 || true
    return 1
}

stop() {
    for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
        [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
    done
}

case "$ACTION" in
    start) start ;;
    stop) stop ;;
    status) sinfo -N -l ;;
    *) echo "usage: $0 [start|stop|status]" >&2; exit 2 ;;
esac
