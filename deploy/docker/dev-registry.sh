#!/usr/bin/env bash
# Start (or stop) a private image registry on this machine: Debian's docker-registry (the reference
# `distribution` registry, 2.8), serving TLS with a certificate of a CA this script generates, for
# developing and testing images pulled by digest on the SSH test hosts (deploy/ssh/dev-hosts.sh) and
# the dev SLURM nodes (deploy/slurm/dev-cluster.sh). See usage().
#
# How clients trust it: the CA certificate goes into the per-registry trust directories of docker
# (/etc/docker/certs.d/HOST:PORT/ca.crt) and of podman/skopeo (/etc/containers/certs.d/HOST:PORT/ca.crt).
# Both are read on every pull and push (no engine restart), and both are limited to this one
# registry: nothing else on the machine trusts the CA, and no client is told to skip TLS checks.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"

readonly PROG="dev-registry"
STATE="$(realpath -m -- "${GPTLAUNCH_REGISTRY_DIR:-/var/lib/gptlaunch-registry}")"
readonly STATE
readonly BRIDGE_ADDR="10.231.0.1"  # deploy/ssh/dev-hosts.sh's bridge: reachable from every test host
readonly PORT="${GPTLAUNCH_REGISTRY_PORT:-5000}"
readonly PID_FILE="$STATE/registry.pid"
readonly LOG="$STATE/registry.log"
readonly LOCK="/run/lock/gptlaunch-dev-registry.lock"
readonly TIMEOUT=30  # seconds the registry may take to answer
readonly TRUST_DIRS=(/etc/docker/certs.d /etc/containers/certs.d)

log() { echo "$PROG: $*" >&2; }
die() { echo "$PROG: error: $*" >&2; exit 1; }

usage() {
    cat <<EOF
Usage: $0 up | down [--purge] | status | --help

  up              install Debian's docker-registry when missing, generate a CA and a server
                  certificate, make docker and podman on this machine (and so on every SSH test host
                  and dev SLURM node, which share its /etc) trust that CA for this registry only, and
                  serve on HOST:$PORT. HOST is the SSH test hosts' bridge ($BRIDGE_ADDR) when
                  deploy/ssh/dev-hosts.sh is up, else 127.0.0.1 (\$GPTLAUNCH_REGISTRY_ADDR overrides).
                  Idempotent. The last stdout line is HOST:PORT, e.g.
                      REGISTRY=\$($0 up | tail -n 1)
                      launcher build --variant cpu --tag \$REGISTRY/gptlaunch:cpu --push
  down [--purge]  stop the registry and remove the trust entries; --purge also deletes its images.
  status          print whether the registry answers over TLS; exit 0 iff it does.

State (images, CA, certificates, log, pid file) lives in \$GPTLAUNCH_REGISTRY_DIR (default
/var/lib/gptlaunch-registry). Needs root (it writes the trust entries under /etc).
EOF
}

lock() {
    exec 9>"$LOCK"
    flock -w 300 9 || die "another $PROG holds $LOCK"
}

# The address the registry serves on: the bridge of the test hosts when it exists (reachable from
# them and from this machine), else loopback.
address() {
    if [[ -n ${GPTLAUNCH_REGISTRY_ADDR:-} ]]; then
        echo "$GPTLAUNCH_REGISTRY_ADDR"
    elif ip -4 -o addr show 2>/dev/null | grep -q " inet $BRIDGE_ADDR/"; then
        echo "$BRIDGE_ADDR"
    else
        echo "127.0.0.1"
    fi
}

registry_pid() { [[ -s $PID_FILE ]] && kill -0 "$(cat "$PID_FILE")" 2>/dev/null && cat "$PID_FILE"; }
answers() { curl -fsS --max-time 5 --cacert "$STATE/ca.crt" "https://$1/v2/" >/dev/null 2>&1; }

install_missing() {
    local missing=()
    command -v docker-registry >/dev/null || missing+=(docker-registry)
    command -v openssl >/dev/null || missing+=(openssl)
    command -v curl >/dev/null || missing+=(curl)
    ((${#missing[@]} == 0)) && return
    log "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 ||
        die "apt-get install ${missing[*]} failed (run apt-get update first?)"
}

# certificates HOST: a CA (kept across runs: clients that trust it go on trusting it) and a server
# certificate for HOST, made again when HOST changed.
certificates() {
    local host=$1
    if [[ ! -s $STATE/ca.crt ]]; then
        log "generating the CA ($STATE/ca.crt)"
        openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=gptlaunch dev registry CA" \
            -keyout "$STATE/ca.key" -out "$STATE/ca.crt" 2>/dev/null
    fi
    if [[ ! -s $STATE/server.crt ]] || [[ $(cat "$STATE/server.host" 2>/dev/null) != "$host" ]]; then
        log "certificate for $host"
        openssl req -newkey rsa:2048 -nodes -subj "/CN=$host" -keyout "$STATE/server.key" \
            -out "$STATE/server.csr" 2>/dev/null
        openssl x509 -req -in "$STATE/server.csr" -CA "$STATE/ca.crt" -CAkey "$STATE/ca.key" \
            -CAcreateserial -days 825 -out "$STATE/server.crt" \
            -extfile <(printf 'subjectAltName=IP:%s\nextendedKeyUsage=serverAuth\n' "$host") 2>/dev/null
        echo "$host" >"$STATE/server.host"
    fi
}

trust() {
    local dir
    for dir in "${TRUST_DIRS[@]}"; do
        mkdir -p "$dir/$1"
        cp "$STATE/ca.crt" "$dir/$1/ca.crt"
    done
}

untrust() {
    local dir entry
    for dir in "${TRUST_DIRS[@]}"; do
        for entry in "$dir"/*; do
            [[ -f $entry/ca.crt ]] && cmp -s "$entry/ca.crt" "$STATE/ca.crt" && rm -rf -- "$entry"
        done
    done
    return 0
}

cmd_up() {
    ((EUID == 0)) || die "needs root (it writes trust entries under /etc)"
    lock
    install_missing
    mkdir -p "$STATE/data"
    local host endpoint
    host="$(address)"
    endpoint="$host:$PORT"
    certificates "$host"
    cat >"$STATE/config.yml" <<EOF
version: 0.1
log: {level: warn, accesslog: {disabled: true}}
storage:
  filesystem: {rootdirectory: $STATE/data}
  delete: {enabled: true}
http:
  addr: $endpoint
  tls: {certificate: $STATE/server.crt, key: $STATE/server.key}
EOF
    trust "$endpoint"
    if registry_pid >/dev/null && answers "$endpoint"; then
        log "registry already up on $endpoint (pid $(registry_pid))"
    else
        if registry_pid >/dev/null; then kill "$(registry_pid)"; fi
        log "starting docker-registry on $endpoint (log $LOG)"
        # setsid + nohup: the registry outlives this script and the shell that ran it.
        setsid nohup docker-registry serve "$STATE/config.yml" >>"$LOG" 2>&1 </dev/null 9>&- &
        echo $! >"$PID_FILE"
        local deadline=$((SECONDS + TIMEOUT))
        until answers "$endpoint"; do
            ((SECONDS < deadline)) || die "the registry did not answer on https://$endpoint within ${TIMEOUT}s; see $LOG"
            kill -0 "$(cat "$PID_FILE")" 2>/dev/null || die "docker-registry exited:"$'\n'"$(tail -n 15 "$LOG")"
            sleep 0.2
        done
    fi
    log "up: https://$endpoint (CA $STATE/ca.crt, trusted by docker and podman for $endpoint only)"
    echo "$endpoint"
}

cmd_down() {
    ((EUID == 0)) || die "needs root"
    lock
    local pid
    if pid="$(registry_pid)"; then
        log "stopping docker-registry (pid $pid)"
        kill -TERM "$pid"
        while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    fi
    [[ -s $STATE/ca.crt ]] && untrust
    rm -f "$PID_FILE"
    if [[ ${1:-} == --purge ]]; then
        log "deleting $STATE"
        rm -rf -- "$STATE"
    fi
    log "down"
}

cmd_status() {
    local endpoint
    endpoint="$(cat "$STATE/server.host" 2>/dev/null || address):$PORT"
    if answers "$endpoint"; then
        echo "registry  up on https://$endpoint (pid $(registry_pid || echo ?), CA $STATE/ca.crt)"
    else
        echo "registry  NOT answering on https://$endpoint (log: $LOG)"
        return 1
    fi
}

case "${1:-}" in
    up) shift; (($# == 0)) || { usage >&2; exit 2; }; cmd_up ;;
    down) shift; cmd_down "$@" ;;
    status) cmd_status ;;
    -h | --help) usage ;;
    *) usage >&2; exit 2 ;;
esac
