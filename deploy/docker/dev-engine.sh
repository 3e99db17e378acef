#!/usr/bin/env bash
# Start (or stop) a private Docker engine on this machine and make an offline CPU base image, for
# developing and testing gptlaunch's image build and compose scheduler where no Docker Desktop or
# system engine runs and no registry can be reached. See usage() and ../../../shared/ENGINEERING.md §4.
#
# The engine is Debian's dockerd with its own data root, exec root and socket (it leaves a system
# engine alone), the overlay2 storage driver where the data root takes an overlay mount (else vfs,
# which works on any file system but copies every layer whole), and no iptables rules or default bridge (user-defined networks still connect containers and resolve
# their names). The base image is Debian bookworm from debootstrap, with python3 and venv, imported
# with `docker import`: no registry needed.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"  # dockerd and debootstrap live there

readonly PROG="dev-engine"
STATE="$(realpath -m -- "${GPTLAUNCH_DOCKER_DIR:-/var/lib/gptlaunch-docker}")"
readonly STATE
readonly EXEC_ROOT="/run/gptlaunch-docker"   # short: containerd's socket paths must fit 108 bytes
readonly SOCK="$STATE/docker.sock"
readonly PID_FILE="$STATE/dockerd.pid"
readonly LOG="$STATE/dockerd.log"
readonly LOCK="/run/lock/gptlaunch-dev-engine.lock"
readonly BASE_IMAGE="${GPTLAUNCH_BASE_IMAGE:-gptlaunch/debian-base:bookworm}"
readonly SUITE="bookworm"
readonly TIMEOUT=60          # seconds dockerd may take to answer, and to exit on SIGTERM
readonly LOCK_WAIT=900       # seconds an 'up' waits for another (installing packages, debootstrap)

log() { echo "$PROG: $*" >&2; }
die() { echo "$PROG: error: $*" >&2; exit 1; }

usage() {
    cat <<EOF
Usage: $0 up | down [--purge] | status | --help

  up              install Debian's docker.io, docker-compose and debootstrap when missing, start a
                  private dockerd (socket $SOCK), and make the offline CPU base
                  image $BASE_IMAGE (debootstrap $SUITE + python3, venv,
                  ca-certificates; ~1 min the first time). Idempotent. The last two stdout lines are
                  the base image's name, then the DOCKER_HOST to use:
                      export DOCKER_HOST=\$($0 up | tail -n 1)
  down [--purge]  stop every container and the engine; --purge also deletes its images and state.
  status          print whether the engine answers and has the base image; exit 0 iff both.

Storage driver: overlay2 where the file system of the state directory takes an overlay mount, else
vfs (slow: every layer is a full copy); \$GPTLAUNCH_DOCKER_STORAGE=vfs|overlay2 forces one. Images
are kept per driver: after a switch the base image is made again.

State (images, logs, pid file) lives in \$GPTLAUNCH_DOCKER_DIR (default /var/lib/gptlaunch-docker);
\$GPTLAUNCH_BASE_IMAGE names the base image. Its Debian packages come from the mirror this
machine's apt uses, or from \$GPTLAUNCH_DEBIAN_MIRROR (a URL) when set. Needs root.
EOF
}

docker_() { DOCKER_HOST="unix://$SOCK" docker "$@"; }
engine_answers() { docker_ version --format '{{.Server.Version}}' >/dev/null 2>&1; }
# Whether pid file $1 names a live process called $2: after a reboot a pid file's pid may name another
# process, and dockerd (and its containerd) refuse to start while their pid file names a live one.
names() { [[ -s $1 && "$(cat "/proc/$(cat "$1")/comm" 2>/dev/null)" == "$2" ]]; }
engine_pid() { names "$PID_FILE" dockerd && cat "$PID_FILE"; }

lock() {
    exec 9>"$LOCK"
    flock -w "$LOCK_WAIT" 9 || die "another $PROG holds $LOCK (waited ${LOCK_WAIT}s)"
}

ensure_packages() {
    local missing=()
    command -v dockerd >/dev/null || missing+=(docker.io)
    command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || missing+=(docker-compose)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    ((${#missing[@]})) || return 0
    log "installing ${missing[*]} (apt-get)"
    local apt=(apt-get install -y -qq --no-install-recommends "${missing[@]}")
    # policy-rc.d 101 keeps the package's postinst from starting the system engine.
    local made_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 0755 /usr/sbin/policy-rc.d
        made_policy=1
    fi
    if ! DEBIAN_FRONTEND=noninteractive "${apt[@]}" >&2; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || log "apt-get update failed"
        DEBIAN_FRONTEND=noninteractive "${apt[@]}" >&2 || { ((made_policy)) && rm -f /usr/sbin/policy-rc.d; die "apt-get install ${missing[*]} failed"; }
    fi
    ((made_policy)) && rm -f /usr/sbin/policy-rc.d
    return 0
}

# overlay2 when this file system takes an overlay mount (ext4, xfs): layers are shared, a container
# starts in a moment. vfs otherwise (e.g. inside a container): each layer and container is a full copy
# of the image, minutes per build step for a torch image. $GPTLAUNCH_DOCKER_STORAGE overrides.
storage_driver() {
    if [[ -n ${GPTLAUNCH_DOCKER_STORAGE:-} ]]; then
        echo "$GPTLAUNCH_DOCKER_STORAGE"
        return
    fi
    local t driver=vfs
    t="$(mktemp -d "$STATE/overlay-test.XXXXXX")"
    mkdir "$t/lower" "$t/upper" "$t/work" "$t/merged"
    if mount -t overlay overlay -o "lowerdir=$t/lower,upperdir=$t/upper,workdir=$t/work" "$t/merged" 2>/dev/null; then
        umount "$t/merged"
        driver=overlay2
    fi
    rm -rf "$t"
    echo "$driver"
}

start_engine() {
    if engine_pid >/dev/null && engine_answers; then
        log "engine already up (pid $(engine_pid))"
        return
    fi
    # Left by an engine that is gone (a reboot keeps them here): their pids may name other processes.
    engine_pid >/dev/null || rm -f "$PID_FILE"
    names "$EXEC_ROOT/containerd/containerd.pid" containerd || rm -f "$EXEC_ROOT/containerd/containerd.pid"
    mkdir -p "$STATE/data" "$EXEC_ROOT"
    local driver
    driver="$(storage_driver)"
    log "starting dockerd, storage driver $driver (log $LOG)"
    # setsid + nohup: the engine outlives this script and the shell that ran it.
    setsid nohup dockerd \
        --host "unix://$SOCK" --data-root "$STATE/data" --exec-root "$EXEC_ROOT" --pidfile "$PID_FILE" \
        --storage-driver "$driver" --iptables=false --ip-masq=false --bridge=none \
        >>"$LOG" 2>&1 </dev/null 9>&- &  # 9>&-: the engine must not hold our lock
    local deadline=$((SECONDS + TIMEOUT))
    until engine_answers; do
        ((SECONDS < deadline)) || die "dockerd did not answer on $SOCK within ${TIMEOUT}s; see $LOG"
        kill -0 $! 2>/dev/null || die "dockerd exited; last lines of $LOG:"$'\n'"$(tail -n 15 "$LOG")"
        sleep 0.2
    done
    log "engine up: $(docker_ version --format 'Docker {{.Server.Version}}, API {{.Server.APIVersion}}')"
}

# The Debian mirror for the base image: $GPTLAUNCH_DEBIAN_MIRROR, else the one this machine's apt
# uses (deb822 sources first, then sources.list).
apt_mirror() {
    local uri
    if [[ -n ${GPTLAUNCH_DEBIAN_MIRROR:-} ]]; then
        echo "$GPTLAUNCH_DEBIAN_MIRROR"
        return
    fi
    uri="$(grep -hoP '^URIs:\s*\K\S+' /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v security | head -n 1 || true)"
    [[ -n $uri ]] || uri="$(grep -hoP '^deb\s+(\[[^]]*\]\s+)?\K\S+' /etc/apt/sources.list 2>/dev/null | grep -v security | head -n 1 || true)"
    echo "${uri:-http://deb.debian.org/debian}"
}

make_base_image() {
    if docker_ image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
        log "base image $BASE_IMAGE already made"
        return
    fi
    local root="$STATE/rootfs" mirror
    mirror="$(apt_mirror)"
    rm -rf "$root"
    log "debootstrap $SUITE from $mirror (about a minute)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        "$SUITE" "$root" "$mirror" >"$STATE/debootstrap.log" 2>&1 \
        || die "debootstrap failed; see $STATE/debootstrap.log"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    log "importing it as $BASE_IMAGE"
    tar -C "$root" -c . | docker_ import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
    rm -rf "$root"
}

cmd_up() {
    ((EUID == 0)) || die "'up' must run as root (it starts dockerd)"
    lock  # first: two concurrent 'up's must not both run apt-get or touch policy-rc.d
    ensure_packages
    mkdir -p "$STATE"
    start_engine
    make_base_image
    echo "$BASE_IMAGE"
    echo "unix://$SOCK"
}

cmd_down() {
    ((EUID == 0)) || die "'down' must run as root"
    [[ $# -eq 0 || ( $# -eq 1 && $1 == --purge ) ]] || die "usage: $PROG down [--purge]"
    lock
    local pid
    if pid="$(engine_pid)"; then
        local ids=()
        mapfile -t ids < <(docker_ ps -q 2>/dev/null || true)
        ((${#ids[@]} == 0)) || { log "stopping containers"; docker_ rm -f "${ids[@]}" >/dev/null 2>&1 || true; }
        log "stopping dockerd (pid $pid)"
        kill -TERM "$pid"
        local deadline=$((SECONDS + TIMEOUT))
        while kill -0 "$pid" 2>/dev/null; do
            ((SECONDS < deadline)) || { kill -KILL "$pid" 2>/dev/null || true; break; }
            sleep 0.2
        done
    fi
    if [[ ${1:-} == --purge ]]; then
        log "deleting $STATE and $EXEC_ROOT"
        # dockerd leaves its data root and network namespace mounted: unmount, deepest first.
        findmnt -rn -o TARGET | grep -E "^($STATE|$EXEC_ROOT)(/|\$)" | sort -r | xargs -r -n 1 umount -l
        rm -rf -- "$STATE" "$EXEC_ROOT"
    fi
    log "down"
}

cmd_status() {
    local ok=0
    if engine_answers; then
        echo "engine      up (pid $(engine_pid || echo ?), DOCKER_HOST=unix://$SOCK, $(docker_ info --format '{{.Driver}}') storage)"
    else
        echo "engine      NOT answering on $SOCK (log: $LOG)"; ok=1
    fi
    if ((ok == 0)) && docker_ image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
        echo "base image  $BASE_IMAGE"
    else
        echo "base image  $BASE_IMAGE missing"; ok=1
    fi
    return $ok
}

case "${1:-}" in
    up) shift; (($# == 0)) || { usage >&2; exit 2; }; cmd_up ;;
    down) shift; cmd_down "$@" ;;
    status) cmd_status ;;
    -h | --help) usage ;;
    *) usage >&2; exit 2 ;;
esac
