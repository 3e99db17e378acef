"""What the watch learns with no change to a program: its own compute per step (the forward clock of
the straggler check, ``gptlaunch.compute``) and where a resumed program starts (its optimizer's step
count). Real interpreters through ``gptlaunch.shim``, real DDP over gloo."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gptlaunch.compute import ForwardClock
from gptlaunch.contract import HEARTBEAT_DIR_ENV, JOB_ID_ENV, Beat, read_beats
from gptlaunch.stats import ratios_to_others
from launcher.job.progress import stragglers
from tests.unit.test_hang import _beat

FORWARD_S, OUTSIDE_S, EVAL_S, STEPS = 0.01, 0.05, 0.2, 5

TIMED = f"""
import time, torch
from gptlaunch import runtime

class Slow(torch.nn.Linear):
    delay = {FORWARD_S}
    def forward(self, x):
        time.sleep(self.delay)  # the rank's own compute
        return super().forward(x)

model = Slow(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range({STEPS}):
    model(torch.ones(1, 2)).sum().backward()
    time.sleep({OUTSIDE_S})  # outside the forward: a wait for peers, the data loader
    opt.step()
    with runtime.phase("eval"):  # evaluation's forwards are not training compute
        model.delay = {EVAL_S}
        model(torch.ones(1, 2))
        model.delay = {FORWARD_S}
"""


def _watched(tmp_path: Path, source: str, beats: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(source)
    env = os.environ | {JOB_ID_ENV: "j", HEARTBEAT_DIR_ENV: str(beats), "RANK": "0"}
    argv = [sys.executable, "-m", "gptlaunch.shim", str(script)]
    ran = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert ran.returncode == 0, ran.stderr


def test_the_beat_carries_the_forward_time_per_step_alone(tmp_path: Path) -> None:
    _watched(tmp_path, TIMED, tmp_path / "beats")
    [beat] = read_beats(tmp_path / "beats")
    assert beat.step == STEPS and beat.compute_s is not None
    # At least the forward's sleep; under the step's other wait, and under the mean an evaluation's
    # forward would add (EVAL_S / STEPS = 40 ms) if it were counted.
    assert FORWARD_S <= beat.compute_s < min(OUTSIDE_S, FORWARD_S + EVAL_S / STEPS), beat


DDP_PROBE = """
import json, os, sys
import torch, torch.distributed as dist
from torch.nn.modules import module as torch_module
from torch.nn.parallel import DistributedDataParallel
from gptlaunch.compute import ForwardClock

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
clock = ForwardClock()
clock.attach()
with torch.no_grad():
    torch.nn.Linear(2, 2)(torch.ones(1, 2))  # not training (a transform, an evaluation): passed by
frozen = torch.nn.Linear(2, 2).requires_grad_(False)
frozen(torch.ones(1, 2))  # nothing to train (a frozen encoder): passed by
inner = torch.nn.Linear(2, 1)
ddp = DistributedDataParallel(inner)
for _ in range(3):  # the first timed step (compilation, warm-up) is left out
    ddp(torch.ones(1, 2)).sum().backward()
    clock.step_done()
print(json.dumps({
    "inner": [len(inner._forward_pre_hooks), len(inner._forward_hooks)],
    "ddp": [len(ddp._forward_pre_hooks), len(ddp._forward_hooks)],
    "frozen": len(frozen._forward_pre_hooks),
    "global": len(torch_module._global_forward_pre_hooks),
    "mean_s": clock.mean_s(),
}), flush=True)
os._exit(0)  # not through DDP's teardown: torch 2.13's gloo may hang joining its threads (gptlaunch.exits)
"""


def test_the_clock_times_ddps_inner_module_and_leaves_every_other_module_alone(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", DDP_PROBE, str(tmp_path / "store")]
    ran = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    found = json.loads(ran.stdout.splitlines()[-1])
    assert found["inner"] == [1, 1]
    assert found["ddp"] == [0, 0]  # DDP's forward may broadcast buffers
    assert found["frozen"] == 0
    assert found["global"] == 0  # other modules' calls pay nothing
    assert found["mean_s"] is not None and found["mean_s"] > 0


class Fails(torch.nn.Linear):
    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("out of memory")  # caught by the program: it retries with less
        return super().forward(x)


def test_a_forward_that_raises_or_a_copy_of_the_model_leaves_the_clock_working() -> None:
    clock = ForwardClock()
    clock.attach()
    model = Fails(2, 1)
    model(torch.ones(1, 2))
    clock.step_done()  # the first timed step: left out
    model.fail = True
    with pytest.raises(RuntimeError):
        model(torch.ones(1, 2))
    model.fail = False
    twin = copy.deepcopy(model)  # an EMA, a best-model snapshot: the hooks copy no clock
    twin(torch.ones(1, 2))
    model(torch.ones(1, 2))
    clock.step_done()
    assert clock.mean_s() is not None  # the raise left no open forward behind
    assert len(clock._done) == 1


RESUMES = """
import sys, torch
model = torch.nn.Linear(2, 1)
opt = torch.optim.AdamW(model.parameters())
saved = sys.argv[1]
try:
    opt.load_state_dict(torch.load(saved))  # resume, as a script does from its checkpoint
except FileNotFoundError:
    pass
for _ in range(4):
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
torch.save(opt.state_dict(), saved)
"""


def test_a_resumed_script_counts_on_from_its_optimizers_step_count(tmp_path: Path) -> None:
    saved = tmp_path / "opt.pt"
    first, second = tmp_path / "beats-1", tmp_path / "beats-2"
    _watched(tmp_path, RESUMES.replace("sys.argv[1]", repr(str(saved))), first)
    _watched(tmp_path, RESUMES.replace("sys.argv[1]", repr(str(saved))), second)
    [before], [after] = read_beats(first), read_beats(second)
    assert (before.start_step, before.step) == (0, 4)
    assert (after.start_step, after.step) == (4, 8)


def test_stragglers_are_judged_against_the_other_ranks_median() -> None:
    def beat(rank: int, compute_s: float | None) -> Beat:
        return dataclasses.replace(_beat(rank, 0.0), compute_s=compute_s)

    even = [beat(0, 0.010), beat(1, 0.011), beat(2, 0.012), beat(3, None)]
    assert stragglers(even) == {}  # within 1.25×; rank 3 not timed yet
    slow = [*even[:3], beat(3, 0.030)]
    assert list(stragglers(slow)) == [3] and 2.5 < stragglers(slow)[3] < 3.0  # 30 / median(10, 11, 12)
    assert stragglers([beat(0, 0.5)]) == {}  # one rank: nobody to compare with


def test_each_ranks_ratio_is_to_the_median_of_the_other_ranks() -> None:
    """``ratios_to_others`` (one sort) against the definition (a median per rank), on ties, even and
    odd counts, and zeros."""
    rng = random.Random(0)
    cases = [[], [1.0], [1.0, 2.0], [0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 5.0]]
    cases += [[rng.choice([0.5, 1.0, 1.5, rng.random()]) for _ in range(n)] for n in range(2, 40)]
    for seconds in cases:
        others = [seconds[:k] + seconds[k + 1 :] for k in range(len(seconds))]
        medians = [statistics.median(rest) if rest else 0.0 for rest in others]
        want = [s / m if m > 0 else 0.0 for s, m in zip(seconds, medians, strict=True)]
        assert ratios_to_others(seconds) == pytest.approx(want), seconds
    assert ratios_to_others([1.0, 2.0]) == [0.5, 2.0]  # a rank at half speed: 2×, not 1.33×


def test_a_programs_warning_is_in_its_beat_until_it_clears_it(tmp_path: Path) -> None:
    beats = tmp_path / "beats"
    source = f"""
import json, pathlib
from gptlaunch import runtime
beat = lambda: json.loads(pathlib.Path({str(beats / "rank-0.json")!r}).read_text())["warning"]
runtime.warn("the run dir is nearly full")
assert beat() == "the run dir is nearly full", beat()
runtime.warn("a save did not fit", topic="checkpoint")
assert beat() == "the run dir is nearly full; a save did not fit", beat()
runtime.warn(None, topic="checkpoint")  # clears its own topic only
assert beat() == "the run dir is nearly full", beat()
runtime.warn(None)
"""
    _watched(tmp_path, source, beats)
    assert [b.warning for b in read_beats(beats)] == [None]
