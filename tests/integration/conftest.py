"""Helpers for integration tests: real `launcher`/`trainer`/torchrun processes on real text."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psutil
import pytest

from gptlaunch.contract import Beat, read_beats
from launcher.job.logs import wait_terminal
from launcher.job.record import JobRecord, JobStatus
from launcher.job.torchrun import zygote_name
from launcher.schedulers.local.scheduler import LocalScheduler
from tests.conftest import missing_component


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test in this folder `integration` (`pytest -m "not integration"` skips them)."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.integration)


# Fast, deterministic trainer settings shared by the tests (compile is exercised by the benchmark and
# by test_compiled_ddp.py). Training steps are most of what these tests spend, and what they test does
# not depend on the model's size: micro-batches of 4 sequences (not 16) of a model of 2 blocks of
# width 128 (not tiny's 4 of 256) make a step about 0.1 s on a core (tiny's default: 2 s); tests whose
# faults need longer steps add TINY after FAST. A given peak FLOP/s: rank 0 of each new run dir would
# otherwise measure it (about 1.8 s of matmuls at start-up, while the other ranks wait);
# tests/unit/test_metrics.py measures it for real.
FAST = ["--no-compile", "--eval-iters", "2", "--log-interval", "1", "--micro-batch-size", "4",
        "--n-layer", "2", "--n-head", "2", "--d-model", "128", "--peak-flops", "1e12"]  # fmt: skip
TINY = ["--n-layer", "4", "--n-head", "4", "--d-model", "256"]  # the tiny preset's shape, after FAST


@pytest.fixture(scope="session")
def prepared_data(wikitext_valid: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Trainer arguments pointing at WikiText-2 valid, prepared once for the session (vocab 8192)."""
    data_dir = tmp_path_factory.mktemp("data")
    args = ["--text-files", str(wikitext_valid), "--data-dir", str(data_dir)]
    run([sys.executable, "-m", "trainer.cli", "prepare", *args], check=True)
    return args


def run(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    check: bool = False,
    timeout: float = 600,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    with subprocess.Popen(
        argv, env=os.environ | (env or {}), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stacks = python_stacks(child.pid)  # where it hung, before the kill
            child.kill()
            try:
                stdout, stderr = child.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # a process it left (a rank torchrun lost) holds the pipes
                stdout, stderr = "", ""
            raise AssertionError(
                f"{argv} ran past {timeout} s\n{stdout[-4000:]}\n{stderr[-4000:]}\n{stacks}"
            ) from None
    proc = subprocess.CompletedProcess(argv, child.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"{argv} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def python_stacks(pid: int) -> str:
    """py-spy's dump of the Python stacks of ``pid`` and its descendants (a timeout's diagnosis)."""
    try:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return ""
    spy = Path(sys.executable).with_name("py-spy")
    dumps = []
    for proc in tree:
        with contextlib.suppress(psutil.Error, OSError, subprocess.TimeoutExpired):
            argv = [str(spy), "dump", "--pid", str(proc.pid)]
            dump = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            dumps.append(f"--- {proc.pid} {' '.join(proc.cmdline())[:200]}\n{dump.stdout}{dump.stderr}")
    return "\n".join(dumps)


def launcher(jobs_root: Path, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "launcher.cli.main", "--jobs-root", str(jobs_root), *args], **kw)


def torchrun(nproc: int, *trainer_args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "trainer.cli",
        "train",
        *trainer_args,
    ]
    return run(argv, env={"OMP_NUM_THREADS": "1"} | kw.pop("env", {}), **kw)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(run_dir) if "tokens_per_s" in m}


def only_job_id(jobs_root: Path) -> str:
    (job,) = [p.name for p in jobs_root.iterdir()]
    return job


# What a test starts that must not outlive it, by command line: ranks and their agents, the collective
# preflight's workers, a sweep's driver, the busy loops of the slowed-machine tests.
LEFTOVER_MARKS = ("trainer.cli", "gptlaunch.shim", "launcher.preflight.collective", "launcher.sweep.drive",
                  "while True: pass")  # fmt: skip
LEFTOVER_GRACE_S = 20.0  # some ends are asynchronous: a container's, a SLURM step's


# `make test` (tests/phases.sh) runs the `beside` tests in a pytest of their own beside the others, with
# BESIDE_ENV set in both: each run then judges only its own processes, its descendants and those whose
# command line or working directory names one of its own directories (its base temporary directory,
# where every test's run dir, data and project are, or a ``private`` dir of its tests).
BESIDE_ENV = "GPTLAUNCH_TESTS_BESIDE"
OWN_DIRS: list[str] = []


@pytest.fixture(scope="session", autouse=True)
def _own_dirs(tmp_path_factory: pytest.TempPathFactory) -> None:
    OWN_DIRS.append(str(tmp_path_factory.getbasetemp()))


def _ours(proc: psutil.Process, command: str) -> bool:
    if not os.environ.get(BESIDE_ENV):
        return True
    with contextlib.suppress(psutil.Error):
        if os.getpid() in {p.pid for p in proc.parents()}:
            return True
        command += " " + proc.cwd()
    return any(own in command for own in OWN_DIRS)


def _leftovers() -> list[psutil.Process]:
    ours = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        command = " ".join(proc.info["cmdline"] or [])
        # Another checkout's test run on this machine (its own .venv) is not ours to judge.
        elsewhere = "/.venv/bin/" in command and sys.prefix not in command
        marked = any(mark in command for mark in LEFTOVER_MARKS)
        if proc.pid not in ours and marked and not elsewhere and _ours(proc, command):
            found.append(proc)
    return found


@pytest.fixture(autouse=True)
def no_leftover_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test, what it started has ended (within LEFTOVER_GRACE_S), else it is killed and a
    warning names the test and the processes: on a shared 2-core machine one test's leak would slow
    every test after it (and fail the timing-sensitive ones) far from its cause."""
    yield
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (left := _leftovers()) and time.monotonic() < deadline:
        time.sleep(0.5)
    described = []
    for proc in left:
        with contextlib.suppress(psutil.Error):
            described.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
            proc.kill()
    if described:
        warnings.warn(
            f"{request.node.nodeid} left {len(described)} process(es), killed: {described}", stacklevel=1
        )


def processes_of(job_id: str) -> list[psutil.Process]:
    """Every live process that belongs to the job: by its environment marker or its command line (the
    job id, or its SSH zygote's socket), and their descendants (a warm worker's rank is forked by the
    job's zygote: its ``/proc`` environment is the zygote's, which lacks the job id, and its command
    line is its program's)."""
    found: dict[int, psutil.Process] = {}
    marks = (job_id, zygote_name(job_id))
    for proc in psutil.process_iter():
        try:
            if proc.pid == os.getpid():
                continue
            named = any(mark in a for a in proc.cmdline() for mark in marks)
            if named or proc.environ().get("GPTLAUNCH_JOB_ID") == job_id:
                found[proc.pid] = proc
                found |= {child.pid: child for child in proc.children(recursive=True) if _alive(child)}
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return list(found.values())


def runs_module(proc: psutil.Process, module: str) -> bool:
    """Whether ``proc`` is ``python [-u] -m MODULE ...``: as torchrun starts it, as a warm worker's
    client runs it cold, or as a warm worker's forked rank titles itself (``setproctitle``: one string
    in place of its zygote's command line). Not the client (``-m gptlaunch.warm ... -m MODULE``)."""
    try:
        words = [w for w in " ".join(proc.cmdline()).split() if w != "-u"]
    except psutil.Error:
        return False
    return words[1:3] == ["-m", module]


def _alive(proc: psutil.Process) -> bool:
    """Whether ``proc`` runs: not a zombie that its parent has yet to reap, nor gone."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def make_other_venv(tmp_path: Path) -> tuple[Path, str]:
    """A virtualenv that sees this one's packages, except tokenizers, installed at another version.
    Returns its python and that version."""
    venv = tmp_path / "venv-b"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    ours = sysconfig.get_paths()["purelib"]
    (site / "shared.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    other = "0.21.0" if version("tokenizers") == "0.20.3" else "0.20.3"
    run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
         f"tokenizers=={other}"],
        check=True,
        timeout=300,
    )  # fmt: skip
    return venv / "bin" / "python", other


def wait_for(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll ``condition`` (a real state: a file, a process) every 0.2 s until true, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def wait_for_steps(beat_dirs: list[Path], step: int, timeout_s: float = 180, ranks: int = 2) -> list[Beat]:
    """Every rank's beat (``ranks`` of them) once each is past ``step`` in the step phase (polls the real
    files)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beats = [b for d in beat_dirs for b in read_beats(d)]
        if len(beats) == ranks and all(b.phase == "step" and b.step >= step for b in beats):
            return beats
        time.sleep(0.2)
    raise AssertionError(f"the ranks did not reach step {step} within {timeout_s} s: {beats}")


# The SSH test hosts of deploy/ssh/dev-hosts.sh (network namespaces with their own sshd).
HOSTS_SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "ssh" / "dev-hosts.sh"
N_HOSTS = 8  # the fan-out test's hosts; the others use the first two


@pytest.fixture(scope="session")
def hostfile() -> Path:
    """The test hosts' hostfile (all N_HOSTS of them), from `dev-hosts.sh up`. Under CI=true a missing
    component fails the tests instead of skipping them."""
    problem = None
    if os.geteuid() != 0:
        problem = "the SSH test hosts need root (network namespaces)"
    else:
        proc = run(["bash", str(HOSTS_SCRIPT), "up", "--hosts", str(N_HOSTS)], timeout=300)
        if proc.returncode != 0:
            problem = f"dev-hosts.sh up failed:\n{proc.stderr[-3000:]}"
    if problem is not None:
        missing_component(problem)
    return Path(proc.stdout.strip().splitlines()[-1])


SSH_STATE = Path(os.environ.get("GPTLAUNCH_SSH_STATE", "/var/lib/gptlaunch-ssh"))


@pytest.fixture
def private(hostfile: Path) -> Iterator[Path]:
    """Share-nothing mode of the SSH test hosts: ``STATE/local/<unique>``, one path that this machine
    and every host each see as a directory of its own (``dev-hosts.sh`` binds each host's own disk
    at ``STATE/local``). Job records made under it are the launcher's alone, each host's run dir is
    its own, and nothing crosses but through ssh."""
    name = f"sn-{uuid.uuid4().hex[:10]}"
    path = SSH_STATE / "local" / name
    path.mkdir()
    OWN_DIRS.append(str(path))
    yield path
    for root in [SSH_STATE / "local", *(SSH_STATE / "hosts").glob("*/local")]:
        shutil.rmtree(root / name, ignore_errors=True)


def on_host(host: str, path: Path) -> Path:
    """Where this machine finds ``path`` (under ``SSH_STATE/local``) as dev host ``host`` sees it."""
    return SSH_STATE / "hosts" / host / "local" / path.relative_to(SSH_STATE / "local")


def runs_on(proc: psutil.Process, host: str) -> bool:
    """Whether ``proc`` runs on dev host ``host`` (in its network namespace: the dev hosts share this
    machine's process table, and a warm worker's forked rank has its zygote's environment)."""
    try:
        return os.stat(f"/proc/{proc.pid}/ns/net").st_ino == os.stat(f"/run/netns/{host}").st_ino
    except OSError:
        return False


_STEP = re.compile(r"\bstep (\d+)/\d+\b")  # the trainer's and the example scripts' step lines


def logged_step(job_dir: Path) -> int:
    """The furthest step rank 0 logged, as the launcher's node logs show it (0 before the first)."""
    logs = [log.read_text(errors="replace") for log in job_dir.glob("node-*.log")]
    return max((int(step) for text in logs for step in _STEP.findall(text)), default=0)


def first_hosts(hostfile: Path, n: int, tmp_path: Path, skip: int = 0) -> Path:
    """A hostfile of ``n`` test hosts, the first after ``skip`` of them."""
    lines = [line for line in hostfile.read_text().splitlines() if line and not line.startswith("#")]
    path = tmp_path / f"hosts-{n}"
    path.write_text("\n".join(lines[skip : skip + n]) + "\n")
    return path


# Busy loops on a slowed machine's core, each in its own session: with the scheduler's autogroups (one
# per session) a nice value would not rank them, but a count does: the slowed processes get at most
# 1/(N+1) of that core while everything else runs on the other.
BUSY_LOOPS = 6


@contextlib.contextmanager
def slowed(root: psutil.Process) -> Iterator[None]:
    """``root`` (a host's sshd, a node's slurmd) and every process it has and will start (children
    inherit the affinity) pinned to CPU 0, with BUSY_LOOPS busy loops there; all undone after."""
    every_cpu = sorted(os.sched_getaffinity(0))
    loop = [sys.executable, "-c", "while True: pass"]
    busy = [subprocess.Popen(["setsid", "taskset", "-c", "0", *loop]) for _ in range(BUSY_LOOPS)]
    try:
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.cpu_affinity([0])
        yield
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.cpu_affinity(every_cpu)


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def plain_project(tmp_path: Path, text: Path) -> Path:
    """A user's project directory as it would be shipped to the nodes: the plain example script
    (``examples/ddp_plain.py``, which knows nothing of the launcher) and ``input.txt`` to train on."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(EXAMPLES / "ddp_plain.py", project)
    shutil.copy(text, project / "input.txt")
    return project


PLAIN_ARGS = ["ddp_plain.py", "--data", "input.txt", "--steps", "30", "--out", "out"]  # in plain_project


def frozen_until_ended(job_dir: Path, pid: int, timeout_s: float) -> JobStatus | None:
    """Freeze process ``pid`` of a local job (SIGSTOP) and wait up to ``timeout_s`` seconds for the job
    to end: its status (None if it did not end). The process is thawed if the job left it behind."""
    os.kill(pid, signal.SIGSTOP)
    try:
        return wait_terminal(LocalScheduler().state, JobRecord(job_dir), timeout_s, poll_s=0.2)
    finally:
        if processes_of(job_dir.name):
            os.kill(pid, signal.SIGCONT)


# The Docker engine's fixtures, for every test module (after run and launcher, which they use).
from tests.integration.engine import (  # noqa: E402, F401
    CA_CANARY,
    SYSTEM_CA,
    TAG,
    ca_bundle,
    cpu_image,
    docker,
    engine,
)
