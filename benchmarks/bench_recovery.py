"""How long a retried job loses to one failure: from SIGKILL of a rank to the next attempt's first
step, and on to the step the failed attempt had reached, split into its parts.

Each round: a local 2-node job (tiny preset, one thread per rank) with ``--retries 1``, a checkpoint
every ``--checkpoint-interval`` steps; once both ranks are past ``--kill-step``, rank 1 is killed
with SIGKILL. From the attempt record (``JOB/attempts/1/attempt.json``) and the heartbeats of the next
attempt:

- detection: the kill → the supervisor knows the attempt failed (torchrun reports the dead worker);
- teardown: → every process of the attempt is gone and the next nodes are chosen;
- backoff: the wait before the next attempt (none before the first retry: ``launcher.job.retry``);
- start-up: → the next attempt's first step is done (interpreter, data, rendezvous, resume from the
  checkpoint);
- recompute: → the next attempt is back at the step the failed one had reached (the steps since the
  checkpoint, redone).

With ``--scheduler ssh``: the same over the SSH dev hosts (``deploy/ssh/dev-hosts.sh``, network
namespaces of this machine that share its files but for a node-local disk): the job runs on the first
two of ``--hosts N`` hosts, rank 1 is killed on the second and the retry runs on a spare. The ranks
beat on their hosts, in each host agent's state dir (``launcher.agent``), read here through the dev
hosts' node-local disks; teardown then also holds fetching the hosts' last beats over ssh and checking
the spare as a submit does (``SshAgents.renew``).

With ``--cold-spare`` (ssh): the spare shares nothing with the failed host. The run dir, the data
dir and the compile caches (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``) are on each host's own
disk, fresh each round: the spare has compiled nothing and holds nothing of the job but what the
launcher copies there (the checkpoint copy, with the compile artifacts of ``trainer.compile_cache``);
its data is prepared there at its start.

With ``--warm on`` or ``--warm both``: the job runs with ``--warm-workers`` (``both``: rounds
alternate, cold then warm). On ssh each host's zygote is waited for before the kill, as a long job's
are ready long before a failure.

With ``--gpu``: one node with one GPU (two ranks cannot share a GPU under NCCL), ``--preset``
(default gpt2) compiled, bf16; rank 0 is the one killed. Start-up then holds ``torch.compile``'s
compile (from Inductor's on-disk cache on the retry).

With ``--compile``: the CPU rounds (and the goodput run) with the trainer's default, ``torch.compile``
on, instead of ``--no-compile``: start-up then holds the compile, its artifacts loaded from the run dir
(``trainer.compile_cache``) on the retry.

With ``--goodput-minutes M``: instead, one local 2-node job with the trainer's default checkpoint
and evaluation intervals (and the launcher's default for warm workers unless ``--warm`` says) runs
for M minutes with rank 1 SIGKILLed every ``--kill-every-s`` seconds; its goodput (``launcher
status``: ``launcher.job.goodput``) is read at the end, then it is cancelled.

Usage: ``python benchmarks/bench_recovery.py [--rounds N] [--retry-backoff-s S] [--kill-step K]
[--scheduler ssh [--hosts N] [--cold-spare]] [--warm on|both] [--compile] [--gpu [--preset P]]``,
``python benchmarks/bench_recovery.py --goodput-minutes 20 [--kill-every-s 300] [--compile]``.
Progress goes to stderr, Markdown to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import forget_own_disk, own_disk, text_files
from procs import BenchError, child_env, log

from gptlaunch.contract import Beat, read_beats
from launcher.job import startup
from launcher.job.logs import wait_terminal
from launcher.job.record import Attempt, JobRecord
from launcher.job.retry import backoff_s
from launcher.schedulers.local.scheduler import LocalScheduler
from launcher.schedulers.ssh.scheduler import SshScheduler

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("detection", "teardown", "backoff", "start-up", "recompute")
DEV_HOSTS = 8  # brought up as the integration tests do: a smaller count would remove hosts others use


def _beats(args: argparse.Namespace, job_dir: Path) -> list[Beat]:
    """The nodes' ranks' latest beats: in the job record (local), or on the hosts of the current
    plan (ssh: host H's ``XDG_STATE_HOME`` is ``STATE/local/state`` there, ``STATE/hosts/H/local/state``
    here)."""
    if args.scheduler == "local":
        return [b for k in range(args.nodes) for b in read_beats(job_dir / "heartbeat" / f"node-{k}")]
    jobs = Path("local", "state", "gptlaunch", "jobs", job_dir.name)
    nodes = JobRecord(job_dir).plan().nodes
    where = [args.state / "hosts" / n.host / jobs / f"node-{n.node_rank}.heartbeat" for n in nodes]
    return [b for d in where for b in read_beats(d)]


def _scheduler_flags(args: argparse.Namespace, tmp: Path) -> list[str]:
    """The submit's scheduler flags: none (local), or the first ``args.hosts`` dev hosts (ssh)."""
    if args.scheduler == "local":
        return []
    up = subprocess.run(
        ["bash", str(ROOT / "deploy/ssh/dev-hosts.sh"), "up", "--hosts", str(max(args.hosts, DEV_HOSTS))],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    every = Path(up.stdout.split()[-1])
    args.state = every.parent
    lines = [line for line in every.read_text().splitlines() if line and not line.startswith("#")]
    hostfile = tmp / "hostfile"
    hostfile.write_text("\n".join(lines[: args.hosts]) + "\n")
    return ["--scheduler", "ssh", "--hostfile", str(hostfile), "--omp-num-threads", "1"]


def _until(what: str, found: Callable[[], object], timeout_s: float = 600) -> None:
    """Poll ``found()`` every 50 ms until true."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found():
            return
        time.sleep(0.05)
    raise BenchError(f"{what}: not within {timeout_s:.0f} s")


def _trainer_flags(args: argparse.Namespace) -> list[str]:
    """The model's flags: the tiny preset on the CPU, eager unless ``--compile``; or (``--gpu``)
    ``args.preset`` compiled."""
    if args.gpu:
        return ["--preset", args.preset]
    return ["--preset", "tiny", *([] if args.compile else ["--no-compile"])]


def _cache_flags(place: Path) -> list[str]:
    """The submit's ``--env`` flags that put the compile caches under ``place`` (``--cold-spare``)."""
    caches = {"TORCHINDUCTOR_CACHE_DIR": place / "inductor", "TRITON_CACHE_DIR": place / "triton"}
    return [f for key, path in caches.items() for f in ("--env", f"{key}={path}")]


def one_round(args: argparse.Namespace, tmp: Path, k: int, warm: bool = False) -> dict[str, float]:
    """The parts of one failure's cost, in seconds; ``warm``: with ``--warm-workers``."""
    jobs = tmp / f"jobs-{k}-{'warm' if warm else 'cold'}"
    gpus = ["--gpus-per-node", "1"] if args.gpu else []
    gpus += ["--warm-workers" if warm else "--no-warm-workers"]
    place, caches = tmp, []  # type: Path, list[str]
    scheduler_flags = _scheduler_flags(args, tmp)
    if args.cold_spare:  # the run dir, data and compile caches on each host's own disk
        place = own_disk(args.state, f"{tmp.name}-{jobs.name}")
        caches = _cache_flags(place)
    cmd = [
        sys.executable, "-m", "launcher.cli.main", "--jobs-root", str(jobs), "submit", "--detach",
        *scheduler_flags, *caches, "--nodes", str(args.nodes), *gpus, "--retries", "1",
        "--retry-backoff-s", f"{args.retry_backoff_s:g}", "--",
        "--text-files", *map(str, args.text_files), "--data-dir", str(place / "data"), *_trainer_flags(args),
        "--max-steps", str(args.kill_step * 4), "--log-interval", "1",
        "--checkpoint-interval", str(args.checkpoint_interval), "--eval-interval", "1000000",
        "--run-dir", str(place / "run" if args.cold_spare else jobs / "run"),
    ]  # fmt: skip
    try:
        return _measure(args, cmd, jobs, k, warm)
    finally:
        if args.cold_spare:
            forget_own_disk(args.state, place)


def _measure(args: argparse.Namespace, cmd: list[str], jobs: Path, k: int, warm: bool) -> dict[str, float]:
    """Submits ``cmd`` (its jobs root: ``jobs``), kills rank 1 past the kill step and times the retry
    (``one_round``)."""
    out = subprocess.run(cmd, env=child_env(1), capture_output=True, text=True, timeout=600, cwd=ROOT)
    if out.returncode != 0:
        raise BenchError(f"submit failed: {out.stderr[-2000:]}")
    job_dir = jobs / out.stdout.strip().splitlines()[-1]
    _until(
        "the kill step",
        lambda: len(b := _beats(args, job_dir)) == args.nodes and min(x.step for x in b) >= args.kill_step,
    )
    if warm and args.scheduler == "ssh":  # a long job's zygotes are ready long before a failure
        _until("every host's zygote ready", lambda: _zygotes_ready(job_dir) == args.hosts)
    victim = next(b for b in _beats(args, job_dir) if b.rank == args.nodes - 1)
    killed = time.time()
    os.kill(victim.pid, signal.SIGKILL)
    attempt_file = job_dir / "attempts" / "1" / "attempt.json"
    _until("attempt 1 archived", attempt_file.is_file)
    attempt = Attempt.model_validate_json(attempt_file.read_text())
    if attempt.cleaned_at is None or attempt.step is None:
        raise BenchError(f"{attempt_file}: no cleanup time or step")
    first: list[float] = []
    reached: list[float] = []
    started_beats: list[Beat] = []

    def stepped() -> bool:  # the next attempt's beats only (ssh: the plan names the spare a bit later)
        beats = [b for b in _beats(args, job_dir) if b.time > attempt.cleaned_at]
        if len(beats) == args.nodes and all(b.phase == "step" for b in beats) and not first:
            first.append(max(b.time for b in beats))
            started_beats.extend(beats)  # their start-up's parts (``runtime.starting``)
        if first and len(beats) == args.nodes and min(b.step for b in beats) >= attempt.step:
            reached.append(max(b.time for b in beats))
        return bool(reached)

    _until("attempt 2 back at the failed step", stepped)
    state = SshScheduler().state if args.scheduler == "ssh" else LocalScheduler().state
    status = wait_terminal(state, JobRecord(job_dir), 600, poll_s=0.2)
    if status is None or status.state != "succeeded":
        raise BenchError(f"{job_dir}: did not succeed: {status}")
    backoff = backoff_s(args.retry_backoff_s, [attempt])  # the job's only failure: none
    restart = attempt.cleaned_at + backoff
    parts = {
        "detection": attempt.ended_at - killed,
        "teardown": attempt.cleaned_at - attempt.ended_at,
        "backoff": backoff,
        "start-up": first[0] - restart,
        "recompute": reached[0] - first[0],
    }
    said = ", ".join(f"{p} {v:.1f} s" for p, v in parts.items())
    mode = " (warm workers)" if warm else ""
    log(f"round {k + 1}{mode}: {said} (killed at step {attempt.step}, resumed at {_resumed_at(job_dir)})")
    if (beat := next((b for b in started_beats if b.rank == 0), None)) and status.attempt_started_at:
        log(f"  the retry's {startup.first_step(startup.parts(beat, status.attempt_started_at), 2)}")
    return parts


def _zygotes_ready(job_dir: Path) -> int:
    """How many hosts' zygotes (``--warm-workers`` on ssh: ``warm-HOST.log``) said they are ready."""
    return sum("ready on" in log.read_text(errors="replace") for log in job_dir.glob("warm-*.log"))


def _resumed_at(job_dir: Path) -> str:
    """The trainer's own line saying where the retry resumed from (rank 0's, on either node)."""
    lines = [
        line
        for log in sorted(job_dir.glob("node-*.log"))
        for line in log.read_text(errors="replace").splitlines()
    ]
    return next((line.strip() for line in lines if "resumed from" in line), "?")


def goodput_run(args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    """The goodput of one long job with a rank killed every ``args.kill_every_s`` seconds."""
    jobs = tmp / "jobs"
    minutes = args.goodput_minutes
    cmd = [
        sys.executable, "-m", "launcher.cli.main", "--jobs-root", str(jobs), "submit", "--detach",
        "--nodes", "2", *_warm_flag(args.warm), "--retries", "100",
        "--retry-backoff-s", f"{args.retry_backoff_s:g}", "--",
        "--text-files", *map(str, args.text_files), "--data-dir", str(tmp / "data"), *_trainer_flags(args),
        "--max-steps", "100000000", "--run-dir", str(tmp / "run"),
    ]  # fmt: skip
    out = subprocess.run(cmd, env=child_env(1), capture_output=True, text=True, timeout=600, cwd=ROOT)
    if out.returncode != 0:
        raise BenchError(f"submit failed: {out.stderr[-2000:]}")
    job = out.stdout.strip().splitlines()[-1]
    job_dir = jobs / job
    started = time.monotonic()
    kills = 0
    while time.monotonic() - started < minutes * 60:
        time.sleep(1)
        due = int((time.monotonic() - started) // args.kill_every_s)
        beats = _beats(args, job_dir)
        if due > kills and len(beats) == 2 and all(b.phase == "step" for b in beats):
            os.kill(next(b.pid for b in beats if b.rank == 1), signal.SIGKILL)
            kills += 1
            log(f"{time.monotonic() - started:.0f} s: rank 1 killed ({kills})")
    status = [sys.executable, "-m", "launcher.cli.main", "--jobs-root", str(jobs), "status"]
    text = subprocess.run([*status, job], capture_output=True, text=True, cwd=ROOT).stdout
    data = json.loads(
        subprocess.run([*status, "--json", job], capture_output=True, text=True, cwd=ROOT).stdout
    )
    subprocess.run([*status[:-1], "cancel", job], capture_output=True, text=True, cwd=ROOT, timeout=300)
    log(text)
    return dict(data["goodput"])


def _warm_flag(warm: str | None) -> list[str]:
    """The goodput job's warm-workers flag: none (the launcher's default) unless ``--warm`` gave one."""
    return {"on": ["--warm-workers"], "off": ["--no-warm-workers"]}.get(warm or "", [])


def _print_goodput(args: argparse.Namespace, g: dict[str, float]) -> None:
    print("| part | seconds | share |\n| --- | ---: | ---: |")
    for key in ("training_s", "startup_s", "lost_s", "checkpoint_s", "eval_s", "other_s"):
        print(f"| {key[:-2]} | {g[key]:.0f} | {g[key] / g['wall_s']:.1%} |")
    print(
        f"\n**goodput {g['ratio']:.1%}** over {g['wall_s']:.0f} s with {g['failures']:.0f} failures (rank 1 "
        f"SIGKILLed every {args.kill_every_s:g} s), `--retry-backoff-s {args.retry_backoff_s:g}`; "
        f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} · `python benchmarks/bench_recovery.py "
        f"--goodput-minutes {args.goodput_minutes:g} --kill-every-s {args.kill_every_s:g}"
        f"{f' --warm {args.warm}' if args.warm else ''}{' --compile' if args.compile else ''}`"
    )


def _over(args: argparse.Namespace) -> str:
    """The flags that set this run apart, for the line that says how to run it again."""
    flags = f" --scheduler ssh --hosts {args.hosts}" if args.scheduler == "ssh" else ""
    flags += f" --gpu --preset {args.preset}" if args.gpu else ""
    flags += " --compile" if args.compile and not args.gpu else ""
    flags += " --cold-spare" if args.cold_spare else ""
    flags += f" --warm {args.warm}" if args.warm not in (None, "off") else ""
    default = 20  # --checkpoint-interval's
    return flags + (
        f" --checkpoint-interval {args.checkpoint_interval}" if args.checkpoint_interval != default else ""
    )


def _table(rounds: dict[bool, list[dict[str, float]]]) -> list[str]:
    """Markdown: each part's median and range, a column per mode (cold, warm), and warm/cold."""
    names = {False: "cold workers", True: "warm workers"}
    head = " | ".join(f"{names[w]}: seconds (median) | range" for w in rounds)
    both = len(rounds) == 2
    rows = [f"| part | {head} |{' warm / cold |' if both else ''}", "| --- |" + " ---: | --- |" * len(rounds)]
    rows[-1] += " ---: |" if both else ""
    for part in (*PARTS, "total"):
        cells, medians = [], []
        for results in rounds.values():
            values = [sum(r.values()) if part == "total" else r[part] for r in results]
            medians.append(statistics.median(values))
            cells.append(f"{medians[-1]:.1f} | {min(values):.1f}–{max(values):.1f}")
        shown = both and min(medians) >= 0.05  # a ratio of two zeros as printed says nothing
        ratio = f" {medians[1] / medians[0]:.2f} |" if shown else (" – |" if both else "")
        rows.append(f"| {part} | {' | '.join(cells)} |{ratio}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--retry-backoff-s", type=float, default=10.0)
    p.add_argument("--kill-step", type=int, default=25, help="kill rank 1 once both ranks are past it")
    p.add_argument("--checkpoint-interval", type=int, default=20)
    p.add_argument("--goodput-minutes", type=float, help="measure goodput over one job this long instead")
    p.add_argument("--kill-every-s", type=float, default=300.0)
    p.add_argument("--text-files", nargs="+", help="input text (default: WikiText-2 valid.txt in ../shared)")
    p.add_argument("--scheduler", choices=("local", "ssh"), default="local")
    p.add_argument("--hosts", type=int, default=3, help="ssh: dev hosts in the hostfile, 2 nodes + spares")
    p.add_argument("--gpu", action="store_true", help="one node with one GPU, the model compiled")
    p.add_argument("--compile", action="store_true", help="CPU: the trainer's default, torch.compile on")
    p.add_argument("--cold-spare", action="store_true",
                   help="ssh: run dir, data and compile caches on each host's own disk")  # fmt: skip
    p.add_argument("--preset", default="gpt2", help="--gpu: the model's preset")
    p.add_argument("--warm", choices=("off", "on", "both"),
                   help="--warm-workers: off (the rounds' default), on, or both, alternating round by "
                   "round; the goodput run's default: the launcher's")  # fmt: skip
    args = p.parse_args(argv)
    args.nodes = 1 if args.gpu else 2
    if args.goodput_minutes and args.warm == "both":
        p.error("--goodput-minutes measures one job: --warm on or off")
    if args.gpu and (args.scheduler != "local" or args.goodput_minutes):
        p.error("--gpu measures rounds on the local scheduler only")
    args.text_files = text_files(args.text_files, p)
    if args.cold_spare and args.scheduler != "ssh":
        p.error("--cold-spare needs --scheduler ssh (hosts with disks of their own)")
    if args.scheduler == "ssh" and (args.goodput_minutes or not 3 <= args.hosts <= 16):
        p.error("--scheduler ssh measures rounds only, with --hosts 3 to 16 (2 nodes and a spare)")
    started = time.monotonic()
    if args.goodput_minutes:
        try:
            with tempfile.TemporaryDirectory(prefix="bench_recovery-") as tmp:
                _print_goodput(args, goodput_run(args, Path(tmp)))
        except BenchError as e:
            print(f"bench: error: {e}", file=sys.stderr, flush=True)
            return 1
        return 0
    try:
        with tempfile.TemporaryDirectory(prefix="bench_recovery-") as tmp:
            modes = {"off": [False], "on": [True], "both": [False, True]}[args.warm or "off"]
            rounds = {w: [] for w in modes}  # type: dict[bool, list[dict[str, float]]]
            for k in range(args.rounds):  # side by side: cold and warm alternate
                for warm in modes:
                    rounds[warm].append(one_round(args, Path(tmp), k, warm))
    except BenchError as e:
        print(f"bench: error: {e}", file=sys.stderr, flush=True)
        return 1
    print("\n".join(_table(rounds)))
    print(
        f"\n{args.rounds} rounds, rank {args.nodes - 1} SIGKILLed past step {args.kill_step}, a checkpoint "
        f"every {args.checkpoint_interval} steps, `--retry-backoff-s {args.retry_backoff_s:g}`; "
        f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}, total {time.monotonic() - started:.0f} s · "
        f"`python benchmarks/bench_recovery.py{_over(args)}`"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
