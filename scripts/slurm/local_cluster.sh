#!/usr/bin/env bash
# A two-node slurm cluster on this one machine, for trying and testing the slurm scripts (Debian's slurm 22.05 and
# munge, as root; `bash scripts/setup.sh --slurm` installs them).
#
#   bash scripts/slurm/local_cluster.sh start [--gpus=N] [--dir=DIR] [--port=P]
#   source DIR/env                     # SLURM_CONF for sbatch/srun/sinfo/squeue
#   bash scripts/slurm/local_cluster.sh stop [--dir=DIR]
#
# start: munged (its own key and socket), slurmctld and two slurmd in the foreground of their own process, every
#   pid recorded in DIR/pids; the nodes are $(hostname) and $(hostname)-n2 (the second name added to /etc/hosts as
#   127.0.0.1 unless it already resolves), each slurmd on its own port (slurmctld on P, slurmd on P+1 and P+2); the
#   node's CPUs are declared, not detected (8 each). Returns once `sinfo` shows both nodes idle.
#   --gpus=0   CPU-only nodes (no GresTypes): a job that asks for a GPU is refused                             [default]
#   --gpus=N   each node declares N placeholder GPUs (gres.conf with AutoDetect=off and N links to /dev/null per node
#              as their devices): slurm allocates and binds them (CUDA_VISIBLE_DEVICES) as it would real ones
#   --dir=DIR  state, configuration and logs [${TMPDIR:-/tmp}/moe_lora_rl-slurm]
#   --port=P   first of the three TCP ports [16817]
# stop: cancels the cluster's jobs, ends every daemon of DIR/pids (SIGTERM, then SIGKILL after 10 s), each only if
#   that pid is still the daemon it started, and removes the /etc/hosts line it added. Safe to run twice.
set -euo pipefail

die() { echo "local_cluster.sh: error: $*" >&2; exit 2; }

ACTION="${1:-}"
[[ $# -eq 0 ]] || shift
DIR="${TMPDIR:-/tmp}/moe_lora_rl-slurm"
GPUS=0
PORT=16817
while [[ $# -gt 0 ]]; do
  case "$1" in
    --gpus=*) GPUS="${1#*=}" ;;
    --dir=*) DIR="${1#*=}" ;;
    --port=*) PORT="${1#*=}" ;;
    -h|--help) sed -n '/^# A two-node/,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
  shift
done
[[ "$GPUS" =~ ^[0-9]+$ ]] || die "--gpus=$GPUS must be an integer >= 0"
[[ "$PORT" =~ ^[0-9]+$ && "$PORT" -ge 1024 && "$PORT" -le 65000 ]] || die "--port=$PORT must be an integer in 1024..65000"
DIR="$(mkdir -p "$DIR" && cd "$DIR" && pwd)" || die "--dir=$DIR cannot be created"
HOST1="$(hostname)"
HOST2="${HOST1}-n2"
HOSTS_LINE="127.0.0.1 $HOST2  # moe_lora_rl local_cluster $DIR"
export SLURM_CONF="$DIR/slurm.conf"

alive() {  # $1 pid, $2 program name: the pid is still that program (not a reused pid)
  [[ -r "/proc/$1/cmdline" ]] && tr '\0' ' ' < "/proc/$1/cmdline" | grep -q -- "$2"
}

remove_hosts_line() {
  [[ -f "$DIR/hosts_added" ]] || return 0
  if grep -qxF "$HOSTS_LINE" /etc/hosts; then
    # rewritten in place, not renamed: /etc/hosts is often a bind mount
    local kept; kept="$(grep -vxF "$HOSTS_LINE" /etc/hosts)"
    printf '%s\n' "$kept" > /etc/hosts
  fi
  rm -f "$DIR/hosts_added"
}

stop() {
  if [[ -f "$DIR/pids" ]] && alive "$(awk '$1 == "slurmctld" {print $2}' "$DIR/pids")" slurmctld; then
    local jobs; jobs="$(squeue -h -o %i 2>/dev/null || true)"
    if [[ -n "$jobs" ]]; then
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 30); do [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break; sleep 1; done
    fi
  fi
  if [[ -f "$DIR/pids" ]]; then
    local name pid
    # slurmd first, munged last (the others authenticate through it while they shut down)
    for want in slurmd slurmctld munged; do
      while read -r name pid; do
        [[ "$name" == "$want" ]] && alive "$pid" "$name" && kill -TERM "$pid" 2>/dev/null || true
      done < "$DIR/pids"
      while read -r name pid; do
        [[ "$name" == "$want" ]] || continue
        for _ in $(seq 100); do alive "$pid" "$name" || break; sleep 0.1; done
        alive "$pid" "$name" && kill -KILL "$pid" 2>/dev/null || true
      done < "$DIR/pids"
    done
    rm -f "$DIR/pids"
  fi
  remove_hosts_line
}

start_daemon() {  # $1 name for DIR/pids, $2 log file, the rest: the command (in the foreground of its own session)
  local name="$1" log="$2"; shift 2
  setsid "$@" > "$log" 2>&1 < /dev/null &
  echo "$name $!" >> "$DIR/pids"
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

write_config() {
  local gres_node="" gres_types=""
  if (( GPUS > 0 )); then
    gres_types="GresTypes=gpu"
    gres_node=" Gres=gpu:$GPUS"
    { echo "AutoDetect=off"
      for h in "$HOST1" "$HOST2"; do
        mkdir -p "$DIR/dev/$h"
        # slurm wants a character device per GPU: links to /dev/null stand for them
        for ((i = 0; i < GPUS; i++)); do ln -sfn /dev/null "$DIR/dev/$h/gpu$i"; done
        echo "NodeName=$h Name=gpu File=$DIR/dev/$h/gpu[0-$((GPUS - 1))]"
      done
    } > "$DIR/gres.conf"
  else
    rm -f "$DIR/gres.conf"
  fi
  mkdir -p "$DIR/state"
  cat > "$DIR/slurm.conf" <<EOF
# written by scripts/slurm/local_cluster.sh: two nodes on one host
ClusterName=moe-lora-rl-local
SlurmctldHost=$HOST1(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
MinJobAge=30
PlugStackConfig=$DIR/plugstack.conf
$gres_types
NodeName=$HOST1 NodeAddr=127.0.0.1 Port=$((PORT + 1)) CPUs=8 State=UNKNOWN$gres_node
NodeName=$HOST2 NodeAddr=127.0.0.1 Port=$((PORT + 2)) CPUs=8 State=UNKNOWN$gres_node
PartitionName=local Nodes=$HOST1,$HOST2 Default=YES MaxTime=INFINITE State=UP
EOF
  : > "$DIR/plugstack.conf"
  echo "export SLURM_CONF=$DIR/slurm.conf" > "$DIR/env"
}

start() {
  [[ "$(id -u)" == 0 ]] || die "start needs root (slurmd runs jobs as their users; /etc/hosts gets a line)"
  for c in munged mungekey slurmctld slurmd sinfo; do
    command -v "$c" >/dev/null || die "$c not found: install Debian's munge, slurmctld, slurmd and slurm-client (bash scripts/setup.sh --slurm)"
  done
  if [[ -f "$DIR/pids" ]]; then
    while read -r name pid; do
      alive "$pid" "$name" && die "a cluster is already running from $DIR ($name pid $pid): stop it first"
    done < "$DIR/pids"
    rm -f "$DIR/pids"
  fi
  for p in "$PORT" $((PORT + 1)) $((PORT + 2)); do port_free "$p" || die "port $p is in use (choose --port)"; done
  trap 'stop; exit 1' ERR
  rm -rf "$DIR/state" "$DIR"/spool-* "$DIR"/dev "$DIR"/*.log
  if ! getent hosts "$HOST2" >/dev/null; then
    echo "$HOSTS_LINE" >> /etc/hosts
    touch "$DIR/hosts_added"
  fi
  write_config
  [[ -f "$DIR/munge.key" ]] || mungekey --create --keyfile="$DIR/munge.key" --bits=1024 >/dev/null
  chmod 600 "$DIR/munge.key"
  start_daemon munged "$DIR/munged.out" munged -F --force --socket="$DIR/munge.socket" --key-file="$DIR/munge.key" \
    --log-file="$DIR/munged.log" --pid-file="$DIR/munged.pid" --seed-file="$DIR/munged.seed"
  for _ in $(seq 50); do [[ -S "$DIR/munge.socket" ]] && break; sleep 0.1; done
  [[ -S "$DIR/munge.socket" ]] || { tail -5 "$DIR/munged.out" "$DIR/munged.log" >&2 || true; false; }
  start_daemon slurmctld "$DIR/slurmctld.out" slurmctld -D -i -f "$DIR/slurm.conf"
  for h in "$HOST1" "$HOST2"; do
    start_daemon slurmd "$DIR/slurmd-$h.out" slurmd -D -N "$h" -f "$DIR/slurm.conf"
  done
  local states=""
  for _ in $(seq 120); do
    states="$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | tr '\n' ' ')"
    [[ "$states" == "$HOST1 idle $HOST2 idle " || "$states" == "$HOST2 idle $HOST1 idle " ]] && break
    sleep 0.5
  done
  if [[ "$states" != *"$HOST1 idle"* || "$states" != *"$HOST2 idle"* ]]; then
    tail -n 5 "$DIR"/*.log "$DIR"/*.out >&2 2>/dev/null || true
    echo "local_cluster.sh: error: the nodes did not become idle within 60 s (sinfo: ${states:-nothing})" >&2
    stop; exit 1
  fi
  trap - ERR
  echo "local_cluster.sh: nodes $HOST1, $HOST2 idle ($(( GPUS > 0 ? GPUS : 0 )) GPUs each); source $DIR/env"
}

case "$ACTION" in
  start) start ;;
  stop) stop; echo "local_cluster.sh: stopped ($DIR)" ;;
  -h|--help) sed -n '/^# A two-node/,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' ;;
  *) die "unknown action '$ACTION': choose start or stop (see --help)" ;;
esac
