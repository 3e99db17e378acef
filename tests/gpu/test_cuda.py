"""What issue 31 added to the GPU path, on a real GPU: the copy to pinned host memory that a
background checkpoint and a snapshot wait for (``HostStager``: non-blocking copies, then a
synchronize), the snapshot's gather and broadcast over NCCL, and a killed rank of a one-GPU job that
the retry resumes from the snapshot in host memory."""

from __future__ import annotations

import os
import re
import signal
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gptlaunch.contract import job_snapshots
from gptlaunch.snapshots import Snapshots
from launcher.job.logs import wait_terminal
from launcher.job.record import Attempt, JobRecord
from launcher.schedulers.local.scheduler import LocalScheduler
from tests.integration.conftest import launcher, losses, metrics, only_job_id, wait_for, wait_for_steps
from trainer import checkpoint
from trainer.config import GPTConfig, TrainConfig
from trainer.model import GPT
from trainer.optim import make_optimizer
from trainer.saver import Saver

CUDA = torch.device("cuda")


def _trained(steps: int) -> tuple[GPT, torch.optim.Optimizer, torch.Tensor]:
    """A small GPT on the GPU with fused AdamW after ``steps`` steps, and its batch, (B, T) tokens."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, d_model=128)).to(CUDA)
    optimizer = make_optimizer(model, TrainConfig(), CUDA)
    x = torch.randint(0, 512, (8, 64), device=CUDA)
    _steps(model, optimizer, x, steps)
    return model, optimizer, x


def _steps(model: GPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, n: int) -> None:
    for _ in range(n):
        _, loss = model(x, x)
        loss.backward()
        optimizer.step()  # in place: a copy's writer thread must not see these values
        optimizer.zero_grad(set_to_none=True)


def _on_cpu(state: dict) -> dict:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def test_background_checkpoints_hold_the_gpu_state_of_their_step_while_training_goes_on(
    tmp_path: Path,
) -> None:
    """Two saves with one writer (torch 2.11's stager failed at the second), 3 steps after each."""
    model, optimizer, x = _trained(2)
    expected = {}
    with Saver(tmp_path, 2, CUDA) as saver:
        for step in (2, 5):
            expected[step] = _on_cpu(model.state_dict())
            full = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
            times = saver.save(full, step, blocking=False)
            assert times.background and times.nbytes > 0
            _steps(model, optimizer, x, 3)  # the parameters change while the write goes on
    for step, state in expected.items():
        saved = torch.load(checkpoint.checkpoint_path(tmp_path, step), map_location="cpu", weights_only=True)
        assert saved["model"].keys() == state.keys()
        assert all(torch.equal(saved["model"][k], state[k]) for k in state), step  # bit for bit
    assert not all(torch.equal(a, b) for a, b in zip(expected[2].values(), expected[5].values(), strict=True))


@pytest.fixture
def nccl_group(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A one-rank NCCL process group on GPU 0, under a bare torchrun's variables for a run that may be
    restarted (``--max-restarts 1``)."""
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"gpu-test-{os.getpid()}")
    torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def test_a_snapshot_of_gpu_state_comes_back_through_nccl(
    nccl_group, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One rank: the gather and the broadcast run on NCCL, but the state is the one rank 0 read from
    its file (what crosses the network between hosts is tested on gloo, tests/unit/test_collectives.py)."""
    model, optimizer, x = _trained(2)
    expected = _on_cpu(model.state_dict())
    kept = Snapshots(tmp_path / "run", every=1, device=CUDA)
    kept.keep(2, {"step": 2, "model": model.state_dict()})
    _steps(model, optimizer, x, 1)
    kept.close()  # written; not dropped, as after a failure
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the restart that reads it
    with Snapshots(tmp_path / "run", every=1, device=CUDA) as again:
        found = again.resume(newer_than=None)
    assert found is not None, "no snapshot found on the retry"
    state, where = found
    assert where == f"the snapshot in {socket.gethostname()}'s memory" and state["step"] == 2
    assert all(torch.equal(state["model"][k], expected[k]) for k in expected)


STEPS = 300  # the tiny preset runs hundreds of steps a second on a GPU: the kill comes long before the end


def test_a_killed_rank_on_a_gpu_resumes_from_the_snapshot_in_host_memory(
    prepared_data, tmp_path: Path
) -> None:
    """One node with one GPU, compiled, bf16; a snapshot every 10 steps and no checkpoint before step
    100: rank 0 SIGKILLed past step 16 resumes from a snapshot, and every step is logged once. At
    hundreds of steps a second the newest snapshot may still be in writing at the kill, and the one
    before it is used: at most two intervals back."""
    jobs, run_dir = tmp_path / "jobs", tmp_path / "run"
    trainer_args = ["--max-steps", str(STEPS), "--log-interval", "1", "--checkpoint-interval", "100",
                    "--eval-interval", "100000", "--run-dir", str(run_dir)]  # fmt: skip
    submit = launcher(jobs, "submit", "--detach", "--nodes", "1", "--gpus-per-node", "1", "--retries", "1",
                      "--", *prepared_data, *trainer_args)  # fmt: skip
    assert submit.returncode == 0, submit.stderr[-3000:]
    job_dir = jobs / only_job_id(jobs)
    beats = wait_for_steps([job_dir / "heartbeat" / "node-0"], step=16, timeout_s=600, ranks=1)
    wait_for(lambda: list(job_snapshots(job_dir.name).glob("*/snapshot-*.pt")), 60, "a snapshot in memory")
    os.kill(beats[0].pid, signal.SIGKILL)
    final = wait_terminal(LocalScheduler().state, JobRecord(job_dir), 600, poll_s=0.2)
    assert final is not None and final.state == "succeeded", final
    log = (job_dir / "node-0.log").read_text()
    assert "device cuda:0" in log, log[-3000:]  # one rank: no process group (the NCCL test is above)
    resumed = re.search(r"resumed from the snapshot in \S+ memory at step (\d+)", log)
    assert resumed is not None, log[-3000:]
    first = Attempt.model_validate_json((job_dir / "attempts" / "1" / "attempt.json").read_text())
    assert first.step is not None and int(resumed[1]) >= 10 and first.step - int(resumed[1]) <= 20, first
    steps = [m["step"] for m in metrics(run_dir) if "tokens_per_s" in m]
    assert steps == list(range(1, STEPS + 1))
    assert len(losses(run_dir)) == STEPS


# A script that takes GPU memory 1 GiB at a time until torch raises OutOfMemoryError.
CUDA_HOG = """import torch
held = []
while True:
    held.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
"""


def test_a_cuda_oom_is_named_out_of_gpu_memory_with_the_fix(tmp_path: Path) -> None:
    """The real torch.OutOfMemoryError on one GPU, in a user's script: named by its type (torchelastic's
    error record), with the fix, on the console and in ``status``."""
    (tmp_path / "hog.py").write_text(CUDA_HOG)
    jobs = tmp_path / "jobs"
    proc = launcher(jobs, "submit", "--nodes", "1", "--gpus-per-node", "1", "--workdir", str(tmp_path), "--",
                    "hog.py", timeout=300)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    said = proc.stderr.splitlines()[-1]
    assert "failed: out of GPU memory: OutOfMemoryError: CUDA out of memory." in said, said
    assert "--micro-batch-size" in said, said
    status = launcher(jobs, "status", only_job_id(jobs), check=True).stdout
    assert "out of GPU memory" in status, status
