"""A retry's first step on a host that never compiled the model: with and without the compile
artifacts that the first attempt left in the run dir (``trainer.compile_cache``), side by side.

Each round runs ``trainer train`` twice as one process (no launcher), each with a fresh, empty Inductor
cache (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``: a spare host's), into a new run dir:

- cold: no artifacts there: it compiles everything, then saves the artifacts (their cost is read from
  its lines: serialized on the loop, written on a thread);
- with artifacts: the same run dir again (``--resume never``: the same work, nothing resumed), where
  the cold run's ``compile-cache/`` now is.

The time is from the start of the process to its ``step 1/`` line (start-up, compile, the first step);
the CPU seconds are those of the whole process and its compilers (g++), less skewed by other load.
Medians over ``--rounds``; the foreign CPU load during each run is printed (rerun if it is more than a
few percent).

Usage: ``python benchmarks/bench_compile_cache.py [--rounds 5] [--shape test|tiny] [--compile-mode auto]``.
Progress to stderr, Markdown to stdout.
"""

from __future__ import annotations

import argparse
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import add_run_flags, text_files
from procs import CpuSample, child_env, cpu_model, log, wait_for_quiet

SHAPES = {
    # tests/integration/test_compile_cache.py's model: the smallest that compiles every kernel kind
    "test": ["--n-layer", "1", "--n-head", "2", "--d-model", "64", "--block-size", "64",
             "--micro-batch-size", "4"],
    "tiny": ["--preset", "tiny"],
}  # fmt: skip
SERIALIZED = re.compile(r"([\d.]+) MB, serialized in ([\d.]+) ms")
WRITTEN = re.compile(r"written in (\d+) ms")


def _cpu_s() -> float:
    """CPU seconds of this process's waited-for descendants: a trainer and its compilers (g++)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _first_step(argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[float, float, str, float]:
    """Run ``argv`` to its end: (seconds from its start to its ``step 1/`` line, the CPU seconds it
    and its children used in all, its output, the foreign CPU load meanwhile). Exits naming the
    output on a failure."""
    before, cpu = CpuSample.now(), _cpu_s()
    started = time.perf_counter()
    first = None
    out = []
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        if first is None and line.startswith("step 1/"):
            first = time.perf_counter() - started
        if time.perf_counter() - started > timeout_s:
            proc.kill()
    proc.wait()
    text = "".join(out)
    if proc.returncode != 0 or first is None:
        raise SystemExit(f"bench: {argv} exited {proc.returncode}:\n{text[-3000:]}")
    return first, _cpu_s() - cpu, text, CpuSample.now().other_load(before)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shape", choices=sorted(SHAPES), default="test")
    p.add_argument("--compile-mode", default="auto", help="the trainer's --compile-mode (default: auto)")
    add_run_flags(p, timeout_s=600, quiet_wait_s=20)
    a = p.parse_args()
    texts = text_files(a.text_files, p)
    env = child_env()
    wall: dict[str, list[float]] = {"cold": [], "warm": []}  # to the first step, s
    cpu: dict[str, list[float]] = {"cold": [], "warm": []}  # in all, s
    saves: list[tuple[float, float, float]] = []  # (MB, serialized ms, written ms)
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp_name:
        tmp = Path(tmp_name)
        data = ["--text-files", *map(str, texts), "--data-dir", str(tmp / "data")]
        prepare = [sys.executable, "-m", "trainer.cli", "prepare", *data]
        subprocess.run(prepare, env=env, check=True, stdout=sys.stderr)  # stdout: the Markdown alone
        for k in range(a.rounds):
            run_dir = tmp / f"run-{k}"
            argv = [sys.executable, "-m", "trainer.cli", "train", *data, *SHAPES[a.shape],
                    "--compile-mode", a.compile_mode, "--run-dir", str(run_dir), "--max-steps", "2",
                    "--eval-iters", "1", "--log-interval", "1", "--peak-flops", "1e12",
                    "--resume", "never"]  # fmt: skip
            for name in ("cold", "warm"):
                caches = tmp / f"caches-{k}-{name}"  # a spare host's: nothing compiled there yet
                fresh = {
                    "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
                    "TRITON_CACHE_DIR": str(caches / "triton"),
                }
                wait_for_quiet(a.quiet_wait, a.quiet_load)
                took, cpu_s, text, load = _first_step(argv, env | fresh, a.timeout)
                wall[name].append(took)
                cpu[name].append(cpu_s)
                if name == "cold":
                    mb, ms = SERIALIZED.search(text).groups()  # type: ignore[union-attr]
                    written = WRITTEN.search(text).group(1)  # type: ignore[union-attr]
                    saves.append((float(mb), float(ms), float(written)))
                elif "loaded cached artifacts" not in text:
                    raise SystemExit(f"bench: the second run did not load the artifacts:\n{text[-3000:]}")
                log(f"round {k + 1} {name}: first step at {took:.1f} s, {cpu_s:.1f} CPU s (load {load:.0%})")
    _report(a, wall, cpu, saves)
    return 0


def _report(
    a: argparse.Namespace,
    wall: dict[str, list[float]],
    cpu: dict[str, list[float]],
    saves: list[tuple[float, float, float]],
) -> None:
    """The Markdown table and its line of ratios, save cost and command."""
    med = statistics.median

    def cells(xs: list[float]) -> str:
        return f"{med(xs):.1f} | {min(xs):.1f}–{max(xs):.1f}"

    print("| cold Inductor cache | to the first step, s (median) | range | CPU s in all (median) | range |")
    print("| --- | ---: | --- | ---: | --- |")
    for name, label in (("cold", "no artifacts: compiles"), ("warm", "artifacts in the run dir")):
        print(f"| {label} | {cells(wall[name])} | {cells(cpu[name])} |")

    def ratios(xs: dict[str, list[float]]) -> str:
        each = [w / c for c, w in zip(xs["cold"], xs["warm"], strict=True)]
        return f"{min(each):.2f}–{max(each):.2f}"

    mb, ms, written = (med(x) for x in zip(*saves, strict=True))
    print(
        f"\nwith / without = **{med(wall['warm']) / med(wall['cold']):.2f}** (per round {ratios(wall)}; "
        f"CPU seconds {ratios(cpu)}); the save: {mb:.1f} MB, serialized in {ms:.1f} ms on the loop, "
        f"written in {written:.0f} ms on a thread (medians of {a.rounds}). {cpu_model()}, "
        f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} · `python benchmarks/bench_compile_cache.py "
        f"--rounds {a.rounds} --shape {a.shape} --compile-mode {a.compile_mode}`"
    )


if __name__ == "__main__":
    sys.exit(main())
