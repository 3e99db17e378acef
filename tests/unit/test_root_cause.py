"""One root cause per failure across nodes: a worker killed by a signal, then a rank's own error, and
only last a peer's "connection closed / timed out" (what healthy ranks see when another one dies)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from launcher.job.failures import is_peer_error
from launcher.job.logs import log_end
from launcher.job.record import Failure, JobRecord, JobStatus, torchelastic_dir
from launcher.job.spec import JobSpec
from launcher.job.verdict import gather, verdict
from tests.unit.plans import local_plan
from tests.unit.torchrun_output import CHILD_FAILED, FAILED

# torchrun's failure summary as it prints it into a node log
SUMMARY = f"[rank1]: step 3 | loss 8.1\n{FAILED}\n{CHILD_FAILED}"
PEER = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.231.0.12]:4242"


@pytest.fixture
def record(tmp_path: Path) -> JobRecord:
    spec = JobSpec.model_validate({"nnodes": 2})
    plan = local_plan(spec, tmp_path / "job", tmp_path)
    return JobRecord.create(tmp_path / "job", spec, plan, JobStatus(created_at=time.time() - 60))


# The innermost frames of the tracebacks in error.json's py_callstack (torch 2.13 under gloo): a peer's
# error is raised in torch.distributed's collective, a rank's own in the training code.
IN_COLLECTIVE = '  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 3252, in all_reduce'
IN_TRAINER = '  File "/work/trainer/step.py", line 40, in train_step'


def root_cause(record: JobRecord, failed_node: int) -> Failure:
    """The root cause the controller finds (``launcher.job.verdict.gather``, then ``verdict``) when the
    first failed agent of the job's two nodes is ``failed_node``'s, exit code 1."""
    agents = tuple(1 if node == failed_node else None for node in range(2))
    facts = replace(gather(record, since=0.0), agents=agents, first_failed=failed_node)
    failure = verdict(facts).failure
    assert failure is not None, verdict(facts)
    return failure


def _error_file(record: JobRecord, node: int, message: str, when: float) -> None:
    path = torchelastic_dir(record.dir, node) / "run" / "attempt_0" / "0" / "error.json"
    path.parent.mkdir(parents=True)
    frame = IN_COLLECTIVE if "RuntimeError: injected" not in message else IN_TRAINER
    stack = f"Traceback (most recent call last):\n{frame}\n    work.wait()\n{message}\n"
    extra = {"timestamp": int(when), "py_callstack": stack}
    path.write_text(json.dumps({"message": {"message": message, "extraInfo": extra}}))


def test_a_killed_worker_is_the_cause_not_the_peer_that_saw_it_go(record: JobRecord) -> None:
    _error_file(record, 0, PEER, time.time() - 10)  # the peer's error is the only error file
    record.node_log(1).write_text(SUMMARY)
    assert gather(record, since=0.0).deaths[0].rank == 1
    failure = root_cause(record, failed_node=0)
    assert (failure.node_rank, failure.rank, failure.local_rank) == (1, 1, 0)
    assert "rank 1 was killed by SIGKILL" in failure.summary()


def test_a_worker_that_wrote_its_error_then_aborted_is_named_by_its_error(record: JobRecord) -> None:
    """torch 2.13 under gloo: a rank raises, writes its error file, then aborts at exit (SIGABRT,
    "terminate called without an active exception"): its error is the cause, not the signal."""
    now = time.time()
    _error_file(record, 0, PEER, now - 20)
    _error_file(record, 1, "RuntimeError: injected fault on rank 1 at step 3", now - 10)
    record.node_log(1).write_text(
        SUMMARY.replace("-9 (pid", "-6 (pid").replace("Signal 9 (SIGKILL)", "Signal 6")
    )
    assert gather(record, since=0.0).deaths[0].signum == 6
    failure = root_cause(record, failed_node=1)
    assert (failure.node_rank, failure.rank) == (1, 1) and "injected fault" in failure.error, failure


def test_a_ranks_error_names_its_exception_type_and_its_workers_exit_code(record: JobRecord) -> None:
    """The type comes from torchelastic's record (``Type: message``), the exit code from torchrun's
    summary: typed facts a retry decision reads (``launcher.job.retry.PROGRAM_FAULTS``)."""
    _error_file(record, 1, "RuntimeError: injected fault on rank 1 at step 3", time.time() - 10)
    record.node_log(1).write_text(SUMMARY.replace("-9 (pid", "3 (pid"))
    failure = root_cause(record, failed_node=1)
    assert (failure.exception, failure.exit_code) == ("RuntimeError", 3), failure


def test_a_ranks_cuda_oom_is_named_out_of_gpu_memory_with_the_fix(record: JobRecord) -> None:
    """torch.OutOfMemoryError, as torchelastic's record writes it (a GPU test raises the real one)."""
    oom = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity"
    _error_file(record, 1, oom, time.time() - 10)
    failure = root_cause(record, failed_node=1)
    assert failure.error.startswith("out of GPU memory: OutOfMemoryError: CUDA out of memory."), failure
    assert "--micro-batch-size" in failure.error and failure.exception == "OutOfMemoryError"


def test_a_worker_that_exited_2_with_no_error_file_is_invalid_input_and_the_jobs_exit_2(
    record: JobRecord,
) -> None:
    """A script's argparse error (or the trainer's usage error) on rank 1: named by its rank and exit
    code, and the job's exit code is 2, as the script's own would be."""
    record.node_log(1).write_text(SUMMARY.replace("-9 (pid", "2 (pid"))
    agents = (None, 1)
    outcome = verdict(replace(gather(record, since=0.0), agents=agents, first_failed=1))
    assert outcome.exit_code == 2 and outcome.failure is not None, outcome
    assert (outcome.failure.rank, outcome.failure.local_rank) == (1, 0)
    assert "exited with code 2 (invalid input" in outcome.cause, outcome.cause


def test_a_ranks_own_error_wins_over_an_earlier_peer_error(record: JobRecord) -> None:
    now = time.time()
    _error_file(record, 0, PEER, now - 20)
    _error_file(record, 1, "RuntimeError: injected fault on rank 1 at step 3", now - 10)
    failure = root_cause(record, failed_node=0)
    assert failure.node_rank == 1 and "injected fault" in failure.error


def test_with_only_peer_errors_the_earliest_is_named(record: JobRecord) -> None:
    now = time.time()
    _error_file(record, 1, "RuntimeError: Socket Timeout", now - 20)
    _error_file(record, 0, PEER, now - 10)
    assert root_cause(record, failed_node=0).node_rank == 1


@pytest.mark.parametrize(
    ("message", "peer"),
    [
        (PEER, True),
        ("RuntimeError: Connection reset by peer", True),
        ("DistBackendError: [Rank 0] Watchdog caught collective operation timeout", True),
        ("RuntimeError: injected fault on rank 1 at step 3", False),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", False),
        ("ValueError: loss is nan at step 12", False),
    ],
)
def test_peer_errors_are_told_from_causes(message: str, peer: bool) -> None:
    assert is_peer_error(message) is peer


def test_end_of_job_readers_look_only_at_the_end_of_a_long_node_log(tmp_path: Path) -> None:
    log = tmp_path / "node-1.log"
    log.write_text("[rank1]: step\n" * 100_000 + SUMMARY)  # ~1.5 MB of training output, then the summary
    assert log_end(log, len(SUMMARY)) == SUMMARY
    assert log_end(tmp_path / "missing.log") == ""
