#!/usr/bin/env bash
# A real 4-node SLURM cluster on this one machine, for the project's tier-4 tests and for trying
# job scripts by hand. Debian's slurm-wlm runs one slurmctld, four slurmd (node1..node4, all on
# 127.0.0.1), slurmdbd with MariaDB (so sacct reports real job states) and munged.
#
# Usage: bash scripts/slurm_cluster.sh up|down|status|reset
#   up      install missing packages (root + apt), start every daemon, wait until 4 nodes are idle.
#           Idempotent: returns within a second when the cluster is already healthy.
#   down    cancel all jobs, stop every daemon by its pid; keeps state (job ids, accounting).
#   status  exit 0 and print the nodes when the cluster is healthy, exit 1 otherwise.
#   reset   down, then delete the state directory.
#
# Everything lives under one state directory: $DYNMO_SLURM_DIR, default <repo>/.slurm (gitignored).
# Clients find the cluster with `source $DIR/env.sh` (exports SLURM_CONF).
#
# Why a private mount namespace: node names node1..node4 must resolve inside jobs (Open MPI,
# MASTER_ADDR=node1), but the host's /etc/hosts is not ours to change. The daemons run inside
# `unshare --mount` with a private hosts file bind-mounted over /etc/hosts, and every job step
# inherits it. Where unshare is not permitted (some containers) we fall back to a marked block in
# /etc/hosts that `down` removes again. Set DYNMO_SLURM_HOSTS=unshare|etc-hosts to force one.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=$(realpath -m "${DYNMO_SLURM_DIR:-$REPO/.slurm}") # daemons chdir to /: keep it absolute
# Unix socket paths are limited to 108 bytes, and slurmd's PMIx sockets add about 40 to its spool
# path. Under a long state directory (say, a deep CI checkout) the socket-bearing directories
# (munge/, run/, spool/) therefore live in a short one named after it; else everything is in $DIR.
if [ ${#DIR} -le 60 ]; then
  RT=$DIR
else
  RT=/tmp/dynmo-slurm-$(printf %s "$DIR" | md5sum | cut -c1-8)
fi
NUM_NODES=4
CPUS_PER_NODE=2
REAL_MEMORY_MB=4000
CLUSTER_NAME=dynmo
CTLD_PORT=6817
SLURMD_PORT0=17000 # node i listens on SLURMD_PORT0 + i
DBD_PORT=16819
DB_PORT=13306
READY_TIMEOUT_S=${DYNMO_SLURM_READY_TIMEOUT_S:-60}
PACKAGES=(slurm-wlm munge slurmdbd mariadb-server openmpi-bin libopenmpi-dev libpmix2)
HOSTS_MARK="dynmo_hpc slurm test cluster"

CONF=$DIR/etc/slurm.conf
MUNGE_SOCKET=$RT/munge/munge.socket.2
T0_US=${DYNMO_SLURM_T0_US:-${EPOCHREALTIME/./}}
export DYNMO_SLURM_T0_US=$T0_US # the namespaced child keeps counting from our start

log() {
  local dt_ds=$(((${EPOCHREALTIME/./} - T0_US) / 100000))
  printf '[slurm_cluster %d.%ds] %s\n' $((dt_ds / 10)) $((dt_ds % 10)) "$*" >&2
}
die() {
  printf 'slurm_cluster: ERROR: %s\n' "$1" >&2
  [ -n "${2:-}" ] && printf 'HINT: %s\n' "$2" >&2
  exit 1
}

node_names() { seq -f "node%g" 1 "$NUM_NODES"; }

# ---------------------------------------------------------------------------------------------
# pids: every daemon writes a pid file under $RT/run; a pid counts only if /proc says it is that
# daemon (pid files survive a reboot, pids get reused).
pid_alive() { # pidfile expected-comm-prefix
  local pid
  [ -s "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && proc_running "$pid" || return 1
  [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$2"* ]]
}

daemon_pidfiles() { # lines of "pidfile comm"
  echo "$RT/run/munged.pid munged"
  echo "$RT/run/mariadb.pid mariadbd"
  echo "$RT/run/slurmdbd.pid slurmdbd"
  echo "$RT/run/slurmctld.pid slurmctld"
  local n
  for n in $(node_names); do echo "$RT/run/slurmd-$n.pid slurmd"; done
}

all_daemons_alive() {
  local f c
  while read -r f c; do pid_alive "$f" "$c" || return 1; done < <(daemon_pidfiles)
}

# Clients run from anywhere, so they must be told where the cluster is.
export SLURM_CONF=$CONF

ctld_up() { timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP'; }

# Nodes that answer and can take work (idle, mixed, allocated, completing).
num_nodes_usable() {
  timeout 5 sinfo -h -N -r -o '%N %T' 2>/dev/null | sort -u |
    grep -cE ' (idle|mixed|allocated|completing)$' || true
}

num_nodes_idle() {
  timeout 5 sinfo -h -N -r -t idle -o '%N' 2>/dev/null | sort -u | grep -c . || true
}

healthy() {
  [ -f "$CONF" ] && command -v scontrol >/dev/null && all_daemons_alive && ctld_up &&
    [ "$(num_nodes_usable)" -eq "$NUM_NODES" ]
}

# ---------------------------------------------------------------------------------------------
install_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "packages missing: ${missing[*]}; installing them needs root" \
    "run as root, or: sudo apt-get install --no-install-recommends ${missing[*]}"
  command -v apt-get >/dev/null || die "packages missing (${missing[*]}) and no apt-get" \
    "this script supports Debian/Ubuntu; install Slurm 22.05+, munge, slurmdbd and MariaDB by hand"
  log "installing ${missing[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  local apt_opts=(-y -q --no-install-recommends -o DPkg::Lock::Timeout=300)
  apt-get -q -o DPkg::Lock::Timeout=300 update >"$DIR/log/apt.log" 2>&1 ||
    die "apt-get update failed (see $DIR/log/apt.log)" "check the network access to Debian's mirrors"
  apt-get install "${apt_opts[@]}" "${PACKAGES[@]}" >>"$DIR/log/apt.log" 2>&1 ||
    die "apt-get install failed (see $DIR/log/apt.log)" "run: tail -50 $DIR/log/apt.log"
  log "packages installed"
}

# ---------------------------------------------------------------------------------------------
write_configs() {
  mkdir -p "$DIR"/{etc,log,state,mysql} "$RT"/{run,munge,spool}
  local n
  for n in $(node_names); do mkdir -p "$RT/spool/$n/tmp"; done

  cat >"$CONF" <<EOF
# Generated by scripts/slurm_cluster.sh; edits are overwritten by the next 'up'.
ClusterName=$CLUSTER_NAME
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire: how long a job credential lives, and so how long slurmctld holds a requeued job
# before it may start again (default 120 s; a sooner start is refused as "credential revoked").
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
CredType=cred/munge
MailProg=/bin/true
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$RT/spool/%n
# PMIx (srun --mpi=pmix) needs a per-node tmp dir when several slurmd share one host.
TmpFS=$RT/spool/%n/tmp
SlurmctldPidFile=$RT/run/slurmctld.pid
SlurmdPidFile=$RT/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
# No systemd and no cgroups here.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Nodes may declare more CPUs than the host has.
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
KillWait=5
# Finished jobs stay in squeue/scontrol for 5 minutes.
MinJobAge=300
InactiveLimit=0
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$MUNGE_SOCKET
NodeName=node[1-$NUM_NODES] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$((SLURMD_PORT0 + 1))-$((SLURMD_PORT0 + NUM_NODES))] CPUs=$CPUS_PER_NODE RealMemory=$REAL_MEMORY_MB State=UNKNOWN
PartitionName=shared Nodes=ALL Default=YES MaxTime=INFINITE State=UP
PartitionName=exclusive Nodes=ALL OverSubscribe=EXCLUSIVE MaxTime=INFINITE State=UP
EOF

  # slurmdbd finds its config next to SLURM_CONF; it refuses a readable one.
  cat >"$DIR/etc/slurmdbd.conf" <<EOF
# Generated by scripts/slurm_cluster.sh.
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$RT/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$DIR/etc/slurmdbd.conf"

  # Jobs resolve node names through this file (see the header).
  {
    cat /etc/hosts
    echo "# $HOSTS_MARK"
    echo "127.0.0.1 $(node_names | tr '\n' ' ')"
  } >"$DIR/etc/hosts"

  cat >"$DIR/env.sh" <<EOF
# Source this to talk to the dynmo_hpc test cluster (written by scripts/slurm_cluster.sh).
export SLURM_CONF=$CONF
export DYNMO_SLURM_DIR=$DIR
EOF
}

# ---------------------------------------------------------------------------------------------
wait_for() { # timeout_s description command...
  local deadline=$(($(date +%s) + $1)) what=$2
  shift 2
  until "$@"; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.2
  done
  log "$what"
}

mysql_q() { mariadb --no-defaults -uroot --socket="$RT/run/mysqld.sock" -e "$1" >/dev/null 2>&1; }
dbd_answers() { timeout 5 sacctmgr -n -P show cluster format=cluster >/dev/null 2>&1; }
ctld_idle_nodes_ready() { ctld_up && [ "$(num_nodes_idle)" -eq "$NUM_NODES" ]; }
fail_log() { die "$1 (log: $2)" "tail -30 $2; stop everything with: bash $0 down"; }

# Runs inside the private mount namespace (or with the /etc/hosts block in place). Every daemon
# gets its stdio redirected so that a caller capturing our output is not held open by it.
start_daemons() {
  if [ "${1:-}" = "--bind-hosts" ]; then
    mount --bind "$DIR/etc/hosts" /etc/hosts
  fi

  if ! pid_alive "$RT/run/munged.pid" munged; then
    [ -s "$RT/munge/munge.key" ] || mungekey -c -k "$RT/munge/munge.key" >/dev/null
    chmod 600 "$RT/munge/munge.key"
    chmod 755 "$RT/munge" # the socket's directory must be world-executable
    munged --key-file="$RT/munge/munge.key" --socket="$MUNGE_SOCKET" \
      --pid-file="$RT/run/munged.pid" --log-file="$DIR/log/munged.log" \
      --seed-file="$RT/munge/munge.seed" --force </dev/null >>"$DIR/log/munged.log" 2>&1 ||
      fail_log "munged did not start" "$DIR/log/munged.log"
    log "munged started"
  fi

  if ! pid_alive "$RT/run/mariadb.pid" mariadbd; then
    if [ ! -d "$DIR/mysql/mysql" ]; then
      mariadb-install-db --no-defaults --datadir="$DIR/mysql" --user=root \
        --auth-root-authentication-method=normal --skip-test-db \
        >"$DIR/log/mariadb-install.log" 2>&1 ||
        fail_log "mariadb-install-db failed" "$DIR/log/mariadb-install.log"
    fi
    setsid mariadbd --no-defaults --datadir="$DIR/mysql" --user=root \
      --socket="$RT/run/mysqld.sock" --port=$DB_PORT --bind-address=127.0.0.1 \
      --pid-file="$RT/run/mariadb.pid" --log-error="$DIR/log/mariadb.log" \
      --skip-name-resolve --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 \
      </dev/null >>"$DIR/log/mariadb.log" 2>&1 &
    wait_for 60 "mariadb up" mysql_q "SELECT 1" ||
      fail_log "MariaDB did not answer within 60 s" "$DIR/log/mariadb.log"
    mysql_q "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
      CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
      CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
      GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
      GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" ||
      fail_log "could not create the accounting database" "$DIR/log/mariadb.log"
  fi

  if ! pid_alive "$RT/run/slurmdbd.pid" slurmdbd; then
    slurmdbd </dev/null >>"$DIR/log/slurmdbd.log" 2>&1 ||
      fail_log "slurmdbd did not start" "$DIR/log/slurmdbd.log"
    wait_for 60 "slurmdbd up" dbd_answers ||
      fail_log "slurmdbd did not answer within 60 s" "$DIR/log/slurmdbd.log"
    if ! sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER_NAME"; then
      sacctmgr -i add cluster "$CLUSTER_NAME" >/dev/null
    fi
  fi

  if ! pid_alive "$RT/run/slurmctld.pid" slurmctld; then
    slurmctld -f "$CONF" </dev/null >>"$DIR/log/slurmctld.log" 2>&1 ||
      fail_log "slurmctld did not start" "$DIR/log/slurmctld.log"
  fi
  local n
  for n in $(node_names); do
    if ! pid_alive "$RT/run/slurmd-$n.pid" slurmd; then
      slurmd -f "$CONF" -N "$n" </dev/null >>"$DIR/log/slurmd-$n.log" 2>&1 ||
        fail_log "slurmd $n did not start" "$DIR/log/slurmd-$n.log"
    fi
  done
  log "slurmctld and $NUM_NODES slurmd started"
}

# A port already listening means another cluster (say, another checkout's .slurm) is running;
# without this check the new daemons fail to bind and 'up' would only time out.
port_listening() {
  local hex
  hex=$(printf '%04X' "$1")
  cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | awk -v p=":$hex" '$2 ~ p"$" && $4 == "0A" {f=1} END {exit !f}'
}

check_ports_free() {
  local port busy=()
  for port in $CTLD_PORT $DBD_PORT $DB_PORT $(seq $((SLURMD_PORT0 + 1)) $((SLURMD_PORT0 + NUM_NODES))); do
    port_listening "$port" && busy+=("$port")
  done
  [ ${#busy[@]} -eq 0 ] || die "TCP port(s) ${busy[*]} already in use: another SLURM cluster or database is running" \
    "stop it first (for another checkout: DYNMO_SLURM_DIR=<its .slurm> bash $0 down)"
}

hosts_mode() {
  case "${DYNMO_SLURM_HOSTS:-auto}" in
    unshare | etc-hosts) echo "$DYNMO_SLURM_HOSTS" ;;
    auto) if unshare --mount true 2>/dev/null; then echo unshare; else echo etc-hosts; fi ;;
    *) die "DYNMO_SLURM_HOSTS=$DYNMO_SLURM_HOSTS" "use auto, unshare or etc-hosts" ;;
  esac
}

add_etc_hosts_block() {
  grep -q "$HOSTS_MARK" /etc/hosts && return 0
  printf '127.0.0.1 %s # %s\n' "$(node_names | tr '\n' ' ')" "$HOSTS_MARK" >>/etc/hosts
  log "added node names to /etc/hosts (removed again by 'down')"
}

remove_etc_hosts_block() {
  grep -q "$HOSTS_MARK" /etc/hosts 2>/dev/null || return 0
  # Rewrite in place (not sed -i): /etc/hosts may be a bind mount that cannot be replaced.
  local kept
  kept=$(grep -v "$HOSTS_MARK" /etc/hosts)
  printf '%s\n' "$kept" >/etc/hosts
}

cmd_up() {
  if healthy; then
    log "already up ($NUM_NODES nodes); source $DIR/env.sh"
    return 0
  fi
  [ "$(id -u)" -eq 0 ] || die "the test cluster runs its daemons as root" "run as root"
  mkdir -p "$DIR/log"
  exec 9>"$DIR/.lock"
  flock -w 300 9 || die "another 'up' or 'down' holds $DIR/.lock" "wait, or remove a stale lock"
  if healthy; then
    log "already up (started by a concurrent call)"
    return 0
  fi
  install_packages
  # A half-running cluster (a daemon died) is restarted whole: cheaper than diagnosing it.
  if [ -n "$(running_pids)" ]; then
    log "partially running; restarting"
    stop_daemons
  fi
  check_ports_free
  write_configs
  if [ "$(hosts_mode)" = unshare ]; then
    # setsid: the daemons must not die with the caller's process group or terminal.
    # 9>&-: daemons must not inherit the lock.
    setsid -w unshare --mount --propagation private \
      bash "$0" _start_daemons --bind-hosts </dev/null 9>&- || exit 1
  else
    add_etc_hosts_block
    start_daemons 9>&-
  fi
  wait_for "$READY_TIMEOUT_S" "ready: $NUM_NODES idle nodes" ctld_idle_nodes_ready || {
    sinfo -N 2>&1 | sed 's/^/  /' >&2 || true
    die "cluster not ready after ${READY_TIMEOUT_S}s: scontrol ping UP and $NUM_NODES idle nodes expected, found $(num_nodes_idle) idle" \
      "look at $DIR/log/slurmctld.log and $DIR/log/slurmd-node*.log; then: bash $0 down && bash $0 up"
  }
  log "up; source $DIR/env.sh"
}

running_pids() {
  local f c
  while read -r f c; do pid_alive "$f" "$c" && cat "$f"; done < <(daemon_pidfiles)
  true
}

# A zombie counts as gone: our daemons are reparented to an init that reaps them only slowly.
proc_running() {
  local _pid _comm state
  read -r _pid _comm state _ 2>/dev/null <"/proc/$1/stat" || return 1
  [ "$state" != Z ]
}

wait_pids_gone() { # timeout_s pids...
  local deadline=$(($(date +%s) + $1)) p alive
  shift
  while :; do
    alive=()
    for p in "$@"; do proc_running "$p" && alive+=("$p"); done
    [ ${#alive[@]} -eq 0 ] && return 0
    [ "$(date +%s)" -lt "$deadline" ] || break
    sleep 0.2
  done
  kill -KILL "${alive[@]}" 2>/dev/null || true
}

stop_daemons() {
  local pids
  if pid_alive "$RT/run/slurmctld.pid" slurmctld; then
    local ids deadline
    ids=$(timeout 5 squeue -h -o %i 2>/dev/null || true)
    if [ -n "$ids" ]; then
      # shellcheck disable=SC2086 # one argument per job id
      timeout 10 scancel --quiet --full $ids 2>/dev/null || true
      # Give the jobs' steps KillWait to end before their slurmd goes.
      deadline=$(($(date +%s) + 8))
      while [ -n "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && [ "$(date +%s)" -lt "$deadline" ]; do
        sleep 0.3
      done
      log "cancelled jobs: $(tr "\n" " " <<<"$ids")"
    fi
    timeout 10 scontrol shutdown >/dev/null 2>&1 || true
  fi
  # slurm daemons first, then the accounting chain, then munge (everyone authenticates with it).
  local f c group
  for group in 'slurmctld slurmd' slurmdbd mariadbd munged; do
    pids=()
    while read -r f c; do
      [[ " $group " == *" $c "* ]] && pid_alive "$f" "$c" && pids+=("$(cat "$f")")
    done < <(daemon_pidfiles)
    [ ${#pids[@]} -eq 0 ] && continue
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait_pids_gone 20 "${pids[@]}"
    log "stopped $group"
  done
  # Job steps that outlived their slurmd (killed hard) would keep ports and files busy.
  local comm
  for comm in /proc/[0-9]*/comm; do
    [ "$(cat "$comm" 2>/dev/null)" = slurmstepd ] || continue
    if tr '\0' '\n' <"${comm%/comm}/environ" 2>/dev/null | grep -qx "SLURM_CONF=$CONF"; then
      kill -KILL "$(basename "${comm%/comm}")" 2>/dev/null || true
    fi
  done
  rm -f "$RT"/run/*.pid
}

cmd_down() {
  [ -d "$DIR" ] || {
    log "nothing to stop ($DIR does not exist)"
    return 0
  }
  exec 9>"$DIR/.lock"
  flock -w 300 9 || die "another 'up' or 'down' holds $DIR/.lock" "wait, or remove a stale lock"
  if [ -z "$(running_pids)" ]; then
    remove_etc_hosts_block
    log "already down"
    return 0
  fi
  stop_daemons
  remove_etc_hosts_block
  log "down"
}

cmd_status() {
  if healthy; then
    echo "up: $DIR (source $DIR/env.sh)"
    sinfo
    return 0
  fi
  echo "down or unhealthy: $DIR"
  local f c
  while read -r f c; do
    if pid_alive "$f" "$c"; then echo "  running: $c ($(basename "$f"))"; else echo "  stopped: $c ($(basename "$f"))"; fi
  done < <(daemon_pidfiles)
  return 1
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  reset)
    cmd_down
    rm -rf "$DIR" "$RT"
    log "removed $DIR"
    ;;
  _start_daemons)
    shift
    start_daemons "$@"
    ;;
  *)
    echo "usage: $0 up|down|status|reset" >&2
    exit 2
    ;;
esac
