"""What this host runs: ``python -m launcher.preflight.probe [--json]``, run on every host before a
multi-host job.

The launcher runs the probe on each host (over ssh, inside SLURM jobs, inside containers) and compares
the reports (``launcher.preflight.parity``): versions that must match (Python, torch, CUDA, NCCL, cuDNN, key
packages, gptlaunch, the container image) refuse the launch when they differ. The report also carries
what the launcher needs to plan the job: the interface and source address that reach the master
address, what names resolve to here, and a free port for the rendezvous.

This module imports no torch (nor numpy): ``collect`` imports it, so the launcher's quick commands can
import the models for free.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gptlaunch import package_version
from launcher.job.measurements import Gpu, Probe, Route

# Packages whose versions must match on every host (besides Python, torch and gptlaunch): a different
# tokenizer or NCCL wheel gives different tokens or a hang, not an error. The NCCL wheel is cu12 for
# torch's CUDA 12 builds and cu13 for its CUDA 13 builds (torch 2.13's default).
KEY_PACKAGES = ("numpy", "tokenizers", "datasets", "triton", "nvidia-nccl-cu12", "nvidia-nccl-cu13")
IMAGE_DIGEST_ENV = "GPTLAUNCH_IMAGE_DIGEST"  # set by our container images
COMMAND_TIMEOUT_S = 5.0  # for `ip route get` and `nvidia-smi`: a hung tool must not hang the launch
_CONTAINER_CGROUP = re.compile(r"docker|containerd|kubepods")
_DRIVER_VERSION = re.compile(r"\s(\d+\.\d+(?:\.\d+)*)\s")
_NO_CUDA: dict[str, Any] = {"cuda": None, "nccl": None, "cudnn": None, "gpus": []}  # no torch, or a CPU build


def collect(route_to: str | None = None, resolve: Sequence[str] = (), free_port: bool = False) -> Probe:
    """Probe this host. ``route_to``: also report the route to that name or address (and what it
    resolves to, in ``resolved``); ``resolve``: names to resolve; ``free_port``: report a free TCP port.
    A name that does not resolve gives None, never an error: the caller decides what that means.
    Raises ImportError or OSError when torch is installed but broken (e.g. a CUDA library missing)."""
    started = time.monotonic()
    names = [*resolve, *([route_to] if route_to else [])]
    resolved = {name: resolve_address(name) for name in dict.fromkeys(names)}
    route = None
    if route_to is not None and resolved[route_to] is not None:
        route = find_route(route_to, str(resolved[route_to]))
    facts = _torch_facts()  # the slow part: the import of torch, a second or more
    return Probe(
        hostname=socket.gethostname(),
        os=_os_name(),
        kernel=platform.release(),
        machine=platform.machine(),
        python=platform.python_version(),
        python_executable=sys.executable,
        driver=_driver_version(),
        launcher=package_version(),
        packages={name: _package_version(name) for name in KEY_PACKAGES},
        image_digest=os.environ.get(IMAGE_DIGEST_ENV) or None,
        in_container=_in_container(),
        interfaces=interfaces(),
        route=route,
        resolved=resolved,
        free_port=_free_port() if free_port else None,
        probe_s=time.monotonic() - started,
        **facts,
    )


def _torch_facts() -> dict[str, Any]:
    """torch, torch_git, cuda, nccl, cudnn and gpus: all None (and no GPUs) when torch is not installed.

    A CPU build (no CUDA in ``torch/version.py``) has no NCCL, cuDNN or GPUs to ask about: its facts come
    from that file alone, without the ~1.5 s import of torch (probes of many hosts sharing few cores
    stay fast). A CUDA build is imported: only the loaded libraries know their versions."""
    built = _torch_version_file()
    if built is not None and built.get("cuda") is None:
        return {"torch": built.get("__version__"), "torch_git": built.get("git_version"), **_NO_CUDA}
    try:
        import torch
    except ModuleNotFoundError as e:
        if e.name != "torch":  # torch is there but broken: say so rather than report it missing
            raise
        return {"torch": None, "torch_git": None, **_NO_CUDA}
    return {
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "cuda": torch.version.cuda,
        "nccl": _nccl_version(torch),
        "cudnn": _cudnn_version(torch),
        "gpus": _gpus(torch),
    }


def _torch_version_file() -> dict[str, Any] | None:
    """The constants of torch's generated ``torch/version.py`` (__version__, git_version, cuda), read
    without importing torch; None when torch is not installed or the file is not as expected."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    values: dict[str, Any] = {}
    try:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Constant):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        values[target.id] = node.value.value
    except (OSError, SyntaxError):
        return None
    return values if "__version__" in values and "cuda" in values else None


def _nccl_version(torch: Any) -> str | None:
    """The NCCL torch loaded, e.g. "2.21.5"; None on a build without NCCL (CPU builds)."""
    try:
        if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
            return None
        version = torch.cuda.nccl.version()  # (major, minor, patch[, suffix]); asks the library, no GPU
    except Exception:  # any failure here means "no usable NCCL", which the comparison then shows
        return None
    if not isinstance(version, tuple):
        return str(version)
    suffix = f"+{version[3]}" if len(version) > 3 and version[3] else ""
    return ".".join(str(part) for part in version[:3]) + suffix


def _cudnn_version(torch: Any) -> str | None:
    """cuDNN's version, e.g. "9.1.0"; None when torch has none (CPU builds)."""
    try:
        code = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:
        return None
    if not isinstance(code, int):
        return None
    # CUDNN_VERSION is major*1000 + minor*100 + patch before cuDNN 9, major*10000 + minor*100 + patch since.
    major, rest = divmod(code, 10000) if code >= 90000 else divmod(code, 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _gpus(torch: Any) -> list[Gpu]:
    """The GPUs torch sees (CUDA_VISIBLE_DEVICES applies); [] without CUDA or a usable driver."""
    try:
        if not torch.cuda.is_available():
            return []
        props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a driver too old for this torch, a GPU in a bad state: report none usable
        return []
    return [Gpu(index=i, name=p.name, memory_bytes=p.total_memory) for i, p in enumerate(props)]


def _driver_version() -> str | None:
    """The NVIDIA driver's version, e.g. "535.104.05", from /proc, else nvidia-smi; None without one."""
    try:
        first_line = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        first_line = ""
    if match := _DRIVER_VERSION.search(first_line + " "):
        return match.group(1)
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return None
    output = _run([nvidia_smi, "--query-gpu=driver_version", "--format=csv,noheader"])
    lines = output.split() if output else []
    return lines[0] if lines else None


def _run(argv: list[str]) -> str | None:
    """The stdout of ``argv``, or None if it fails, is missing or takes over COMMAND_TIMEOUT_S seconds."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _os_name() -> str:
    try:
        return platform.freedesktop_os_release()["PRETTY_NAME"]
    except (OSError, KeyError):
        return platform.platform()


def _package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version  # tens of ms: only when probing

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _in_container() -> bool:
    """Whether this process runs in a container (Docker, Podman, containerd, Kubernetes)."""
    if Path("/.dockerenv").exists() or Path("/run/.containerenv").exists():
        return True
    if os.environ.get("container"):  # noqa: SIM112 - lower case is the convention (podman, systemd-nspawn)
        return True
    try:
        return bool(_CONTAINER_CGROUP.search(Path("/proc/1/cgroup").read_text()))
    except OSError:
        return False


def interfaces() -> dict[str, list[str]]:
    """Interfaces that are up -> their IPv4 and IPv6 addresses (without an IPv6 zone such as %eth0)."""
    import psutil  # only when probing: the launcher imports this module for the models

    stats = psutil.net_if_stats()
    families = (socket.AF_INET, socket.AF_INET6)
    return {
        name: [a.address.split("%")[0] for a in addrs if a.family in families]
        for name, addrs in psutil.net_if_addrs().items()
        if name in stats and stats[name].isup
    }


def resolve_address(name: str) -> str | None:
    """What ``name`` resolves to here: an IPv4 address if it has one, else IPv6; None if it does not
    resolve. An address resolves to itself. Bounded by the resolver's own timeouts (resolv.conf)."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # socket.gaierror is an OSError; an over-long label a UnicodeError
        return None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # stable: keeps the resolver's order within
    return str(infos[0][4][0]) if infos else None


def find_route(to: str, address: str) -> Route | None:
    """How this host reaches ``address`` (resolved from ``to``): ``ip -o route get``, else, where
    iproute2 is missing (slim container images), the source address the kernel picks for a UDP socket
    and the interface holding it. None when there is no route."""
    output = _run(["ip", "-o", "route", "get", address])
    if output:
        words = output.split()
        after = {word: words[i + 1] for i, word in enumerate(words[:-1]) if word in ("dev", "src")}
        if "dev" in after:
            return Route(to=to, address=address, dev=after["dev"], src=after.get("src"))
    return _udp_route(to, address)


def _udp_route(to: str, address: str) -> Route | None:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((address, 9))  # a UDP connect only picks the route: nothing is sent
            src = str(sock.getsockname()[0])
    except OSError:
        return None
    dev = next((name for name, addrs in interfaces().items() if src in addrs), None)
    return Route(to=to, address=address, dev=dev, src=src) if dev else None


def _free_port() -> int:
    """A TCP port free on all addresses now (another process may take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def describe_gpus(gpus: Sequence[Gpu], memory: bool = True) -> str:
    """E.g. "2 × NVIDIA A100 80GB (80.0 GiB)"; kinds in order of first index; "none" without GPUs."""
    counts = Counter((gpu.name, gpu.memory_bytes) for gpu in gpus)
    parts = [
        f"{n} × {name}" + (f" ({size / 2**30:.1f} GiB)" if memory else "")
        for (name, size), n in counts.items()
    ]
    return ", ".join(parts) or "none"


def format_probe(probe: Probe) -> str:
    """The report as aligned "field: value" lines, for people."""
    rows: list[tuple[str, str]] = []
    for field, value in probe.model_dump().items():
        if field == "gpus":
            rows.append((field, describe_gpus(probe.gpus)))
        elif field == "packages":
            rows += [(f"packages.{k}", v or "(not installed)") for k, v in probe.packages.items()]
        elif field == "interfaces":
            rows.append((field, ", ".join(f"{k} {' '.join(v)}".strip() for k, v in value.items())))
        elif field == "route" and probe.route is not None:
            r = probe.route
            rows.append((field, f"{r.to} ({r.address}) dev {r.dev}" + (f" src {r.src}" if r.src else "")))
        elif field == "resolved":
            rows.append((field, ", ".join(f"{k} {v or '(does not resolve)'}" for k, v in value.items())))
        elif field == "probe_s":
            rows.append((field, f"{value:.2f}"))
        else:
            rows.append((field, "-" if value is None else str(value)))
    width = max(len(name) for name, _ in rows) + 1
    return "\n".join(f"{name + ':':<{width}} {text}" for name, text in rows)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send whatever is printed to stdout meanwhile, by Python or native code (a library's banner), to
    stderr: the report must be the only thing on stdout, for the launcher reads it as JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str] | None = None) -> int:
    """``python -m launcher.preflight.probe``: print this host's report. Exits 0 even when names do not
    resolve."""
    parser = argparse.ArgumentParser(
        prog="python -m launcher.preflight.probe",
        description="Report this host's versions, GPUs and network for the launcher's parity check.",
        allow_abbrev=False,
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON line")
    parser.add_argument("--route-to", metavar="HOST", help="also report the route (interface) to HOST")
    parser.add_argument(
        "--resolve", metavar="NAME", action="append", default=[], help="report what NAME resolves to"
    )
    parser.add_argument("--free-port", action="store_true", help="report a free TCP port on this host")
    args = parser.parse_args(argv)
    with _stdout_to_stderr():
        probe = collect(args.route_to, args.resolve, args.free_port)
    print(probe.model_dump_json() if args.json else format_probe(probe), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
