# podman settings of the dev machines (sourced by deploy/ssh/dev-hosts.sh and deploy/slurm/dev-cluster.sh;
# ../../../shared/ENGINEERING.md, "podman on the SSH test hosts"): runc, because crun 1.8 refuses this
# machine's hybrid cgroup v1/v2 layout; explicit limits, because podman's defaults raise
# RLIMIT_NPROC/NOFILE past what these machines allow; no systemd (cgroupfs, events to a file).
# shellcheck shell=bash

# render_containers_conf MARKER: containers.conf (CONTAINERS_CONF).
render_containers_conf() {
    cat <<EOF
$1
[containers]
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)", "nproc=1024:1024"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
}

# render_storage_conf MARKER GRAPHROOT NAME: storage.conf (CONTAINERS_STORAGE_CONF) of one host or
# node: its images under GRAPHROOT (its own disk, so that each really pulls); a short run root per
# NAME (podman's socket paths under it must fit 108 bytes).
render_storage_conf() {
    cat <<EOF
$1
[storage]
driver = "overlay"
graphroot = "$2"
runroot = "/run/gptlaunch-podman/$3"
EOF
}
