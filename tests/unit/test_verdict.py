"""One verdict on how an attempt ended, for every controller: a table of the facts either path (the
supervisor of local, SSH and compose jobs; SLURM's accounting and its batch steps) met, and the same
decisions once the torch message texts are taken out of the inputs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gptlaunch.contract import EXIT_CHECKPOINTED, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_REFUSED, StopMarker
from launcher.job.failures import RankError, WorkerDeath
from launcher.job.hang import HangReport, RankReport
from launcher.job.record import JobState
from launcher.job.reports import Refused
from launcher.job.spec import JobSpec
from launcher.job.verdict import Facts, verdict
from tests.unit.plans import local_plan

JOB = Path("/jobs/j1")
MARKER = StopMarker(step=7, checkpoint="ckpt-00000007.pt", time=1.0, signal="SIGTERM")
REFUSED = Refused(
    node=0, check="health", exit_code=EXIT_REFUSED, message="the health gate named node 1", nodes=[1]
)
PARITY = Refused(node=0, check="parity", exit_code=EXIT_REFUSED, message="torch differs on node 1")
COLLECTIVE = "/v/site-packages/torch/distributed/distributed_c10d.py"
BACKWARD = "/v/site-packages/torch/autograd/graph.py"
PEER = RankError(0, 0, 100, 1, "RuntimeError: [gloo/pair.cc:553] Connection closed by peer", COLLECTIVE)
OWN = RankError(1, 0, 110, 2, "ValueError: loss is nan at step 12", "/work/trainer/step.py")
DEATH = WorkerDeath(node_rank=1, rank=1, local_rank=0, signum=9)


def _rank(rank: int, node: int, state: str, waits: str | None) -> RankReport:
    return RankReport(rank=rank, local_rank=0, pid=100 + rank, node=node, host=f"h{node + 1}", step=5,
                      phase="step", state=state, waits_in=waits, python_frames=3, stack="")  # fmt: skip


HANG = HangReport(silent_s=31, budget_s=30, step=5, ranks=[_rank(0, 0, "sleeping", "all_reduce"),
                                                            _rank(1, 1, "stopped", None)])  # fmt: skip


def _facts(**known: object) -> Facts:
    spec = JobSpec.model_validate({"nnodes": 2})
    plan = local_plan(spec, JOB, Path("/work"))
    return dataclasses.replace(Facts(plan=plan, job_dir=JOB), **known)  # type: ignore[arg-type]


# (what is known, the job state, its exit code, the node ranks a retry avoids)
TABLE = [
    # success: every agent exited 0, or the scheduler says so; nothing else counts then
    (dict(agents=(0, 0)), JobState.SUCCEEDED, 0, []),
    (dict(completed=True, hang=HANG, errors=(PEER,)), JobState.SUCCEEDED, 0, []),
    # a stop on request: checkpointed with the marker, cancelled without; before a refusal or a failure
    (dict(stop_requested=True, marker=MARKER, agents=(1, None), first_failed=0),
     JobState.CHECKPOINTED, EXIT_CHECKPOINTED, []),
    (dict(stop_requested=True, refused=REFUSED, hang=HANG),
     JobState.CANCELLED, EXIT_INTERRUPTED, []),
    # a refusal before training: its code and the nodes it named (the health gate), none for parity
    (dict(refused=REFUSED, agents=(EXIT_REFUSED, 0), first_failed=0),
     JobState.FAILED, EXIT_REFUSED, [1]),
    (dict(refused=PARITY, marker=MARKER, hang=HANG), JobState.FAILED, EXIT_REFUSED, []),
    # a stop from outside: the marker, or an agent's 75, unless the first failed agent was killed (then
    # the stop followed from that failure)
    (dict(marker=MARKER, agents=(1, None), first_failed=0),
     JobState.CHECKPOINTED, EXIT_CHECKPOINTED, []),
    (dict(agents=(EXIT_CHECKPOINTED, 0), first_failed=0),
     JobState.CANCELLED, EXIT_INTERRUPTED, []),
    (dict(marker=MARKER, hang=HANG, agents=(1, 1), first_failed=1),
     JobState.CHECKPOINTED, EXIT_CHECKPOINTED, []),
    (dict(marker=MARKER, agents=(-9, 1), first_failed=0), JobState.FAILED, EXIT_FAILED, [0]),
    # cancelled by the scheduler (SLURM's CANCELLED), no checkpoint; a lost controller
    (dict(scheduler_cancelled=True, hang=HANG), JobState.CANCELLED, EXIT_INTERRUPTED, []),
    (dict(controller_lost=True, errors=(OWN,)), JobState.LOST, EXIT_FAILED, []),
    # a hang: the suspects' nodes (node 1's rank is stopped), before any error it caused
    (dict(hang=HANG, errors=(PEER,), agents=(1, 124), first_failed=1),
     JobState.FAILED, EXIT_FAILED, [1]),
    # a failure's root cause: an agent killed, a lost host, a worker killed, a rank's own error before
    # an earlier peer's, the first failed agent's code, what the scheduler said
    (dict(agents=(-9, 1), first_failed=0, errors=(OWN,)), JobState.FAILED, EXIT_FAILED, [0]),
    (dict(agents=(255, None), first_failed=0, transport_error="ssh lost", errors=(OWN,)),
     JobState.FAILED, EXIT_FAILED, [0]),
    (dict(agents=(1, 1), first_failed=0, deaths=(DEATH,), errors=(PEER,)),
     JobState.FAILED, EXIT_FAILED, [1]),
    (dict(agents=(1, 1), first_failed=0, errors=(PEER, OWN)),
     JobState.FAILED, EXIT_FAILED, [1]),
    (dict(agents=(1, 1), first_failed=1, errors=(dataclasses.replace(OWN, raised_in=BACKWARD), PEER)),
     JobState.FAILED, EXIT_FAILED, [1]),
    (dict(agents=(None, 1), first_failed=1), JobState.FAILED, EXIT_FAILED, [1]),
    (dict(unexplained="SLURM ended the job NODE_FAIL"), JobState.FAILED, EXIT_FAILED, []),
]  # fmt: skip


@pytest.mark.parametrize(("known", "state", "code", "blamed"), TABLE)
def test_one_precedence_decides_every_attempts_end(
    known: dict[str, object], state: JobState, code: int, blamed: list[int]
) -> None:
    end = verdict(_facts(**known))
    assert (end.state, end.exit_code) == (state, code)
    assert end.blamed_nodes() == blamed
    assert end.cause or state == JobState.SUCCEEDED  # every other end says something


def test_the_outcomes_text_names_the_cause() -> None:
    assert "loss is nan" in verdict(_facts(agents=(1, 1), first_failed=0, errors=(PEER, OWN))).message
    assert "ssh lost" in verdict(_facts(agents=(255, 0), first_failed=0, transport_error="ssh lost")).cause
    assert "rank 1 was killed by SIGKILL" in verdict(_facts(deaths=(DEATH,), errors=(PEER,))).cause
    stopped = verdict(_facts(marker=MARKER, agents=(1, None), first_failed=0)).message
    assert stopped.startswith("checkpoint ckpt-00000007.pt saved at step 7")
    hung = verdict(_facts(hang=HANG)).message
    assert "rank 1 (node 1, h2) is stopped" in hung and str(JOB / "hang") in hung
    assert verdict(_facts(unexplained="SLURM said so")).message == "SLURM said so"


def _without_texts(facts: Facts) -> Facts:
    """``facts`` with every message of torch's taken out: the rank errors' words and the hang's
    stacks and waits (what a torch upgrade could reword), keeping the exception's class and where it
    was raised, the exit codes, the signals and the reports."""
    errors = tuple(
        dataclasses.replace(e, message=e.message.split(":")[0] + ": <removed>") for e in facts.errors
    )
    hang = facts.hang
    if hang is not None:
        ranks = [
            r.model_copy(update={"stack": "", "waits_in": None if r.waits_in is None else "?"})
            for r in hang.ranks
        ]
        hang = hang.model_copy(update={"ranks": ranks})
    return dataclasses.replace(facts, errors=errors, hang=hang)


@pytest.mark.parametrize(("known", "state", "code", "blamed"), TABLE)
def test_decisions_stay_the_same_without_torchs_message_texts(
    known: dict[str, object], state: JobState, code: int, blamed: list[int]
) -> None:
    facts = _facts(**known)
    bare = verdict(_without_texts(facts))
    full = verdict(facts)
    assert (bare.state, bare.exit_code, bare.blamed_nodes()) == (
        full.state,
        full.exit_code,
        full.blamed_nodes(),
    )
    if full.failure is not None:
        assert bare.failure is not None
        assert (bare.failure.node_rank, bare.failure.local_rank) == (
            full.failure.node_rank,
            full.failure.local_rank,
        )


def test_a_time_ordering_alone_would_blame_the_peer() -> None:
    """The rank's own error came after a peer's (the peer timed out first): where each was raised
    decides, so the rank is named even with no words to read."""
    late_own = dataclasses.replace(OWN, timestamp=PEER.timestamp + 10)
    facts = _without_texts(_facts(agents=(1, 1), first_failed=0, errors=(PEER, late_own)))
    assert verdict(facts).blamed_nodes() == [OWN.node_rank] != [PEER.node_rank]
