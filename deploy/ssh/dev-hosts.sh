#!/usr/bin/env bash
# Bring up (or down) N SSH test hosts on this one machine, for developing and
# testing gptlaunch's SSH scheduler: each host gl-hK is a Linux network
# namespace with its own address on a private bridge, its own host name, a
# private "node-local disk" and a real sshd. See usage() and
# ../../../shared/ENGINEERING.md §4.
#
#   root namespace (the launcher runs here)      network namespace gl-hK
#   glbr0 10.231.0.1/24 ─┬─ glv1 ══ veth pair ══ eth0 10.231.0.11  gl-h1: sshd :22
#                        ├─ glv2 ══ veth pair ══ eth0 10.231.0.12  gl-h2: sshd :22
#                        └─ ...                   ...
#
# Every namespace shares the machine's file system (same checkout, same
# virtualenv, same /etc/hosts and ssh client config), except one directory:
# $STATE/local is, on host K, a bind mount of $STATE/hosts/gl-hK/local.
# Share-nothing mode is that directory: job records and run dirs made under
# $STATE/local on this machine are its own, and each host's are its own (the
# SSH integration tests put theirs there; each host's XDG_STATE_HOME, where
# its node agents keep their files, is there too).
set -eEuo pipefail
# shellcheck source=../lib/podman.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/podman.sh"  # render_containers_conf, render_storage_conf
# Any unexpected failure still ends with a one-line explanation (and exit 1;
# exit 2 is reserved for usage errors).
trap 'echo "$PROG: error: unexpected failure (exit $?) at line $LINENO: $BASH_COMMAND" >&2; exit 1' ERR
export PATH="$PATH:/usr/sbin:/sbin"  # ip and sshd live there; a non-login root shell may lack them

readonly PROG="dev-hosts"
# Absolute, so that the hostfile path we print and the paths written into the
# configs are valid from any working directory.
STATE="$(realpath -m -- "${GPTLAUNCH_SSH_STATE:-/var/lib/gptlaunch-ssh}")"
readonly STATE
readonly MARKER="# written by gptlaunch deploy/ssh/dev-hosts.sh"
readonly HOSTS_MARKER="# gptlaunch-ssh"          # ends each of our /etc/hosts lines
readonly STATE_MARKER="$STATE/.gptlaunch-ssh"    # proves the dir is ours before `down` deletes it
# The lock guards machine-wide names (glbr0, gl-hK, /etc/hosts lines), so it is
# machine-wide too, and lives outside the state dir that `down` deletes.
readonly LOCK="/run/lock/gptlaunch-dev-hosts.lock"
readonly CLIENT_CONF="/etc/ssh/ssh_config.d/gptlaunch-dev-hosts.conf"
readonly SYSTEM_SSH_CONFIG="/etc/ssh/ssh_config"
readonly POLICY_RC="/usr/sbin/policy-rc.d"
readonly SSHD="/usr/sbin/sshd"                  # sshd must be started by absolute path (it re-execs itself)
readonly BRIDGE="glbr0"
readonly NET="10.231.0"                          # the /24 every host lives on
readonly BRIDGE_ADDR="$NET.1"
# Fixed MACs, locally administered (02:), "gl" (67:6c), then the address's
# last octet: the bridge is 02:67:6c:00:00:01, host K's eth0 02:67:6c:00:00:hex(10+K).
# See host_mac for why they must not be random.
readonly MAC_PREFIX="02:67:6c:00:00"
readonly BRIDGE_MAC="$MAC_PREFIX:01"
readonly MAX_HOSTS=16
readonly LOCAL_MNT="$STATE/local"                # the "node-local disk", same path on every host
readonly ANSWER_TIMEOUT=5                        # seconds a fresh sshd may take to accept a login
readonly LOCK_TIMEOUT=60
readonly STOP_TIMEOUT=5                          # seconds processes may take to exit on SIGTERM
readonly PACKAGES_ALL="openssh-server openssh-client iproute2 podman runc"

log() { echo "$PROG: $*" >&2; }
die() { echo "$PROG: error: $*" >&2; exit 1; }
usage_error() { echo "$PROG: error: $*" >&2; echo "Run '$0 --help' for usage." >&2; exit 2; }

usage() {
    cat <<EOF
Usage: $0 up [--hosts N] | down | status | --help

  up [--hosts N]  create (or reconfigure to) N SSH test hosts gl-h1..gl-hN
                  (1..$MAX_HOSTS, default 2): network namespaces on bridge $BRIDGE
                  ($BRIDGE_ADDR/24), host K at $NET.(10+K) with host name
                  gl-hK, each running its own sshd. Idempotent (fast when
                  already up; a new N adds or removes hosts). Progress goes to
                  stderr; the last stdout line is the hostfile's absolute path.
  down            stop every process on the hosts and remove everything 'up'
                  made: namespaces, bridge, veths, /etc/hosts lines, the ssh
                  client config snippet and the state dir. Idempotent.
  status          print each host and whether its sshd accepts a login;
                  exit 0 iff all hosts are up.

After 'up', plain 'ssh gl-h1 CMD' works for root on this machine and on every
host (key, known_hosts and options come from $CLIENT_CONF).
On host K, $LOCAL_MNT is a private bind mount of
$STATE/hosts/gl-hK/local (a node-local disk), and /dev/shm is its own
(host memory). Needs root.

State (keys, configs, logs, hostfile) lives in \$GPTLAUNCH_SSH_STATE (default
/var/lib/gptlaunch-ssh). The network names are machine-wide: one set of hosts
at a time.
EOF
}

host_name() { echo "gl-h$1"; }
host_addr() { echo "$NET.$((10 + $1))"; }
host_veth() { echo "glv$1"; }
# host_mac K: the MAC of host K's eth0, the same every time the host is made.
# A random one (the kernel's default for a veth) broke `up --hosts N` after a
# smaller `up`: the root namespace (and every other host) still cached the
# removed host's MAC for its address, sent the first packets to a MAC nobody
# has, and only gave up on it after delay_first_probe_time (5 s) plus 3
# unicast probes, so the re-added host missed ANSWER_TIMEOUT. With a fixed MAC
# a cached entry stays right whatever happens to the host; forget_hosts also
# drops the entries of removed hosts (those cached from random MACs of an
# older version of this script, or from a host someone re-made by hand).
host_mac() { printf '%s:%02x\n' "$MAC_PREFIX" $((10 + $1)); }
host_dir() { echo "$STATE/hosts/gl-h$1"; }

# now_us: wall clock in microseconds (bash 5's EPOCHREALTIME, no fork).
now_us() { local t=$EPOCHREALTIME; echo "${t/./}"; }
# since START_US: "1.23 s".
since() {
    local ms=$((($(now_us) - $1) / 1000))
    printf '%d.%02d s' $((ms / 1000)) $((ms % 1000 / 10))
}

# ---------------------------------------------------------------- processes --

# pid_of PIDFILE: the pid it holds, or nothing (no fork: `up` must stay fast).
pid_of() {
    local pid=""
    [[ -r $1 ]] && read -r pid <"$1" 2>/dev/null
    [[ $pid =~ ^[0-9]+$ ]] && echo "$pid"
    return 0
}

# proc_alive PID COMM: PID is a live (non-zombie) process named COMM; the name
# guards against a reused pid.
proc_alive() {
    local pid=$1 comm=$2 c="" stat=""
    [[ -n $pid && -d /proc/$pid ]] || return 1
    read -r c <"/proc/$pid/comm" 2>/dev/null || return 1
    [[ $c == "$comm" ]] || return 1
    read -r stat <"/proc/$pid/stat" 2>/dev/null || return 1
    stat=${stat##*) }           # after "pid (comm) ", the state letter comes first
    [[ ${stat:0:1} != Z ]]
}

pid_alive() { proc_alive "$(pid_of "$1")" "$2"; }

# close_fds: close every fd above 2 in this (sub)shell. A daemon must not
# inherit our lock (fd 9: it would hold it for life) nor a caller's pipes (a
# caller reading our stdout to EOF would hang until the daemon exits).
close_fds() {
    local fd
    for fd in /proc/self/fd/*; do
        fd=${fd##*/}
        if ((fd > 2)); then eval "exec ${fd}>&-"; fi
    done
    return 0
}

REAP_WAIT=0   # set by `down`: kill_ns waits for pid 1 to reap the zombies

# ns_pids NS: every process in network namespace NS (sshd, login sessions,
# anything a test started there), one pid a line.
ns_pids() { ip netns pids "$1" 2>/dev/null || true; }

# kill_ns NS: SIGTERM every process in NS, SIGKILL what outlives STOP_TIMEOUT.
kill_ns() {
    local ns=$1 all pids i pid
    all=$(ns_pids "$ns")
    [[ -n $all ]] || return 0
    log "$ns: stopping $(wc -w <<<"$all") process(es)"
    # shellcheck disable=SC2086  # a word list
    kill -TERM $all 2>/dev/null || true
    for ((i = 0; i < STOP_TIMEOUT * 20; i++)); do
        pids=$(ns_pids "$ns")   # an exited process (even a zombie) has left the namespace
        [[ -n $pids ]] || break
        sleep 0.05
    done
    if [[ -n $pids ]]; then
        log "$ns: $(wc -w <<<"$pids") process(es) ignored SIGTERM for ${STOP_TIMEOUT}s; killing them"
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
    fi
    # A daemonized sshd's parent is pid 1, which on some machines reaps
    # zombies only every ~2 s (measured here: 1.6-2.0 s). `down` waits for
    # that, so that `pgrep sshd` right after it lists nothing of ours; `up`
    # (rebuilding or shrinking) does not bother.
    ((REAP_WAIT)) || return 0
    for ((i = 0; i < 60; i++)); do
        for pid in $all; do [[ -d /proc/$pid ]] && break; pid=""; done
        [[ -n $pid ]] || break
        sleep 0.05
    done
}

# run_parallel FUNC K...: run `FUNC K` for each K in the background and wait
# for all of them; false if any failed (each prints its own error).
run_parallel() {
    local fn=$1 k rc=0
    shift
    local -a pids=()
    for k in "$@"; do
        "$fn" "$k" &
        pids+=("$!")
    done
    for k in "${pids[@]}"; do wait "$k" || rc=1; done
    return "$rc"
}

# -------------------------------------------------------------- preflight --

need_root() {
    ((EUID == 0)) || die "'$1' must run as root (the hosts are network namespaces running sshd as root, reached with root's key; 'up' and 'down' also edit /etc/hosts and /etc/ssh)"
}

# install_packages PKG...: apt-get install, without letting the openssh-server
# postinst start a system sshd on port 22 of the root namespace: a
# policy-rc.d that answers 101 ("action forbidden") makes invoke-rc.d and
# deb-systemd-invoke skip the start. If the machine already has a policy-rc.d
# (Docker-style images do), it is left alone.
install_packages() {
    local made_policy=0 pid before
    before=" $({ pgrep -x sshd || true; } | tr '\n' ' ') "
    if [[ ! -e $POLICY_RC ]]; then
        printf '#!/bin/sh\n%s (temporary, during apt-get install)\nexit 101\n' "$MARKER" >"$POLICY_RC"
        chmod 0755 "$POLICY_RC"
        made_policy=1
        trap 'rm -f "$POLICY_RC"' EXIT
        trap 'rm -f "$POLICY_RC"; exit 130' INT TERM
    fi
    log "installing $* (apt-get)"
    local -a apt=(apt-get install -y -qq --no-install-recommends "$@")
    if ! DEBIAN_FRONTEND=noninteractive "${apt[@]}" >&2; then
        log "apt-get install failed; running apt-get update and retrying"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || die "apt-get update failed"
        DEBIAN_FRONTEND=noninteractive "${apt[@]}" >&2 || die "apt-get install $* failed"
    fi
    if ((made_policy)); then
        rm -f "$POLICY_RC"
        trap - EXIT INT TERM
    fi
    # Belt and braces: a system sshd that appeared during the install (in the
    # root namespace, so not one of ours) is stopped again.
    for pid in $(pgrep -x sshd || true); do
        [[ $before == *" $pid "* ]] && continue
        [[ /proc/$pid/ns/net -ef /proc/self/ns/net ]] || continue
        log "stopping the system sshd (pid $pid) the package install started"
        kill -TERM "$pid" 2>/dev/null || true
    done
}

ensure_packages() {
    local -a missing=()
    [[ -x $SSHD ]] || missing+=(openssh-server)
    command -v ssh >/dev/null && command -v ssh-keygen >/dev/null || missing+=(openssh-client)
    command -v ip >/dev/null || missing+=(iproute2)
    # The hosts' container runtime (images pulled by digest, `launcher submit --image`).
    command -v podman >/dev/null || missing+=(podman)
    command -v runc >/dev/null || missing+=(runc)
    if ((${#missing[@]})); then
        ((EUID == 0)) || die "missing packages; as root run: apt-get install -y $PACKAGES_ALL"
        install_packages "${missing[@]}"
    fi
    local b
    for b in unshare flock hostname mount; do
        command -v "$b" >/dev/null || die "'$b' not found (Debian packages util-linux, mount, hostname)"
    done
    getent passwd sshd >/dev/null ||
        die "sshd's privilege separation user 'sshd' does not exist; reinstall openssh-server"
}

# Our ssh client config reaches every program through Debian's
# `Include /etc/ssh/ssh_config.d/*.conf` at the top of /etc/ssh/ssh_config.
check_include() {
    grep -qE '^[[:space:]]*Include[[:space:]]+/etc/ssh/ssh_config\.d/\*\.conf([[:space:]]|$)' "$SYSTEM_SSH_CONFIG" 2>/dev/null ||
        die "$SYSTEM_SSH_CONFIG has no 'Include /etc/ssh/ssh_config.d/*.conf' line, so $CLIENT_CONF would be ignored; add that line near the top of $SYSTEM_SSH_CONFIG (Debian's default has it)"
}

# The state path goes unquoted into sshd_config and ssh_config.
check_state_path() {
    [[ $STATE != / && $STATE != *[[:space:]\"\'%]* ]] ||
        die "state dir '$STATE' must not be / nor contain spaces, quotes or '%'"
}

# The names are machine-wide: refuse to take over hosts brought up from another
# state dir (its sshd configs and keys live there).
check_other_state() {
    local other
    [[ -e $CLIENT_CONF ]] || return 0
    grep -qxF "$MARKER" "$CLIENT_CONF" ||
        die "$CLIENT_CONF exists and was not written by this script (no '$MARKER' line); move it away first"
    other=$(awk '$1 == "Include" {print $2; exit}' "$CLIENT_CONF")
    other=${other%/ssh_config}
    if [[ -n $other && $other != "$STATE" && -e $other/.gptlaunch-ssh ]]; then
        die "dev hosts are already up from state dir $other; first run: GPTLAUNCH_SSH_STATE=$other $0 down"
    fi
}

lock() {
    install -d -m 0755 "${LOCK%/*}"
    exec 9>"$LOCK"
    flock -w "$LOCK_TIMEOUT" 9 || die "another dev-hosts.sh holds $LOCK (waited ${LOCK_TIMEOUT}s)"
}

# ------------------------------------------------------------------ files --

# write_if_changed FILE MODE CONTENT: (re)write FILE atomically unless it
# already holds CONTENT; returns 0 if it wrote, 1 if nothing changed.
write_if_changed() {
    local f=$1 mode=$2 content=$3 tmp old=""
    if [[ -f $f ]]; then
        old=$(<"$f")
        [[ $old == "$content" ]] && return 1
    fi
    tmp=$(mktemp "$f.XXXXXX")
    printf '%s\n' "$content" >"$tmp"
    chmod "$mode" "$tmp"
    mv -f "$tmp" "$f"
    return 0
}

# /etc/hosts: gl-hK must resolve for every program on every host. Rewritten in
# place (cat >) rather than renamed, because /etc/hosts is a bind mount in some
# containers.
set_hosts() {
    local lines=$1 tmp
    tmp=$(mktemp)
    grep -vF "$HOSTS_MARKER" /etc/hosts >"$tmp" || true
    [[ -n $lines ]] && printf '%s\n' "$lines" >>"$tmp"
    if ! cmp -s "$tmp" /etc/hosts; then
        cat "$tmp" >/etc/hosts
        log "updated /etc/hosts"
    fi
    rm -f "$tmp"
}

ensure_state_dir() {
    if [[ -d $STATE && ! -e $STATE_MARKER ]] && [[ -n "$(ls -A "$STATE")" ]]; then
        die "$STATE exists, is not empty and was not made by this script (no $STATE_MARKER); choose another GPTLAUNCH_SSH_STATE"
    fi
    install -d -m 0755 "$STATE" "$STATE/hosts" "$LOCAL_MNT"
    [[ -e $STATE_MARKER ]] || echo "$MARKER" >"$STATE_MARKER"
    # sshd's privilege separation directory (normally made by the init system).
    install -d -m 0755 /run/sshd
}

# The client key every host accepts (through AuthorizedKeysFile, so root's own
# ~/.ssh is never touched).
ensure_client_key() {
    if [[ ! -s $STATE/id_ed25519 || ! -s $STATE/id_ed25519.pub ]]; then
        log "generating the client key $STATE/id_ed25519"
        rm -f "$STATE/id_ed25519" "$STATE/id_ed25519.pub"
        ssh-keygen -q -t ed25519 -N '' -C "gptlaunch-dev-hosts" -f "$STATE/id_ed25519" </dev/null
    fi
    chmod 0600 "$STATE/id_ed25519"
    write_if_changed "$STATE/authorized_keys" 0644 "$(<"$STATE/id_ed25519.pub")" || true
}

ensure_host_key() {
    local k=$1 dir
    dir=$(host_dir "$k")
    [[ -d $dir/local ]] || install -d -m 0755 "$dir" "$dir/local"
    if [[ ! -s $dir/ssh_host_ed25519_key || ! -s $dir/ssh_host_ed25519_key.pub ]]; then
        rm -f "$dir/ssh_host_ed25519_key" "$dir/ssh_host_ed25519_key.pub"
        ssh-keygen -q -t ed25519 -N '' -C "root@$(host_name "$k")" -f "$dir/ssh_host_ed25519_key" </dev/null
    fi
}

# OpenSSH >= 9.8 penalizes (then refuses) a source address whose connections
# fail, e.g. a client rejecting the host key; every test connection comes from
# 10.231.0.x, so turn that off where sshd knows the option (9.2 does not).
PENALTIES=""
detect_penalties() {
    local v
    v=$("$SSHD" -V 2>&1 || true)   # "OpenSSH_9.2p1 Debian-2+deb12u10, OpenSSL ..."
    if [[ $v =~ OpenSSH_([0-9]+)\.([0-9]+) ]] &&
        ((BASH_REMATCH[1] > 9 || (BASH_REMATCH[1] == 9 && BASH_REMATCH[2] >= 8))); then
        PENALTIES="PerSourcePenalties no"
    fi
}

render_sshd_config() {
    local k=$1 dir
    dir=$(host_dir "$k")
    cat <<EOF
$MARKER
# sshd of dev host $(host_name "$k") (network namespace $(host_name "$k")).
ListenAddress $(host_addr "$k"):22
HostKey $dir/ssh_host_ed25519_key
PidFile $dir/sshd.pid
AuthorizedKeysFile $STATE/authorized_keys
# The state dir may live under a world-writable dir (GPTLAUNCH_SSH_STATE=/tmp/...),
# which StrictModes would reject for the authorized keys file.
StrictModes no
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
MaxSessions 64
MaxStartups 200
LogLevel VERBOSE
PrintMotd no
PrintLastLog no
X11Forwarding no
# As Debian's own sshd_config: the client's locale (Debian's ssh_config sends it).
AcceptEnv LANG LC_*
# The host agent's state (pid, exit and log files of a job's node) on this host's own disk, as on
# separate machines: a spare that takes over node K must not share node K's files with the host
# it replaces.
# podman's settings (containers.conf, storage.conf): the image storage on this host's own disk, so
# that each host really pulls (one SetEnv line: sshd reads only the first).
SetEnv XDG_STATE_HOME=$LOCAL_MNT/state CONTAINERS_CONF=$STATE/containers.conf CONTAINERS_STORAGE_CONF=$dir/storage.conf
# scp uses the SFTP protocol since OpenSSH 9.0.
Subsystem sftp internal-sftp
# OpenSSH 9.x prefers the post-quantum sntrup761x25519 key exchange, which
# costs ~0.1 s of CPU per connection on this kind of machine (measured: a
# login 0.27 s vs 0.15 s); these hosts sit on a private bridge, and launcher
# tests open many connections on 2 cores.
KexAlgorithms curve25519-sha256,curve25519-sha256@libssh.org
$PENALTIES
EOF
}

render_known_hosts() {
    local n=$1 k type key
    for ((k = 1; k <= n; k++)); do
        read -r type key _ <"$STATE/hosts/gl-h$k/ssh_host_ed25519_key.pub"
        # Under both the name and the address: "ssh 10.231.0.11" is checked too.
        echo "gl-h$k,$NET.$((10 + k)) $type $key"
    done
}

render_ssh_config() {
    cat <<EOF
$MARKER
# Included system-wide through $CLIENT_CONF.
Host gl-h* $NET.*
    User root
    IdentityFile $STATE/id_ed25519
    IdentitiesOnly yes
    UserKnownHostsFile $STATE/known_hosts
    StrictHostKeyChecking yes
    BatchMode yes
    ConnectTimeout 5
EOF
}

render_hostfile() {
    local n=$1 k
    echo "# gptlaunch SSH dev hosts (deploy/ssh/dev-hosts.sh): one host a line, 'NAME slots=N'"
    for ((k = 1; k <= n; k++)); do echo "$(host_name "$k") slots=1"; done
}

render_hosts_lines() {
    local n=$1 k
    for ((k = 1; k <= n; k++)); do
        echo "$(host_addr "$k") $(host_name "$k") $HOSTS_MARKER"
    done
}

# ---------------------------------------------------------------- network --

ensure_bridge() {
    local other ns
    # Someone else's interface on our subnet would steal the traffic.
    other=$(ip -o -4 route show "$NET.0/24" 2>/dev/null | grep -v " dev $BRIDGE " || true)
    [[ -z $other ]] || die "$NET.0/24 is already routed elsewhere: '$other'; remove that first"
    if [[ ! -d /sys/class/net/$BRIDGE ]]; then
        log "creating bridge $BRIDGE ($BRIDGE_ADDR/24)"
        # No STP: ports forward at once instead of after a forward delay.
        # A fixed MAC, for the reason of host_mac: a bridge without one takes
        # the lowest MAC of its ports (the random root-side veths), so
        # removing that port changed the MAC every host had cached for
        # $BRIDGE_ADDR and their replies went nowhere for seconds.
        ip link add "$BRIDGE" address "$BRIDGE_MAC" type bridge stp_state 0 forward_delay 0
    elif [[ $(<"/sys/class/net/$BRIDGE/address") != "$BRIDGE_MAC" ]]; then
        # Made by an older version of this script: pin its MAC now, and let the
        # hosts learn it again.
        log "setting the MAC of $BRIDGE to $BRIDGE_MAC"
        ip link set "$BRIDGE" address "$BRIDGE_MAC"
        for ns in /run/netns/gl-h*; do
            [[ -e $ns ]] || continue
            ip -n "${ns##*/}" neigh flush to "$BRIDGE_ADDR" >/dev/null 2>&1 || true
        done
    fi
    # No IPv6 link-local address (nor its router solicitations) on the bridge:
    # traffic stays on 10.231.0.0/24.
    echo 1 >"/proc/sys/net/ipv6/conf/$BRIDGE/disable_ipv6" 2>/dev/null || true
    ip addr replace "$BRIDGE_ADDR/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    ensure_bridge_filter
}

# Host-to-host frames cross the bridge. If br_netfilter is loaded with
# bridge-nf-call-iptables=1 (the default once loaded; Docker loads it), those
# frames traverse the root namespace's iptables FORWARD chain, whose policy may
# be DROP (Docker sets that): accept bridge-internal traffic explicitly. The
# sysctl itself is machine-wide, so it is left alone.
readonly FWD_RULE=(FORWARD -i "$BRIDGE" -o "$BRIDGE" -m comment --comment gptlaunch-ssh -j ACCEPT)
ensure_bridge_filter() {
    local v=0
    read -r v </proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null || true
    [[ $v == 1 ]] && command -v iptables >/dev/null || return 0
    iptables -w -C "${FWD_RULE[@]}" 2>/dev/null && return 0
    if iptables -w -I "${FWD_RULE[@]}" 2>/dev/null; then
        log "bridge-nf-call-iptables=1: added iptables rule '${FWD_RULE[*]}'"
    else
        log "warning: bridge-nf-call-iptables=1 and 'iptables -I ${FWD_RULE[*]}' failed; host-to-host traffic may be filtered"
    fi
}

remove_bridge_filter() {
    command -v iptables >/dev/null || return 0
    while iptables -w -C "${FWD_RULE[@]}" 2>/dev/null; do
        iptables -w -D "${FWD_RULE[@]}" 2>/dev/null || break
    done
}

# create_netns K: the namespace and its link to the bridge (root-namespace
# side; serial, because concurrent first `ip netns add`s race on /run/netns).
create_netns() {
    local k=$1 ns veth
    ns=$(host_name "$k")
    veth=$(host_veth "$k")
    ip netns add "$ns"
    # The peer is created inside the namespace, so its name eth0 never meets
    # the root namespace's own eth0. (`addrgenmode none` would be neater than
    # disable_ipv6, but this kernel refuses it for a veth whose peer is in
    # another namespace: "Address family not supported by protocol".)
    ip link add "$veth" type veth peer name eth0 address "$(host_mac "$k")" netns "$ns"
    echo 1 >"/proc/sys/net/ipv6/conf/$veth/disable_ipv6" 2>/dev/null || true
    ip link set "$veth" master "$BRIDGE" up
}

# forget_hosts K...: drop the neighbour (ARP) entries for these hosts'
# addresses, in the root namespace and on every host that exists; see host_mac.
# One `ip` per namespace, whatever the number of hosts.
forget_hosts() {
    local k ns cmds=""
    for k in "$@"; do cmds+="neigh flush to $(host_addr "$k")"$'\n'; done
    ip -force -batch - <<<"$cmds" >/dev/null 2>&1 || true
    for ns in /run/netns/gl-h*; do
        [[ -e $ns ]] || continue
        ip -n "${ns##*/}" -force -batch - <<<"$cmds" >/dev/null 2>&1 || true
    done
}

# teardown_host K: kill everything on host K and remove its namespace and veth.
teardown_host() {
    local k=$1 ns veth dir
    ns=$(host_name "$k")
    veth=$(host_veth "$k")
    dir=$(host_dir "$k")
    if [[ -e /run/netns/$ns ]]; then
        kill_ns "$ns"
    fi
    # An sshd left from a namespace someone deleted by hand.
    if pid_alive "$dir/sshd.pid" sshd; then kill -TERM "$(pid_of "$dir/sshd.pid")" 2>/dev/null || true; fi
    rm -f "$dir/sshd.pid"
    # Deleting one end deletes both, at once; a namespace's own cleanup of its
    # veth is asynchronous and would leave glvK around for a moment.
    if [[ -e /sys/class/net/$veth ]]; then ip link del "$veth" 2>/dev/null || true; fi
    if [[ -e /run/netns/$ns ]]; then ip netns del "$ns" 2>/dev/null || true; fi
}

# ------------------------------------------------------------------- sshd --

# answers K: host K's sshd shows the expected host key and accepts our key.
# -F: only our config, so a stray ~/.ssh/config cannot confuse the check. The
# sftp subsystem (internal to sshd, it exits on EOF) rather than a command:
# a command runs root's login shell and its ~/.bashrc (pyenv init here:
# +0.1 s per login), which says nothing about sshd.
answers() {
    ssh -F "$STATE/ssh_config" -o ConnectTimeout=2 -s "$(host_name "$1")" sftp </dev/null >/dev/null 2>&1
}

# banner K: host K's sshd accepts a TCP connection and greets with "SSH-2.0-";
# no fork, no key exchange: the idempotent `up` checks hosts this way.
banner() {
    local line=""
    { exec 3<>"/dev/tcp/$(host_addr "$1")/22"; } 2>/dev/null || return 1
    read -r -t 2 line <&3 || true
    exec 3>&-
    [[ $line == SSH-2.0-* ]]
}

# host_healthy K: namespace, veth on the bridge, and our sshd alive (checked
# without forking, so an idempotent `up` stays fast; `answers` follows).
host_healthy() {
    local k=$1 veth flags=0
    veth=$(host_veth "$k")
    [[ -e /run/netns/$(host_name "$k") ]] || return 1
    [[ /sys/class/net/$veth/master -ef /sys/class/net/$BRIDGE ]] || return 1
    read -r flags <"/sys/class/net/$veth/flags" 2>/dev/null || return 1
    ((flags & 1)) || return 1   # IFF_UP
    pid_alive "$(host_dir "$k")/sshd.pid" sshd
}

# start_host K: configure the namespace's interfaces, start sshd in it, wait
# until it accepts a login. Runs in parallel, one per host.
start_host() {
    local k=$1 ns dir deadline
    ns=$(host_name "$k")
    dir=$(host_dir "$k")
    # IPv6 off on eth0 before it goes up (no link-local chatter: traffic stays
    # on 10.231.0.0/24 and loopback); /proc/sys/net is per namespace.
    ip netns exec "$ns" sh -c 'echo 1 >/proc/sys/net/ipv6/conf/eth0/disable_ipv6; exec ip -batch -' <<EOF
addr add $(host_addr "$k")/24 dev eth0
link set lo up
link set eth0 up
EOF
    # No default route on purpose: the hosts need nothing beyond their /24,
    # and anything else then fails at once ("Network is unreachable") instead
    # of leaking into the root namespace and out of the machine.
    rm -f "$dir/sshd.pid"
    touch "$dir/sshd.log"
    # A private mount namespace (propagation slave: the host still sees mounts
    # made later on the machine, but its own stay private) in which the host's
    # local dir covers $LOCAL_MNT and a /dev/shm of its own (host memory that
    # no other host sees: the trainer's snapshots live there), and a UTS
    # namespace so that `hostname` (and torchrun's view of its own name) is
    # gl-hK. sshd then daemonizes; every login session inherits both namespaces.
    # The network namespace is entered with nsenter, not `ip netns exec`: that remounts /sys for the
    # namespace, which hides /sys/fs/cgroup, and podman on the host needs the cgroup mounts.
    # shellcheck disable=SC2016,SC2094  # $1.. expand in sh; sshd appends to the log it is also told about
    (
        close_fds
        exec nsenter --net="/var/run/netns/$ns" unshare --mount --uts --propagation slave \
            sh -c 'hostname "$1" && mount --bind "$2" "$3" && mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm && exec "$4" -f "$5" -E "$6"' \
            sh "$ns" "$dir/local" "$LOCAL_MNT" "$SSHD" "$dir/sshd_config" "$dir/sshd.log" \
            </dev/null >>"$dir/sshd.log" 2>&1
    ) || { tail -n 5 "$dir/sshd.log" >&2; die "$ns: sshd failed to start; see $dir/sshd.log"; }
    deadline=$(($(now_us) + ANSWER_TIMEOUT * 1000000))
    until answers "$k"; do
        if (($(now_us) >= deadline)); then
            tail -n 5 "$dir/sshd.log" >&2
            die "$ns: sshd does not accept a login within ${ANSWER_TIMEOUT}s; see $dir/sshd.log"
        fi
        sleep 0.1
    done
}

# check_host K: for the idempotent path; fails if K must be rebuilt. Its
# configs and keys are unchanged (see cmd_up), so a greeting sshd suffices.
check_host() { banner "$1"; }

# check_system_config: plain `ssh gl-h1` (any program, any working dir) must
# pick up our options through /etc/ssh/ssh_config; `ssh -G` shows the options
# it would use without connecting.
check_system_config() {
    local cfg
    cfg=$(ssh -G gl-h1 2>/dev/null) || die "'ssh -G gl-h1' failed"
    if ! grep -qixF "identityfile $STATE/id_ed25519" <<<"$cfg" ||
        ! grep -qixF "userknownhostsfile $STATE/known_hosts" <<<"$cfg"; then
        die "plain 'ssh gl-h1' does not use $CLIENT_CONF (see 'ssh -G gl-h1'): does root's ~/.ssh/config set IdentityFile/UserKnownHostsFile for gl-h* first?"
    fi
}

# --------------------------------------------------------------- commands --

cmd_up() {
    local n=$1 t0 k name
    t0=$(now_us)
    need_root up
    check_state_path
    ensure_packages
    check_include
    lock
    check_other_state
    ensure_state_dir
    detect_penalties

    # Keys and configs first (cheap): known_hosts needs every host key.
    ensure_client_key
    local -a rebuild=() keep=()
    for ((k = 1; k <= n; k++)); do
        ensure_host_key "$k"
        write_if_changed "$(host_dir "$k")/storage.conf" 0644 \
            "$(render_storage_conf "$MARKER" "$LOCAL_MNT/containers/storage" "$(host_name "$k")")" || true
        if write_if_changed "$(host_dir "$k")/sshd_config" 0644 "$(render_sshd_config "$k")"; then
            rebuild+=("$k")     # new host or changed config
        elif host_healthy "$k"; then
            keep+=("$k")
        else
            rebuild+=("$k")
        fi
    done
    write_if_changed "$STATE/containers.conf" 0644 "$(render_containers_conf "$MARKER")" || true
    write_if_changed "$STATE/known_hosts" 0644 "$(render_known_hosts "$n")" || true
    write_if_changed "$STATE/ssh_config" 0644 "$(render_ssh_config)" || true
    write_if_changed "$STATE/hostfile" 0644 "$(render_hostfile "$n")" || true
    echo "$n" >"$STATE/nhosts"
    set_hosts "$(render_hosts_lines "$n")"
    if write_if_changed "$CLIENT_CONF" 0644 "$MARKER"$'\n'"Include $STATE/ssh_config"; then
        log "wrote $CLIENT_CONF"
    fi

    # Hosts beyond N (from an earlier, bigger `up`, or left without state).
    local -a extra=()
    for name in /run/netns/gl-h* "$STATE"/hosts/gl-h*; do
        k=${name##*/gl-h}
        if ! [[ -e $name && $k =~ ^[0-9]+$ ]] || ((k <= n)); then continue; fi
        [[ " ${extra[*]} " == *" $k "* ]] || extra+=("$k")
    done
    if ((${#extra[@]})); then
        log "removing host(s) beyond --hosts $n:$(printf ' gl-h%s' "${extra[@]}")"
        run_parallel teardown_host "${extra[@]}" || die "could not remove host(s) beyond --hosts $n"
        for k in "${extra[@]}"; do rm -rf "$(host_dir "$k")"; done
        forget_hosts "${extra[@]}"
    fi

    ensure_bridge

    # Hosts that look healthy must also answer; the others are rebuilt.
    if ((${#keep[@]})); then
        local -a pids=()
        for k in "${keep[@]}"; do
            (check_host "$k" || exit 1) &   # `||`: a failing check is no ERR
            pids+=("$!")
        done
        for ((k = 0; k < ${#keep[@]}; k++)); do
            wait "${pids[k]}" || {
                log "$(host_name "${keep[k]}"): sshd does not answer; rebuilding it"
                rebuild+=("${keep[k]}")
            }
        done
    fi

    if ((${#rebuild[@]})); then
        log "creating host(s):$(printf ' gl-h%s' "${rebuild[@]}")"
        for k in "${rebuild[@]}"; do teardown_host "$k"; done
        forget_hosts "${rebuild[@]}"
        for k in "${rebuild[@]}"; do create_netns "$k"; done
        run_parallel start_host "${rebuild[@]}" || die "some hosts failed to start (see above); run '$0 down' to clean up"
    fi

    check_system_config

    log "up: $n host(s) ready in $(since "$t0"): $(render_hosts_lines "$n" | awk '{printf "%s%s=%s", (NR > 1 ? " " : ""), $2, $1}')"
    echo "$STATE/hostfile"
}

cmd_down() {
    local t0 name k
    t0=$(now_us)
    REAP_WAIT=1
    need_root down
    check_state_path
    lock
    if [[ -f $CLIENT_CONF ]] && grep -qxF "$MARKER" "$CLIENT_CONF" &&
        ! grep -qxF "Include $STATE/ssh_config" "$CLIENT_CONF"; then
        log "warning: $CLIENT_CONF names another state dir; removing the hosts anyway"
    fi
    # Every gl-hK namespace and glvK veth, whatever the state dir says: the
    # names are ours, and a lost state dir must not leave hosts behind.
    local -a ks=()
    for name in /run/netns/gl-h* "$STATE"/hosts/gl-h* /sys/class/net/glv*; do
        [[ -e $name ]] || continue
        k=${name##*/gl-h}
        k=${k##*/glv}
        [[ $k =~ ^[0-9]+$ ]] || continue
        [[ " ${ks[*]} " == *" $k "* ]] || ks+=("$k")
    done
    if ((${#ks[@]})); then
        mapfile -t ks < <(printf '%s\n' "${ks[@]}" | sort -n)
        log "removing host(s):$(printf ' gl-h%s' "${ks[@]}")"
        run_parallel teardown_host "${ks[@]}" || true
    fi
    if [[ -d /sys/class/net/$BRIDGE ]]; then
        ip link del "$BRIDGE"
        log "removed bridge $BRIDGE"
    fi
    remove_bridge_filter
    set_hosts ""
    if [[ -f $CLIENT_CONF ]]; then
        if grep -qxF "$MARKER" "$CLIENT_CONF"; then
            rm -f "$CLIENT_CONF"
            log "removed $CLIENT_CONF"
        else
            log "warning: $CLIENT_CONF was not written by this script; leaving it"
        fi
    fi
    if [[ -e $STATE_MARKER ]]; then
        # Nothing may be mounted below it in this namespace (the per-host bind
        # mounts lived in the hosts' own mount namespaces, now gone).
        if grep -qF " $STATE/" /proc/self/mountinfo; then
            die "something is mounted below $STATE; unmount it first"
        fi
        rm -rf "$STATE"
        log "removed $STATE"
    elif [[ -d $STATE ]]; then
        log "warning: $STATE has no $STATE_MARKER; not deleting it"
    fi
    log "down in $(since "$t0")"
}

cmd_status() {
    local n k ns rc=0 tmp
    need_root status
    if [[ ! -s $STATE/nhosts ]]; then
        echo "no hosts are up (no $STATE/nhosts)"
        return 1
    fi
    read -r n <"$STATE/nhosts"
    tmp=$(mktemp -d)
    # Log in to all hosts at once; each writes its verdict to a file.
    local -a pids=()
    for ((k = 1; k <= n; k++)); do
        (if answers "$k"; then echo ok; else echo fail; fi >"$tmp/$k") &
        pids+=("$!")
    done
    wait "${pids[@]}" || true
    printf '%-7s %-12s %s\n' HOST ADDRESS STATE
    for ((k = 1; k <= n; k++)); do
        ns=$(host_name "$k")
        local state pid
        pid=$(pid_of "$(host_dir "$k")/sshd.pid")
        if [[ ! -e /run/netns/$ns ]]; then
            state="DOWN: no network namespace $ns"
        elif ! proc_alive "$pid" sshd; then
            state="DOWN: sshd not running (log: $(host_dir "$k")/sshd.log)"
        elif [[ $(<"$tmp/$k") != ok ]]; then
            state="DOWN: sshd (pid $pid) does not accept a login (log: $(host_dir "$k")/sshd.log)"
        else
            state="up: sshd pid $pid answers"
        fi
        [[ $state == up:* ]] || rc=1
        printf '%-7s %-12s %s\n' "$ns" "$(host_addr "$k")" "$state"
    done
    rm -rf "$tmp"
    echo "hostfile: $STATE/hostfile"
    return "$rc"
}

main() {
    local cmd=${1:-} hosts=2 hosts_given=0
    [[ -n $cmd ]] || { usage >&2; exit 2; }
    shift
    case $cmd in
        -h | --help | help) usage; exit 0 ;;
    esac
    while (($#)); do
        case $1 in
            --hosts)
                [[ $# -ge 2 ]] || usage_error "--hosts needs a value"
                hosts=$2 hosts_given=1
                shift 2 ;;
            --hosts=*) hosts=${1#--hosts=} hosts_given=1; shift ;;
            -h | --help) usage; exit 0 ;;
            *) usage_error "unknown argument: $1" ;;
        esac
    done
    if ! [[ $hosts =~ ^[0-9]{1,3}$ ]] || ((10#$hosts < 1 || 10#$hosts > MAX_HOSTS)); then
        usage_error "--hosts must be an integer 1..$MAX_HOSTS, got '$hosts'"
    fi
    hosts=$((10#$hosts))
    if ((hosts_given)) && [[ $cmd != up ]]; then usage_error "--hosts only applies to 'up'"; fi
    case $cmd in
        up) cmd_up "$hosts" ;;
        down) cmd_down ;;
        status) cmd_status || exit 1 ;;   # `||`: exit 1 is a verdict, no ERR
        *) usage_error "unknown command: $cmd" ;;
    esac
}

main "$@"
