"""The pinned image on SSH hosts: pull time on 1, 2 and 4 hosts, the image's size, and the time from
`launcher submit` to the first training step on 2 hosts with and without `--image`, side by side.

Needs root, the SSH test hosts (deploy/ssh/dev-hosts.sh), the dev registry (deploy/docker/dev-registry.sh)
with the image pushed, and DOCKER_HOST (the tag is resolved to its digest through the engine). Each
pull starts from empty host storage (the image removed first); the host counts and the with/without
runs alternate in rounds, so outside load hits them alike; medians are printed, with the ratios.

    export DOCKER_HOST=$(deploy/docker/dev-engine.sh up | tail -n 1)
    REGISTRY=$(deploy/docker/dev-registry.sh up | tail -n 1)
    launcher build --variant cpu --tag $REGISTRY/gptlaunch:cpu --push
    python benchmarks/bench_images.py --image $REGISTRY/gptlaunch:cpu [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from launcher.image.reference import repository, resolve
from launcher.schedulers.ssh import client as ssh
from launcher.schedulers.ssh.hosts import pull_image

REPO_ROOT = Path(__file__).resolve().parents[1]
TEXT = REPO_ROOT.parent / "shared" / "data" / "wikitext-2" / "valid.txt"
REGISTRY_CA = Path("/var/lib/gptlaunch-registry/ca.crt")
MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"


def hosts(n: int) -> list[str]:
    up = subprocess.run(
        ["bash", str(REPO_ROOT / "deploy/ssh/dev-hosts.sh"), "up", "--hosts", str(max(n, 2))],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    lines = Path(up.stdout.split()[-1]).read_text().splitlines()
    return [line.split()[0] for line in lines if line and line[0] != "#"][:n]


def pull_s(names: list[str], image: str) -> float:
    """Seconds for ``names`` to pull ``image`` at once, from empty storage."""
    settings = ssh.SshSettings(options=(), host_key_check="yes", connect_timeout_s=10)
    ssh.fan_out(settings, names, lambda h: "podman rmi --all --force >/dev/null 2>&1; true", 120)
    started = time.monotonic()
    pull_image(settings, names, sys.executable, image, "podman", lambda line: None)
    return time.monotonic() - started


def sizes(names: list[str], image: str) -> tuple[int, int]:
    """(bytes the registry sends: the compressed layers; bytes unpacked on a host)."""
    registry, _, rest = image.partition("/")
    name, digest = repository(rest), image.split("@", 1)[1]
    url = f"https://{registry}/v2/{name}/manifests/{digest}"
    manifest = requests.get(url, headers={"Accept": MANIFEST}, verify=str(REGISTRY_CA), timeout=30).json()
    sent = sum(int(layer["size"]) for layer in manifest["layers"])
    out = subprocess.run(["ssh", names[0], f"podman image inspect --format '{{{{.Size}}}}' {image}"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return sent, int(out.strip())


def first_step_s(hostfile: Path, image: str | None, jobs: Path) -> float:
    """Seconds from `launcher submit` to the first training step's line on 2 hosts."""
    argv = [sys.executable, "-m", "launcher.cli.main", "--jobs-root", str(jobs), "submit",
            "--scheduler", "ssh", "--hostfile", str(hostfile), "--nodes", "2", "--python", sys.executable,
            *(["--image", image] if image else []), "--", "--no-compile", "--preset", "tiny",
            "--text-files", str(TEXT), "--max-steps", "3", "--log-interval", "1",
            "--run-dir", tempfile.mkdtemp(dir=jobs)]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO_ROOT)
    assert proc.stdout is not None
    seen = None
    for line in proc.stdout:
        if seen is None and "step 1/" in line:
            seen = time.monotonic() - started
    if proc.wait() != 0 or seen is None:
        raise SystemExit(f"the job failed: {' '.join(argv)}")
    return seen


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", required=True, help="the pushed image, by tag or digest")
    p.add_argument("--rounds", type=int, default=3, help="rounds of alternating runs (default: 3)")
    args = p.parse_args()
    image = resolve(args.image)
    all_hosts = hosts(4)
    counts = (1, 2, 4)
    pulls: dict[int, list[float]] = {n: [] for n in counts}
    for r in range(args.rounds):
        for n in counts[r % 3 :] + counts[: r % 3]:  # the order rotates each round
            pulls[n].append(pull_s(all_hosts[:n], image))
            print(f"round {r + 1}: {n} host(s) pulled in {pulls[n][-1]:.1f} s", file=sys.stderr)
    sent, unpacked = sizes(all_hosts, image)
    times: dict[str, list[float]] = {"bare": [], "image": []}
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp, "hosts")
        hostfile.write_text("\n".join(all_hosts[:2]) + "\n")
        for r in range(args.rounds):
            for kind in ("bare", "image") if r % 2 == 0 else ("image", "bare"):
                times[kind].append(first_step_s(hostfile, image if kind == "image" else None, Path(tmp)))
                print(f"round {r + 1}: {kind}: first step after {times[kind][-1]:.1f} s", file=sys.stderr)
    one = statistics.median(pulls[1])
    print(
        f"image {image}: {sent / 1e9:.2f} GB from the registry (compressed), {unpacked / 1e9:.2f} GB unpacked"
    )
    print(f"{'hosts':>6} {'pull s (median)':>16} {'ratio to 1 host':>16}")
    for n in counts:
        print(f"{n:>6} {statistics.median(pulls[n]):>16.1f} {statistics.median(pulls[n]) / one:>16.2f}")
    bare, inside = statistics.median(times["bare"]), statistics.median(times["image"])
    print(f"submit -> first step on 2 hosts: {bare:.1f} s bare, {inside:.1f} s with --image (image present; "
          f"ratio {inside / bare:.2f}); {args.rounds} rounds")  # fmt: skip
    print(json.dumps({"pull_s": pulls, "first_step_s": times, "bytes": [sent, unpacked]}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
