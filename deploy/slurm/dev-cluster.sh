#!/usr/bin/env bash
# Bring up (or down) a real SLURM cluster of N nodes on this one machine, for
# developing and testing gptlaunch's SLURM scheduler: munged, a private MariaDB
# for accounting, slurmdbd, slurmctld and one `slurmd -N nK` per node, all
# under one state directory. See usage() and ../../../shared/ENGINEERING.md §4.
set -euo pipefail
# shellcheck source=../lib/podman.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/podman.sh"  # render_containers_conf, render_storage_conf
export PATH="$PATH:/usr/sbin:/sbin"  # the daemons live there; a non-login root shell may lack them

readonly PROG="dev-cluster"
readonly STATE="${GPTLAUNCH_SLURM_DIR:-/var/lib/gptlaunch-slurm}"
readonly CLUSTER="gptlaunch"
readonly MARKER="# written by gptlaunch deploy/slurm/dev-cluster.sh"
readonly HOSTS_MARKER="# gptlaunch-dev-cluster"
readonly SLURM_CONF="/etc/slurm/slurm.conf"
readonly LOCAL_MNT="$STATE/local"   # each node's "node-local disk", the same path on every node
readonly DBD_CONF="/etc/slurm/slurmdbd.conf"
# Ports stay below 15000: SLURM jobs derive their rendezvous port from 15000-29999.
readonly DB_PORT=13306
readonly DBD_PORT=6819
readonly CTLD_PORT=6817
readonly NODE_PORT_BASE=7000    # node nK listens on 7000+K
readonly TIMEOUT=60             # seconds any single daemon may take to come up
readonly STOP_TIMEOUT=30        # seconds a daemon may take to exit on SIGTERM
# A requeued batch job gets BeginTime = now + job credential lifetime + 1
# (AuthInfo cred_expire, default 120 s), then waits for the next main scheduling
# pass (sched_interval, default 60 s): measured here ~174 s from `scontrol
# requeue` to RUNNING. 10 s and 5 s bring that to ~11-16 s; 10 s is still ample
# for a step launch on one machine (the credential only has to reach slurmd).
readonly CRED_EXPIRE=10
readonly SCHED_INTERVAL=5
readonly PACKAGES="slurm-wlm slurm-client munge mariadb-server slurmdbd podman runc"  # podman: `--image` jobs

readonly MUNGE_DIR="$STATE/munge"       # owned by munge: munged's pid and log
readonly DB_RUN="$STATE/mariadb"        # owned by mysql: socket and pid file
readonly DB_DATA="$STATE/mysql"
readonly DB_SOCK="$DB_RUN/mysqld.sock"
readonly DB_PID="$DB_RUN/mariadbd.pid"
readonly MUNGE_PID="$MUNGE_DIR/munged.pid"

HOST="$(hostname -s)"   # SlurmctldHost must be the short name slurmctld sees
readonly HOST

log() { echo "$PROG: $*" >&2; }
die() { echo "$PROG: error: $*" >&2; exit 1; }

usage() {
    cat <<EOF
Usage: $0 up [--nodes N] | down | status | --help

  up [--nodes N]  start (or reconfigure to) a SLURM cluster of N nodes (1..4,
                  default 2) on this machine: munged, MariaDB, slurmdbd,
                  slurmctld, slurmd n1..nN. Idempotent. Needs root.
  down            cancel all jobs and stop every daemon 'up' started; remove
                  the /etc/hosts lines and the slurm configs it wrote.
  status          print each daemon's state and sinfo; exit 0 iff all are up
                  and all N nodes are idle/allocated/mixed.

On node nK (its slurmd, and so its jobs' processes), $LOCAL_MNT is a private
bind mount of $STATE/node-local/nK: a node-local disk, which neither this
machine nor the other nodes see. Everything else is shared, as on a cluster.

State (database, logs *.log, pid files, spool dirs) lives in
\$GPTLAUNCH_SLURM_DIR (default /var/lib/gptlaunch-slurm). Configs are written to
$SLURM_CONF and $DBD_CONF so sbatch/srun/sacct find them without SLURM_CONF.
EOF
}

# ---------------------------------------------------------------- processes --

# pid_of PIDFILE: the pid it holds, or nothing (a daemon may remove its pid
# file while we look, hence the silenced read).
pid_of() { tr -dc '0-9' 2>/dev/null <"$1" || true; }

# proc_alive PID COMM: true if PID is a live (non-zombie) process named COMM.
# Checking the name guards against a reused pid; the zombie check matters
# because an exited daemon keeps its /proc entry until pid 1 gets round to
# reaping it (here that can take a while).
proc_alive() {
    local pid=$1 comm=$2
    [[ -n $pid && -d /proc/$pid ]] || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$comm" ]] || return 1
    [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]]
}

# pid_alive PIDFILE COMM: the daemon named by PIDFILE is running.
pid_alive() { proc_alive "$(pid_of "$1")" "$2"; }

# stop_pidfile PIDFILE COMM: SIGTERM the daemon, SIGKILL it if it outlives
# STOP_TIMEOUT, then remove the pid file so a later start is not confused.
stop_pidfile() {
    local pidfile=$1 comm=$2 pid i
    pid=$(pid_of "$pidfile")
    if proc_alive "$pid" "$comm"; then
        log "stopping $comm (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < STOP_TIMEOUT * 5; i++)); do
            proc_alive "$pid" "$comm" || break
            sleep 0.2
        done
        if proc_alive "$pid" "$comm"; then
            log "$comm (pid $pid) ignored SIGTERM for ${STOP_TIMEOUT}s; killing it"
            kill -KILL "$pid" 2>/dev/null || true
            sleep 0.5
        fi
    fi
    rm -f "$pidfile"
}

# Size of each log when we last started its daemon: wait_until only looks for
# a fatal message written after that, so old runs' failures do not count.
declare -A LOG_MARK=()
# Log lines meaning "this daemon will not come up" (slurmd exits on a busy port).
readonly FATAL_RE='fatal:|\[ERROR\] Aborting|Unable to bind listen port'
log_size() { stat -c %s "$1" 2>/dev/null || echo 0; }

# wait_until DESC LOGFILE CMD...: poll CMD until it succeeds; fail with a message
# naming the daemon and its log after TIMEOUT seconds (never wait forever), or
# at once if the daemon logged a fatal error since we started it.
wait_until() {
    local desc=$1 logfile=$2 deadline mark
    shift 2
    mark=${LOG_MARK[$logfile]:-$(log_size "$logfile")}
    deadline=$((SECONDS + TIMEOUT))
    until "$@" >/dev/null 2>&1; do
        if tail -c +$((mark + 1)) "$logfile" 2>/dev/null | grep -qE "$FATAL_RE"; then
            tail -c +$((mark + 1)) "$logfile" | tail -n 15 >&2
            die "$desc failed to start; see $logfile"
        fi
        if ((SECONDS >= deadline)); then
            [[ -f $logfile ]] && tail -n 15 "$logfile" >&2
            die "$desc did not come up within ${TIMEOUT}s; see $logfile"
        fi
        sleep 0.5
    done
}

# close_fds: close every fd above 2 in this (sub)shell. Daemons must not inherit
# our lock (fd 9: they would hold it for life) nor a caller's pipes (a caller
# reading one to EOF would hang until the daemon exits).
close_fds() {
    local fd
    for fd in /proc/self/fd/*; do
        fd=${fd##*/}
        if ((fd > 2)); then eval "exec ${fd}>&-"; fi
    done
    return 0
}

# spawn LOGFILE CMD...: start a daemon in its own session with stdio detached,
# so that it neither dies with our terminal nor holds a caller's pipe open.
spawn() {
    local logfile=$1
    shift
    LOG_MARK[$logfile]=$(log_size "$logfile")
    (close_fds; exec setsid "$@" </dev/null >>"$logfile" 2>&1) &
}

# -------------------------------------------------------------- preflight --

ensure_packages() {
    local missing=0 b
    for b in slurmctld slurmd slurmdbd munged mariadbd mariadb-install-db sacctmgr podman runc; do
        command -v "$b" >/dev/null 2>&1 || [[ -x /usr/sbin/$b ]] || missing=1
    done
    ((missing)) || return 0
    ((EUID == 0)) || die "SLURM daemons are not installed; as root run: apt-get install -y $PACKAGES"
    log "installing $PACKAGES"
    # shellcheck disable=SC2086  # PACKAGES is a word list on purpose
    DEBIAN_FRONTEND=noninteractive apt-get install -y $PACKAGES >&2 ||
        { DEBIAN_FRONTEND=noninteractive apt-get update >&2 &&
          DEBIAN_FRONTEND=noninteractive apt-get install -y $PACKAGES >&2; } ||
        die "apt-get install -y $PACKAGES failed"
}

need_root() {
    ((EUID == 0)) || die "'$1' must run as root (it writes /etc/slurm and /etc/hosts and starts daemons)"
}

# We own a config file only if it carries our marker; never clobber another's.
check_ours() {
    local f=$1
    if [[ -e $f ]] && ! grep -qxF "$MARKER" "$f"; then
        die "$f exists and was not written by this script (no '$MARKER' line); move it away first"
    fi
}

# ------------------------------------------------------------------ munge --

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

ensure_munge() {
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 "$MUNGE_DIR" /var/lib/munge /var/log/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        install -d -o munge -g munge -m 0700 /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    if pid_alive "$MUNGE_PID" munged || munge_works; then
        # Either ours from an earlier `up`, or a munged someone else runs (then
        # we use it but leave it alone on `down`: we have no pid file for it).
        munge_works || die "munged is running but 'munge -n | unmunge' fails; see $MUNGE_DIR/munged.log"
        return 0
    fi
    log "starting munged"
    rm -f "$MUNGE_PID" /run/munge/munge.socket.2.lock
    # munged refuses a log file it does not own ("Logfile is insecure").
    touch "$MUNGE_DIR/munged.log"
    chown munge:munge "$MUNGE_DIR/munged.log"
    chmod 0640 "$MUNGE_DIR/munged.log"
    # munged must run as the key's owner; it forks into the background itself.
    (close_fds; exec runuser -u munge -- munged --pid-file="$MUNGE_PID" \
        --log-file="$MUNGE_DIR/munged.log") </dev/null >>"$MUNGE_DIR/munged.log" 2>&1 ||
        die "munged failed to start; see $MUNGE_DIR/munged.log"
    wait_until "munged" "$MUNGE_DIR/munged.log" munge_works
}

# ---------------------------------------------------------------- mariadb --

db() { mariadb --no-defaults -S "$DB_SOCK" -u root "$@"; }

db_password() {
    # Generated once, kept private in the state dir, reused for every `up`.
    if [[ ! -s $STATE/db-password ]]; then
        (umask 077 && od -An -tx1 -N12 /dev/urandom | tr -d ' \n' >"$STATE/db-password")
    fi
    cat "$STATE/db-password"
}

ensure_mariadb() {
    install -d -o mysql -g mysql -m 0750 "$DB_RUN"
    if [[ ! -d $DB_DATA/mysql ]]; then
        log "initialising MariaDB datadir $DB_DATA"
        install -d -o mysql -g mysql -m 0750 "$DB_DATA"
        mariadb-install-db --no-defaults --datadir="$DB_DATA" --user=mysql \
            --auth-root-authentication-method=socket --skip-test-db \
            >>"$STATE/mariadb-install.log" 2>&1 ||
            die "mariadb-install-db failed; see $STATE/mariadb-install.log"
    fi
    if ! pid_alive "$DB_PID" mariadbd; then
        log "starting mariadbd on 127.0.0.1:$DB_PORT"
        rm -f "$DB_PID"
        touch "$STATE/mariadbd.log"
        chown mysql:mysql "$STATE/mariadbd.log"
        # --no-defaults: ignore /etc/mysql/*.cnf so a system MariaDB's settings
        # (port 3306, /run/mysqld) cannot collide with ours.
        spawn "$STATE/mariadbd.log" mariadbd --no-defaults --user=mysql \
            --datadir="$DB_DATA" --bind-address=127.0.0.1 --port="$DB_PORT" \
            --socket="$DB_SOCK" --pid-file="$DB_PID" --log-error="$STATE/mariadbd.log" \
            --skip-name-resolve --innodb-lock-wait-timeout=900 \
            --innodb-buffer-pool-size=512M   # slurmdbd warns below 512M
    fi
    wait_until "mariadbd" "$STATE/mariadbd.log" db -e 'SELECT 1'
    ensure_db_user
}

ensure_db_user() {
    local pw u
    pw=$(db_password)
    # Both host spellings: the socket matches 'localhost', TCP to 127.0.0.1
    # (what slurmdbd uses) matches '127.0.0.1' under --skip-name-resolve.
    for u in "'slurm'@'localhost'" "'slurm'@'127.0.0.1'"; do
        db -e "CREATE USER IF NOT EXISTS $u IDENTIFIED BY '$pw';
               ALTER USER $u IDENTIFIED BY '$pw';
               GRANT ALL ON slurm_acct_db.* TO $u;" ||
            die "could not create DB user $u; see $STATE/mariadbd.log"
    done
}

# ----------------------------------------------------------------- configs --

render_dbd_conf() {
    cat <<EOF
$MARKER
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(db_password)
StorageLoc=slurm_acct_db
EOF
}

# EnforcePartLimits=ALL: sbatch refuses a job no partition can ever run (too many nodes), as production
# clusters do, rather than queueing it forever.
render_slurm_conf() {
    local n=$1 k
    cat <<EOF
$MARKER
ClusterName=$CLUSTER
SlurmctldHost=$HOST
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=$CRED_EXPIRE
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
EnforcePartLimits=ALL
MpiDefault=none
MailProg=/bin/true
SchedulerParameters=sched_interval=$SCHED_INTERVAL
SwitchType=switch/none
ReturnToService=2
JobRequeue=1
KillWait=30
StateSaveLocation=$STATE/slurmctld
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdSpoolDir=$STATE/slurmd-%n
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmdLogFile=$STATE/slurmd-%n.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
TaskProlog=$STATE/task-prolog.sh
EOF
    for ((k = 1; k <= n; k++)); do
        echo "NodeName=n$k NodeHostname=$HOST Port=$((NODE_PORT_BASE + k)) CPUs=1 RealMemory=4000 State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=n[1-$n] Default=YES MaxTime=INFINITE State=UP"
}

# podman on the nodes (the container runtime of `launcher submit --image ... --container-runtime
# podman`), set up as a site would: a TaskProlog exports the settings into every task. Each node keeps
# its images on its own "disk" ($STATE/node-nK/containers), so that each node really pulls. runc, the
# limits and no systemd: as for the SSH test hosts (deploy/lib/podman.sh).
render_task_prolog() {
    cat <<EOF
#!/bin/sh
$MARKER
echo "export CONTAINERS_CONF=$STATE/containers.conf"
echo "export CONTAINERS_STORAGE_CONF=$STATE/storage-\$SLURMD_NODENAME.conf"
EOF
}

# write_if_changed FILE MODE CONTENT: returns 0 if it (re)wrote FILE, 1 if the
# content was already there (lets `up` skip restarts when nothing changed).
write_if_changed() {
    local f=$1 mode=$2 content=$3 tmp
    if [[ -f $f ]] && [[ "$(cat "$f")" == "$content" ]]; then
        return 1
    fi
    install -d -m 0755 "$(dirname "$f")"
    tmp=$(mktemp "$f.XXXXXX")
    printf '%s\n' "$content" >"$tmp"
    chmod "$mode" "$tmp"
    chown root:root "$tmp"   # slurmdbd insists its conf is owned by SlurmUser
    mv -f "$tmp" "$f"
    log "wrote $f"
}

# /etc/hosts: n1..nN must resolve (torchrun's c10d rendezvous uses the first
# node's name). Rewritten in place (cat >) rather than renamed, because
# /etc/hosts is a bind mount in some containers.
set_hosts() {
    local line=$1 tmp
    tmp=$(mktemp)
    grep -vF "$HOSTS_MARKER" /etc/hosts >"$tmp" || true
    [[ -n $line ]] && echo "$line" >>"$tmp"
    if ! cmp -s "$tmp" /etc/hosts; then
        cat "$tmp" >/etc/hosts
        log "updated /etc/hosts"
    fi
    rm -f "$tmp"
}

hosts_line() {
    local n=$1 k names=""
    for ((k = 1; k <= n; k++)); do names+=" n$k"; done
    echo "127.0.0.1$names $HOSTS_MARKER"
}

# ------------------------------------------------------------------- slurm --

dbd_answers() { timeout 10 sacctmgr -n show cluster; }
ctld_answers() { timeout 10 scontrol ping | grep -q 'is UP'; }

ensure_slurmdbd() {
    if ! pid_alive "$STATE/slurmdbd.pid" slurmdbd; then
        log "starting slurmdbd on port $DBD_PORT"
        rm -f "$STATE/slurmdbd.pid"
        spawn "$STATE/slurmdbd.log" slurmdbd   # daemonizes; reads $DBD_CONF
    fi
    wait_until "slurmdbd" "$STATE/slurmdbd.log" dbd_answers
}

ensure_cluster_registered() {
    if timeout 10 sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER"; then
        return 0
    fi
    log "registering cluster $CLUSTER in accounting"
    timeout 20 sacctmgr -i add cluster "$CLUSTER" >&2 ||
        timeout 10 sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER" ||
        die "sacctmgr add cluster $CLUSTER failed; see $STATE/slurmdbd.log"
}

ensure_slurmctld() {
    install -d -m 0755 "$STATE/slurmctld"
    if ! pid_alive "$STATE/slurmctld.pid" slurmctld; then
        log "starting slurmctld on $HOST:$CTLD_PORT"
        rm -f "$STATE/slurmctld.pid"
        spawn "$STATE/slurmctld.log" slurmctld   # daemonizes; keeps saved jobs
    fi
    wait_until "slurmctld" "$STATE/slurmctld.log" ctld_answers
}

ensure_slurmd() {
    local k=$1
    install -d -m 0755 "$STATE/slurmd-n$k"
    pid_alive "$STATE/slurmd-n$k.pid" slurmd && return 0
    log "starting slurmd -N n$k (port $((NODE_PORT_BASE + k)))"
    rm -f "$STATE/slurmd-n$k.pid"
    install -d -m 0755 "$LOCAL_MNT" "$STATE/node-local/n$k"
    # A private mount namespace (propagation slave: the node still sees mounts made
    # later on the machine, its own stay private) in which $LOCAL_MNT is the
    # node's own disk; slurmd's steps inherit it.
    spawn "$STATE/slurmd-n$k.log" unshare --mount --propagation slave \
        sh -c 'mount --bind "$1" "$2" && exec slurmd -N "$3"' sh "$STATE/node-local/n$k" "$LOCAL_MNT" "n$k"
    wait_until "slurmd n$k" "$STATE/slurmd-n$k.log" pid_alive "$STATE/slurmd-n$k.pid" slurmd
}

stop_slurmds() {
    local f
    for f in "$STATE"/slurmd-n*.pid; do
        [[ -e $f ]] && stop_pidfile "$f" slurmd
    done
    return 0
}

# node_states: "nK state" per node, from the controller.
node_states() { timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null | sort -u; }

# healthy_nodes N [resume]: print how many nodes are idle/allocated/mixed (or
# completing/planned, both transient); true iff all N are. With "resume" (only
# from `up`; `status` must not change anything), drained/down nodes are resumed
# on the way: a previous run may have left them so (e.g. a slurmd killed under
# a job), and ReturnToService=2 does not undo a drain.
healthy_nodes() {
    local n=$1 resume=${2:-} name st good=0
    while read -r name st; do
        [[ -n $name ]] || continue
        case $st in
            idle | alloc | mix | comp | plnd) good=$((good + 1)) ;;
            drain* | drng* | down* | fail*)
                if [[ $resume == resume ]]; then
                    timeout 10 scontrol update nodename="$name" state=resume >/dev/null 2>&1 || true
                fi ;;
        esac
    done < <(node_states)
    echo "$good"
    [[ $good -eq $n ]]
}

wait_nodes() {
    local n=$1 deadline
    deadline=$((SECONDS + TIMEOUT))
    until healthy_nodes "$n" resume >/dev/null; do
        if ((SECONDS >= deadline)); then
            node_states >&2 || true
            die "not all $n slurmd nodes became idle within ${TIMEOUT}s; see $STATE/slurmd-n*.log and $STATE/slurmctld.log"
        fi
        sleep 0.5
    done
}

# --------------------------------------------------------------- commands --

cmd_up() {
    local n=$1 k dbd_conf slurm_conf
    ensure_packages
    need_root up
    check_ours "$SLURM_CONF"
    check_ours "$DBD_CONF"
    install -d -m 0755 "$STATE"
    exec 9>"$STATE/.lock"
    flock -w "$TIMEOUT" 9 || die "another dev-cluster.sh holds $STATE/.lock"
    log "bringing up a $n-node cluster (state in $STATE)"
    getent hosts "$HOST" >/dev/null ||
        die "this machine's hostname '$HOST' does not resolve; add it to /etc/hosts"

    ensure_munge
    ensure_mariadb

    dbd_conf=$(render_dbd_conf)
    slurm_conf=$(render_slurm_conf "$n")
    if ! [[ -f $SLURM_CONF && "$(cat "$SLURM_CONF")" == "$slurm_conf" ]]; then
        # Adding or removing nodes needs a slurmctld restart in 22.05, and the
        # slurmd's must re-register; running jobs survive both restarts.
        if pid_alive "$STATE/slurmctld.pid" slurmctld || compgen -G "$STATE/slurmd-n*.pid" >/dev/null; then
            log "configuration changed: restarting slurmctld and slurmd's"
        fi
        stop_slurmds
        stop_pidfile "$STATE/slurmctld.pid" slurmctld
    fi
    if write_if_changed "$DBD_CONF" 0600 "$dbd_conf"; then
        stop_pidfile "$STATE/slurmdbd.pid" slurmdbd
    fi
    write_if_changed "$SLURM_CONF" 0644 "$slurm_conf" || true
    write_if_changed "$STATE/task-prolog.sh" 0755 "$(render_task_prolog)" || true
    write_if_changed "$STATE/containers.conf" 0644 "$(render_containers_conf "$MARKER")" || true
    for ((k = 1; k <= n; k++)); do
        write_if_changed "$STATE/storage-n$k.conf" 0644 \
            "$(render_storage_conf "$MARKER" "$STATE/node-n$k/containers" "n$k")" || true
    done
    echo "$n" >"$STATE/nodes"

    ensure_slurmdbd
    ensure_cluster_registered
    set_hosts "$(hosts_line "$n")"
    ensure_slurmctld
    for ((k = 1; k <= n; k++)); do ensure_slurmd "$k"; done
    wait_nodes "$n"
    cmd_status
}

cmd_down() {
    local f ours=1
    need_root down
    # A config that is not ours means another cluster: leave it (and its jobs)
    # alone, but still stop the daemons our pid files name.
    for f in "$SLURM_CONF" "$DBD_CONF"; do
        if [[ -e $f ]] && ! grep -qxF "$MARKER" "$f"; then
            log "warning: $f was not written by this script; leaving it in place"
            ours=0
        fi
    done
    if [[ -d $STATE ]]; then
        exec 9>"$STATE/.lock"
        flock -w "$TIMEOUT" 9 || die "another dev-cluster.sh holds $STATE/.lock"
    fi
    if ((ours)) && [[ -f $SLURM_CONF ]] && pid_alive "$STATE/slurmctld.pid" slurmctld; then
        cancel_jobs
    fi
    stop_slurmds
    stop_pidfile "$STATE/slurmctld.pid" slurmctld
    stop_pidfile "$STATE/slurmdbd.pid" slurmdbd
    stop_pidfile "$DB_PID" mariadbd
    stop_pidfile "$MUNGE_PID" munged   # only if we started it (our pid file)
    set_hosts ""
    for f in "$SLURM_CONF" "$DBD_CONF"; do
        if [[ -f $f ]] && grep -qxF "$MARKER" "$f"; then
            rm -f "$f"
            log "removed $f"
        fi
    done
    log "down"
}

# Cancel every job (--full also signals the batch shell's children) and wait,
# bounded, for them to leave the queue so no slurmstepd outlives its slurmd.
cancel_jobs() {
    local ids deadline
    ids=$(timeout 10 squeue -h -o '%A' 2>/dev/null | tr '\n' ' ') || true
    [[ -n ${ids// /} ]] || return 0
    log "cancelling jobs: $ids"
    # shellcheck disable=SC2086  # ids is a word list
    timeout 10 scancel --full $ids 2>/dev/null || timeout 10 scancel $ids 2>/dev/null || true
    deadline=$((SECONDS + TIMEOUT))
    while [[ -n "$(timeout 10 squeue -h -o '%A' 2>/dev/null)" ]] && ((SECONDS < deadline)); do
        sleep 0.5
    done
}

# One line per daemon; returns non-zero if any is not running.
daemon_status() {
    local n=$1 rc=0 k
    report() {
        if pid_alive "$1" "$2"; then
            printf '%-12s running (pid %s)\n' "$3" "$(pid_of "$1")"
        else
            printf '%-12s NOT running (log: %s)\n' "$3" "$4"
            rc=1
        fi
    }
    if pid_alive "$MUNGE_PID" munged; then
        report "$MUNGE_PID" munged munged "$MUNGE_DIR/munged.log"
    elif munge_works; then
        printf '%-12s running (not started by this script)\n' munged
    else
        printf '%-12s NOT running (log: %s)\n' munged "$MUNGE_DIR/munged.log"
        rc=1
    fi
    report "$DB_PID" mariadbd mariadbd "$STATE/mariadbd.log"
    report "$STATE/slurmdbd.pid" slurmdbd slurmdbd "$STATE/slurmdbd.log"
    report "$STATE/slurmctld.pid" slurmctld slurmctld "$STATE/slurmctld.log"
    for ((k = 1; k <= n; k++)); do
        report "$STATE/slurmd-n$k.pid" slurmd "slurmd n$k" "$STATE/slurmd-n$k.log"
    done
    return "$rc"
}

cmd_status() {
    local n rc=0 good
    if [[ ! -s $STATE/nodes ]]; then
        echo "no cluster has been brought up (no $STATE/nodes)"
        return 1
    fi
    n=$(cat "$STATE/nodes")
    daemon_status "$n" || rc=1
    if [[ -f $SLURM_CONF ]] && timeout 10 sinfo; then
        good=$(healthy_nodes "$n") || true
        echo "healthy nodes: ${good:-0}/$n"
        [[ ${good:-0} -eq $n ]] || rc=1
    else
        echo "sinfo: controller not reachable"
        rc=1
    fi
    return "$rc"
}

main() {
    local cmd=${1:-} nodes=2
    [[ -n $cmd ]] || { usage >&2; exit 2; }
    shift
    case $cmd in
        -h | --help | help) usage; exit 0 ;;
    esac
    while (($#)); do
        case $1 in
            --nodes) [[ $# -ge 2 ]] || die "--nodes needs a value"; nodes=$2; shift 2 ;;
            --nodes=*) nodes=${1#--nodes=}; shift ;;
            -h | --help) usage; exit 0 ;;
            *) usage >&2; die "unknown argument: $1" ;;
        esac
    done
    [[ $nodes =~ ^[1-4]$ ]] || die "--nodes must be 1..4, got '$nodes'"
    case $cmd in
        up) cmd_up "$nodes" ;;
        down) cmd_down ;;
        status) cmd_status ;;
        *) usage >&2; die "unknown command: $cmd" ;;
    esac
}

main "$@"
