"""Job-level retries: which failures are tried again, the backoff, and what of an attempt is kept."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from launcher.job.logs import TICK, tail
from launcher.job.record import Attempt, Failure, JobRecord, JobState, JobStatus, Outcome, torchelastic_dir
from launcher.job.retry import MAX_BACKOFF_S, archive, backoff_s, refusal, spares
from launcher.job.spec import JobSpec
from tests.unit.plans import local_plan

KILLED = Failure(node_rank=1, rank=1, error="rank 1 was killed by SIGKILL; see JOB/node-1.log")
FAULT = Failure(node_rank=1, rank=1, error="RuntimeError: injected fault on rank 1 at step 3 (pid 4242)")


def _failed(failure: Failure | None, exit_code: int = 1) -> Outcome:
    return Outcome(state=JobState.FAILED, exit_code=exit_code, failure=failure, message="m")


def _attempt(failure: Failure, step: int | None) -> Attempt:
    return Attempt(number=1, started_at=0, ended_at=1, exit_code=1, cause=failure.summary(), step=step)


@pytest.mark.parametrize(
    ("code", "why"), [(2, "invalid input"), (3, "refused"), (75, "on request"), (130, "on request")]
)
def test_the_users_failures_and_stops_are_never_retried(code: int, why: str) -> None:
    assert why in (refusal(_failed(None, code), 5, [], retries=3) or "")


def test_a_killed_rank_is_retried_until_the_retries_are_spent() -> None:
    assert refusal(_failed(KILLED), 7, [], retries=1) is None
    assert refusal(_failed(KILLED), 9, [_attempt(KILLED, 7)], retries=1) == "no retries left (--retries 1)"
    assert refusal(Outcome(state=JobState.SUCCEEDED, exit_code=0), 9, [], retries=1) == "it did not fail"


def test_the_same_error_at_the_same_step_twice_is_a_bug_not_a_node() -> None:
    again = FAULT.model_copy(update={"error": FAULT.error.replace("4242", "5151")})  # another pid
    assert "the same error at step 3" in (refusal(_failed(again), 3, [_attempt(FAULT, 3)], retries=5) or "")
    assert refusal(_failed(again), 4, [_attempt(FAULT, 3)], retries=5) is None  # another step
    assert refusal(_failed(KILLED), 3, [_attempt(FAULT, 3)], retries=5) is None  # another cause
    assert refusal(_failed(again), None, [_attempt(FAULT, None)], retries=5) is None  # step unknown


def test_a_program_fault_is_not_retried_by_its_exception_type_and_a_repeat_is_seen_across_archives() -> None:
    """A non-finite loss (the trainer's TrainingError) fails the same on any node: not retried even
    the first time. A cause that names its log is the same cause once its attempt is archived."""
    nan = Failure(node_rank=0, error="TrainingError: loss is nan at step 8", exception="TrainingError")
    why = refusal(_failed(nan), 8, [], retries=2) or ""
    assert "a program fault (a non-finite loss, TrainingError)" in why, why
    assert refusal(_failed(FAULT.model_copy(update={"exception": "RuntimeError"})), 3, [], retries=2) is None
    full = FAULT.model_copy(update={"exception": "NoSpaceError"})  # the next attempt writes to that disk
    assert refusal(_failed(full), 30, [], retries=2) == (
        "the run dir's file system is full: free room there, then submit again to resume"
    )
    logged = Failure(node_rank=0, error="exited with code 1; see /j/node-0.log")
    archived = logged.model_copy(update={"error": "exited with code 1; see /j/attempts/1/node-0.log"})
    why = refusal(_failed(logged), 0, [_attempt(archived, 0)], retries=5) or ""
    assert "the same error at step 0" in why, why


def test_the_decision_names_the_nodes_the_next_attempt_runs_without_or_why_it_stops() -> None:
    """The one decision every scheduler carries out: a killed rank's node is left out; a hang's suspects
    or the nodes a health gate named are; a stop says why."""
    killed = _failed(KILLED)
    assert refusal(killed, 7, [], retries=1) is None and killed.blamed_nodes() == [1]
    hang = Outcome(state=JobState.FAILED, exit_code=1, message="hang: ...", suspect_nodes=[0, 2])
    assert refusal(hang, 7, [], retries=1) is None and hang.blamed_nodes() == [0, 2]
    gate = Outcome(state=JobState.FAILED, exit_code=3, message="the health gate named", suspect_nodes=[1])
    assert refusal(gate, None, [], retries=1) is None and gate.blamed_nodes() == [1]
    assert refusal(killed, 9, [_attempt(KILLED, 7)], retries=1) == "no retries left (--retries 1)"


def test_spares_keep_the_hostfile_order_and_skip_the_jobs_hosts_and_the_named_ones() -> None:
    pool = ["h1", "h2", "h3", "h4", "h5", "h6"]
    assert spares(pool, current=["h1", "h2"], avoid={"h4"}) == ["h3", "h5", "h6"]
    assert spares(pool, current=pool[:4], avoid={"h5", "h6"}) == []


def _failed_at(*steps: int | None) -> list[Attempt]:
    return [Attempt(number=k + 1, started_at=k, ended_at=k, exit_code=1, cause="x", step=s)
            for k, s in enumerate(steps)]  # fmt: skip


def test_a_failure_that_repeats_waits_a_backoff_that_doubles_up_to_its_cap() -> None:
    waits = [backoff_s(10, _failed_at(*[None] * k)) for k in (1, 2, 3, 4)]  # failing at start-up
    assert waits == [0, 10, 20, 40]
    assert backoff_s(10, _failed_at(*[None] * 30)) == MAX_BACKOFF_S
    assert backoff_s(600, _failed_at(None, None, None)) == 600  # a longer base is kept
    assert backoff_s(10, _failed_at(500, 495, 500)) == 20  # resumed before 500, never past it


def test_a_failure_after_training_went_past_every_earlier_attempt_starts_at_once() -> None:
    assert backoff_s(10, _failed_at(500, 1_200, 2_000)) == 0  # a kill every few minutes
    assert backoff_s(10, _failed_at(500, None, 700)) == 0  # the loop is broken by new steps
    assert backoff_s(10, _failed_at(500, 700, None)) == 10  # then one start-up failure: a repeat
    assert backoff_s(10, _failed_at(None, 0)) == 10  # a start-up beat (step 0) is no new step


def test_an_attempt_is_archived_and_a_follower_moves_on_to_the_next(tmp_path: Path) -> None:
    spec = JobSpec.model_validate({"nnodes": 2})
    plan = local_plan(spec, tmp_path / "job", tmp_path)
    record = JobRecord.create(tmp_path / "job", spec, plan, JobStatus(created_at=time.time()))
    for k in (0, 1):
        record.node_log(k).write_text(f"attempt 1 node {k}\n")
    (torchelastic_dir(record.dir, 1) / "x").mkdir(parents=True)
    lines = tail([("node0", record.node_log(0))], keep_going=lambda: True)
    follow = (line for line in lines if line != TICK)  # ticks: nothing new within a poll
    assert next(follow) == "node0 | attempt 1 node 0\n"
    killed = KILLED.model_copy(update={"error": f"rank 1 was killed; see {record.node_log(1)}"})
    kept = archive(record, _attempt(killed, 7).model_copy(update={"failure": killed}))
    out = record.dir / "attempts" / "1"
    assert kept.cause.endswith(f"see {out / 'node-1.log'}") and kept.failure.error.endswith(
        f"see {out / 'node-1.log'}"
    )
    assert (out / "node-1.log").read_text() == "attempt 1 node 1\n" and (
        out / "torchelastic" / "node-1" / "x"
    ).is_dir()
    assert (
        not record.node_log(0).exists()
        and Attempt.model_validate_json((out / "attempt.json").read_text()).step == 7
    )
    record.node_log(0).write_text("attempt 2 node 0\n")
    assert next(follow) == "node0 | attempt 2 node 0\n"  # the follower found the new file


def test_a_follower_labels_a_nodes_next_log_with_the_host_it_runs_on_now(tmp_path: Path) -> None:
    log = tmp_path / "node-0.log"
    log.write_text("attempt 1\n")
    labels = {log: "gl-h1 node0"}
    lines = tail([("gl-h1 node0", log)], keep_going=lambda: True, relabel=lambda: dict(labels))
    follow = (line for line in lines if line != TICK)
    assert next(follow) == "gl-h1 node0 | attempt 1\n"
    log.rename(tmp_path / "archived.log")  # the attempt is archived; the plan then names the spare
    labels[log] = "gl-h3 node0"
    log.write_text("attempt 2\n")
    assert next(follow) == "gl-h3 node0 | attempt 2\n"
