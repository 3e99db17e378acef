"""Launcher overhead: wall time of ``launcher submit`` running a 2-node, 2-step local job vs two bare
torchrun agents running the very same per-node commands, measured side by side.

(a) ``launcher --jobs-root TMP submit --nodes 2 --gpus-per-node 1 -- TRAINER_ARGS`` (attached, the
    default mode), from process start to exit.
(b) the two per-node commands (argv, env, cwd) that ``launcher render --json`` prints for the same
    arguments, rendered before the clock starts, then started at the same moment; until both have exited.

Pairs alternate their order ((a, b), then (b, a), ...) so that neither side always runs first. Per
round, the ratio is median(a) / median(b) (target <= 1.05); overall, the medians over all pairs. Every
run gets a fresh run dir (nothing resumes) and must exit 0 and leave ``ckpt-00000002.pt``, or the
benchmark stops. Data is prepared once up front, so tokenizer training is never timed. Before each run
the benchmark waits a little for other processes to go quiet (``--quiet-wait``) and records how much CPU
they took during the run.

Usage: ``python benchmarks/bench_launcher.py [--pairs N] [--rounds R]``. Progress goes to stderr, the
Markdown table to stdout. Exit code 1 when a run fails (its output tail is shown), 2 for bad arguments
or missing input text.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from common import add_run_flags, text_files
from procs import (
    BenchError,
    CpuSample,
    available_cores,
    become_subreaper,
    child_env,
    cpu_model,
    log,
    reap_orphans,
    run_process,
    start_process,
    wait_all,
    wait_for_quiet,
)

NODES = 2
MAX_STEPS = 2
CHECKPOINT = f"ckpt-{MAX_STEPS:08d}.pt"  # the trainer's final checkpoint: proof the job really trained
# The tiny preset without torch.compile keeps a 2-step, 2-rank run near 12 s on 2 cores, so the fixed
# cost of process start-up, rendezvous and the final checkpoint is what is compared.
TRAINER_FLAGS = ("--preset", "tiny", "--max-steps", str(MAX_STEPS), "--no-compile")
TARGET = 1.05
Start = tuple[list[str], dict[str, str], Path, Path]  # argv, env, output log, working directory


@dataclass(frozen=True)
class Settings:
    """What every run shares."""

    text_files: tuple[Path, ...]
    work_dir: Path  # data, job records, run dirs and logs; also the launcher's working directory
    timeout_s: float  # per run, seconds
    quiet_wait_s: float  # before each run, wait up to this many seconds for other processes to calm down
    quiet_load: float  # ... until they use at most this fraction of the CPUs

    @property
    def data_dir(self) -> Path:
        return self.work_dir / "data"


@dataclass(frozen=True)
class Run:
    """One timed run of one side."""

    wall_s: float  # first process start to last process exit
    lingering_s: float  # how long processes it left behind (re-parented to us) still ran after that
    other_load: float  # CPU used by processes outside the benchmark during the run, fraction of all cores


@dataclass
class Round:
    """The pairs of one round."""

    launcher: list[Run] = field(default_factory=list)  # (a)
    bare: list[Run] = field(default_factory=list)  # (b)

    @property
    def ratio(self) -> float:
        return median_wall(self.launcher) / median_wall(self.bare)


def median_wall(runs: Sequence[Run]) -> float:
    return statistics.median(r.wall_s for r in runs)


def trainer_args(settings: Settings, run_dir: Path) -> list[str]:
    """``trainer train`` arguments of one run; the same text and data dir make it reuse the prepared data."""
    files = [str(p) for p in settings.text_files]
    data = ["--text-files", *files, "--data-dir", str(settings.data_dir)]
    return [*data, *TRAINER_FLAGS, "--run-dir", str(run_dir)]


def launcher_command(settings: Settings, *args: str) -> list[str]:
    """A ``launcher`` command line with its job records under the work dir (never ./jobs)."""
    jobs_root = str(settings.work_dir / "jobs")
    return [sys.executable, "-m", "launcher.cli.main", "--jobs-root", jobs_root, *args]


def cluster_flags() -> list[str]:
    return ["--nodes", str(NODES), "--gpus-per-node", "1"]


def prepare(settings: Settings) -> None:
    """Tokenize the text once into the data dir (never timed)."""
    files = [str(p) for p in settings.text_files]
    cmd = [sys.executable, "-m", "trainer.cli", "prepare", "--text-files", *files]
    cmd += ["--data-dir", str(settings.data_dir)]
    start = run_process(cmd, child_env(), settings.work_dir / "prepare.log", 3600)
    log(f"prepared data in {time.perf_counter() - start.t:.1f} s: {settings.data_dir}")


def render_nodes(settings: Settings, run_dir: Path) -> list[dict[str, Any]]:
    """The per-node commands ``launcher render --json`` prints (each render picks a fresh free
    rendezvous port, so no two runs share one)."""
    args = ["render", "--json", *cluster_flags(), "--", *trainer_args(settings, run_dir)]
    cmd = launcher_command(settings, *args)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=settings.work_dir)
    if proc.returncode != 0:
        msg = f"exit code {proc.returncode}: {shlex.join(cmd)}\n--- stderr ---\n{proc.stderr[-4000:]}"
        raise BenchError(f"launcher render failed: {msg}")
    try:
        nodes: list[dict[str, Any]] = json.loads(proc.stdout)["nodes"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise BenchError(
            f"launcher render --json printed no plan with nodes ({e}): {shlex.join(cmd)}"
        ) from None
    if len(nodes) != NODES:
        raise BenchError(f"launcher render printed {len(nodes)} nodes, expected {NODES}: {shlex.join(cmd)}")
    return nodes


def timed(side: str, starts: Sequence[Start], settings: Settings, run_dir: Path) -> Run:
    """Start every (argv, env, log, cwd) at once and wait for all; the clock covers only that. Then
    check that the job trained and delete its run dir."""
    if settings.quiet_wait_s > 0:
        wait_for_quiet(settings.quiet_wait_s, settings.quiet_load)
    logs = [s[2] for s in starts]
    before = CpuSample.now()
    try:
        procs = [start_process(cmd, env, log_path, cwd) for cmd, env, log_path, cwd in starts]
        wait_all(procs, logs, settings.timeout_s)
        exited = time.perf_counter()
        # The clock stops at exit, as a user sees it; the CPU sample waits for whatever is left.
        lingering_s = reap_orphans(settings.timeout_s)
    except BenchError as e:
        raise BenchError(f"{side}: {e}") from None
    after = CpuSample.now()
    # Exit code 0 is not enough: a job that skipped training must not count as a fast one.
    if not (run_dir / CHECKPOINT).is_file():
        logs_shown = ", ".join(map(str, logs))
        raise BenchError(f"{side}: exited 0 but {run_dir / CHECKPOINT} does not exist; logs: {logs_shown}")
    shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints are large; the times are all we keep
    return Run(exited - before.t, lingering_s, after.other_load(before))


def measure_launcher(settings: Settings, pair: int) -> Run:
    """(a) ``launcher submit``, attached, from process start to exit."""
    run_dir = settings.work_dir / "runs" / f"launcher-{pair}"
    args = ["submit", *cluster_flags(), "--", *trainer_args(settings, run_dir)]
    log_path = settings.work_dir / "logs" / f"launcher-{pair}.log"
    # The launcher gets the environment the bare agents start from, so only the launcher differs.
    start = (launcher_command(settings, *args), child_env(), log_path, settings.work_dir)
    return timed("(a) launcher submit", [start], settings, run_dir)


def measure_bare(settings: Settings, pair: int) -> Run:
    """(b) the rendered per-node torchrun commands, started together, until both have exited."""
    run_dir = settings.work_dir / "runs" / f"bare-{pair}"
    nodes = render_nodes(settings, run_dir)
    logs = [settings.work_dir / "logs" / f"bare-{pair}-node{k}.log" for k in range(NODES)]
    starts = [
        (node["argv"], child_env() | node["env"], log_path, settings.work_dir / node["cwd"])
        for node, log_path in zip(nodes, logs, strict=True)
    ]
    return timed("(b) bare torchrun agents", starts, settings, run_dir)


def run_pair(settings: Settings, pair: int) -> tuple[Run, Run]:
    """(a) and (b), (a) first in even pairs and (b) first in odd ones, so that a side running first on
    a warmer or colder machine does not favour it."""
    if pair % 2 == 0:
        a = measure_launcher(settings, pair)
        return a, measure_bare(settings, pair)
    b = measure_bare(settings, pair)
    return measure_launcher(settings, pair), b


def run_rounds(settings: Settings, rounds: int, pairs: int) -> list[Round]:
    """``rounds`` × ``pairs`` pairs, alternating which side runs first from one pair to the next."""
    results = []
    for r in range(rounds):
        rnd = Round()
        for p in range(pairs):
            pair = r * pairs + p
            a, b = run_pair(settings, pair)
            rnd.launcher.append(a)
            rnd.bare.append(b)
            log(
                f"round {r + 1}/{rounds} pair {p + 1}/{pairs} ({'a, b' if pair % 2 == 0 else 'b, a'}): "
                f"launcher {a.wall_s:.2f} s, bare {b.wall_s:.2f} s ({a.wall_s / b.wall_s:.3f}×); "
                f"left running after exit {a.lingering_s:.2f} s / {b.lingering_s:.2f} s; "
                f"other processes {a.other_load:.0%} / {b.other_load:.0%} of the CPUs"
            )
        results.append(rnd)
    return results


def load_cell(runs: Sequence[Run]) -> str:
    loads = [r.other_load for r in runs]
    return f"{statistics.fmean(loads):.0%} / {max(loads):.0%}"


def lingering_cell(a: Sequence[Run], b: Sequence[Run]) -> str:
    return f"{max(r.lingering_s for r in a):.2f} s / {max(r.lingering_s for r in b):.2f} s"


def verdict(ratio: float) -> str:
    return f"target ≤ {TARGET:.2f}×: {'met' if ratio <= TARGET else 'NOT met'}"


def markdown(rounds: list[Round], meta: dict[str, Any]) -> str:
    """The result table and its context lines, as Markdown."""
    lines = [
        "| round | (a) `launcher submit` | (b) 2 bare torchrun agents | ratio a/b "
        "| left running after exit, max (a / b) | other processes (mean / max) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for i, rnd in enumerate(rounds, 1):
        lines.append(
            f"| {i} | {median_wall(rnd.launcher):.2f} s | {median_wall(rnd.bare):.2f} s | "
            f"{rnd.ratio:.3f}× | {lingering_cell(rnd.launcher, rnd.bare)} | "
            f"{load_cell(rnd.launcher + rnd.bare)} |"
        )
    all_a = [run for rnd in rounds for run in rnd.launcher]
    all_b = [run for rnd in rounds for run in rnd.bare]
    overall = median_wall(all_a) / median_wall(all_b)
    ratios = [rnd.ratio for rnd in rounds]
    lines += [
        f"| all | {median_wall(all_a):.2f} s | {median_wall(all_b):.2f} s | **{overall:.3f}×** | "
        f"{lingering_cell(all_a, all_b)} | {load_cell(all_a + all_b)} |",
        "",
        f"Overall ratio {overall:.3f}× (rounds {min(ratios):.3f}–{max(ratios):.3f}×; {verdict(overall)}). "
        f"Wall times are medians of {meta['pairs']} alternating pairs per round (all rounds in the last "
        f"row), each a {NODES}-node × 1-process, {MAX_STEPS}-step job from first process start to last "
        "exit; *left running after exit* is how long the job's processes outlived that exit (not in "
        f"the wall time). Trainer arguments on both sides: `{meta['trainer_args']}`. Other processes' CPU "
        "use is a fraction of all cores during the runs: if it is more than a few percent, rerun.",
        "",
        f"{meta['date']} · torch {meta['torch']} · {meta['cpu']} ({meta['cores']} cores) · "
        f"total {meta['wall_time_s']:.0f} s · `{meta['command']}`",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--pairs", type=int, default=5, help="alternating pairs per round (default: 5)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default: 3)")
    add_run_flags(p, timeout_s=600.0, quiet_wait_s=10.0)
    args = p.parse_args(argv)
    if min(args.pairs, args.rounds) < 1:
        p.error("--pairs and --rounds must be >= 1")
    args.text_files = text_files(args.text_files, p)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    if not become_subreaper():
        log("cannot become a child subreaper: CPU of processes nobody waits for counts as other processes")
    try:
        with tempfile.TemporaryDirectory(prefix="bench_launcher-") as tmp:
            work = Path(tmp)
            (work / "logs").mkdir()
            settings = Settings(args.text_files, work, args.timeout, args.quiet_wait, args.quiet_load)
            prepare(settings)
            rounds = run_rounds(settings, args.rounds, args.pairs)
            # Shown with placeholders: the temporary paths are gone when the table is printed.
            shown = replace(settings, work_dir=Path("TMP"))
            shown_args = shlex.join(trainer_args(shown, Path("TMP/runs/RUN")))
    except BenchError as e:
        print(f"bench: error: run failed: {e}", file=sys.stderr, flush=True)
        return 1
    meta = {
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": metadata.version("torch"),
        "cpu": cpu_model(),
        "cores": available_cores(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "pairs": args.pairs,
        "trainer_args": shown_args,
        "wall_time_s": time.perf_counter() - start,
    }
    print(markdown(rounds, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
