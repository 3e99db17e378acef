"""How an attempt ended: one pure function (``verdict``) of the attempt's typed facts, for every
controller (the supervisor of local, SSH and compose jobs, and every SLURM piece). ``gather`` is the
one reader of those facts in the job record (the ranks' stop marker, the nodes' refusals, hang reports
and ends, the ranks' error files); what only the controller knows (the agents' exit codes, a stop
request, what the scheduler says) it adds itself.

The precedence, one order everywhere (the first that holds decides):

1. **success**: every node's agent exited 0, or the scheduler says the job completed;
2. **a stop on request** (``launcher cancel``, a signal to the controller): checkpointed (exit 75)
   when the ranks left a stop marker, else cancelled (exit 130);
3. **a refusal before training** (version parity, the health gate, a checkpoint out of reach): the
   refusal's exit code and message, and the nodes it named;
4. **a stop from outside the launcher** (a shutdown, SLURM's warning signal): the ranks left a stop
   marker, or an agent exited 75, and the first failed agent was not killed by a signal (then the
   stop followed from that failure): checkpointed;
5. **cancelled by the scheduler** (SLURM's CANCELLED) before any checkpoint: cancelled;
6. **the controller was lost** (a reader found the job's controller gone, nothing of it running);
7. **a hang** the nodes' watchdogs reported: failed, with the suspects named;
8. **a failure**: the root cause (``launcher.job.failures.first_failure``, in the order of that module's
   docstring), else what the scheduler said. Exit 2 when the failed rank exited 2 (invalid input, as
   the trainer's and argparse's usage errors do), else 1.

Every input is a typed fact: exit codes, signals, the stop marker, the nodes' reports, where an
exception was raised. No message text decides: error messages only go into the outcome's text.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from gptlaunch.contract import EXIT_CHECKPOINTED, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, StopMarker
from launcher.job import failures, reports
from launcher.job.failures import RankError, WorkerDeath, first_failure, killed_by
from launcher.job.hang import HANG_DIR, HangReport, hang_message, merge, suspects, write_stacks
from launcher.job.plan import Plan
from launcher.job.record import JobRecord, JobState, JobStatus, Outcome


@dataclass(frozen=True)
class Facts:
    """What is known of one attempt when it ends. ``agents``: each node's agent exit code by node rank
    (None: still running, or not known); ``first_failed``: the node whose agent the controller saw
    fail first (None: none seen). Paths in the outcome's text point into ``job_dir``; ``plan`` (None
    where no job record has one: the standalone sbatch script) names the hosts and how to resume."""

    plan: Plan | None
    job_dir: Path
    agents: tuple[int | None, ...] = ()
    first_failed: int | None = None
    completed: bool = False  # the scheduler says every node succeeded (SLURM: COMPLETED)
    stop_requested: bool = False
    marker: StopMarker | None = None  # the ranks' stop marker written in this attempt
    refused: reports.Refused | None = None  # the last refusal of a check before training, in this attempt
    scheduler_cancelled: bool = False
    controller_lost: bool = False
    hang: HangReport | None = None  # the nodes' hang reports, merged; stacks in ``job_dir/hang/``
    transport_error: str | None = None  # what the first failed agent's exit code means for its transport
    errors: tuple[RankError, ...] = ()  # the ranks' error files of this attempt, earliest first
    deaths: tuple[WorkerDeath, ...] = ()  # workers their torchrun reported killed by a signal
    ranks: dict[tuple[int, int], int] = field(default_factory=dict)  # (node, local rank) -> rank
    exits: dict[tuple[int, int], int] = field(default_factory=dict)  # (node, local rank) -> exit code
    oom: dict[int, reports.OomKilled] = field(default_factory=dict)  # node -> the OOM kills there
    unexplained: str = ""  # what the scheduler says of an end that nothing else explains


def gather(record: JobRecord, since: float, plan: Plan | None = None) -> Facts:
    """What the job record holds of the attempt that started at ``since`` (epoch seconds) on ``plan``
    (default: the record's); the controller adds what it knows with ``dataclasses.replace``. The
    nodes' hang reports are merged and every rank's stack written to ``JOB/hang/``
    (``launcher.job.hang.write_stacks``)."""
    plan = plan or record.plan()
    hang = None
    if hangs := reports.hangs(record.dir, since=since):
        hang = merge(hangs, {n.node_rank: n.named_host for n in plan.nodes if n.named_host})
        with contextlib.suppress(OSError):  # a reader's read-only copy: the stacks stay in the reports
            write_stacks(record.dir, hang)
    refused = reports.read(record.dir, reports.Refused, since)
    workers = failures.torchrun_summary(record, plan.nnodes)
    return Facts(
        plan=plan,
        job_dir=record.dir,
        marker=failures.stop_marker(Path(plan.run_dir), since, record.dir),
        refused=refused[-1] if refused else None,
        hang=hang,
        errors=tuple(failures.read_errors(record, plan.nnodes, since)),
        deaths=tuple(
            WorkerDeath(node, rank, local, -code) for node, rank, local, code in workers if code < 0
        ),
        ranks={(node, local): rank for node, rank, local, _ in workers},
        exits={(node, local): code for node, _, local, code in workers},
        oom={report.node: report for report in reports.read(record.dir, reports.OomKilled, since)},
    )


def verdict(facts: Facts) -> Outcome:
    """The attempt's end, by the precedence in this module's docstring. Pure: reads no file."""
    agents = facts.agents
    if facts.completed or (agents and all(code == 0 for code in agents)):
        return Outcome(state=JobState.SUCCEEDED, exit_code=0)
    if facts.stop_requested:
        return _stopped(facts)
    if (refused := facts.refused) is not None:  # the nodes a health gate named: a retry leaves them out
        return _outcome(JobState.FAILED, refused.exit_code, refused.message, refused.nodes)
    if _stopped_from_outside(facts):
        return _stopped(facts)
    if facts.scheduler_cancelled:
        message = "cancelled by the scheduler before the ranks saved a checkpoint"
        return _outcome(JobState.CANCELLED, EXIT_INTERRUPTED, message)
    if facts.controller_lost:
        message = "the process following the job died before recording its end; nothing of it runs"
        return _outcome(JobState.LOST, EXIT_FAILED, message)
    if facts.hang is not None:
        return hung(facts.job_dir, facts.hang)
    return _failed(facts)


def _outcome(state: JobState, exit_code: int, message: str, suspect_nodes: Sequence[int] = ()) -> Outcome:
    return Outcome(state=state, exit_code=exit_code, message=message, suspect_nodes=list(suspect_nodes))


def _stopped_from_outside(facts: Facts) -> bool:
    said = facts.marker is not None or EXIT_CHECKPOINTED in facts.agents
    first = facts.agents[facts.first_failed] if facts.first_failed is not None else None
    return said and killed_by(first) is None


def _stopped(facts: Facts) -> Outcome:
    """Checkpointed (exit 75) with the ranks' stop marker, else cancelled (exit 130). A checkpoint's
    message names it, its step, and (where the plan is known) how to resume."""
    marker, plan = facts.marker, facts.plan
    if marker is None:
        return _outcome(JobState.CANCELLED, EXIT_INTERRUPTED, "stopped on request, no checkpoint saved")
    message = f"checkpoint {marker.checkpoint} saved at step {marker.step}"
    if plan is not None:
        resume = f"in {plan.run_dir}"
        if any("trainer.cli" in node.argv for node in plan.nodes):  # not the user's own program
            resume = f"resume by submitting again with -- --run-dir {plan.run_dir}"
        message += f"; {resume}"
    return _outcome(JobState.CHECKPOINTED, EXIT_CHECKPOINTED, message)


def hung(job_dir: Path, report: HangReport) -> Outcome:
    """A hang as an outcome: its one line (stacks in ``job_dir/hang/``), and the suspects' nodes, the
    ones a retry leaves out."""
    message = hang_message(report, job_dir / HANG_DIR)
    nodes = sorted({r.node for r in report.ranks if r.rank in suspects(report)})
    return _outcome(JobState.FAILED, EXIT_FAILED, message, nodes)


def _failed(facts: Facts) -> Outcome:
    failure = first_failure(facts)
    if failure is None:
        return _outcome(JobState.FAILED, EXIT_FAILED, facts.unexplained or "the job failed without a word")
    # A rank that refused its input (exit 2) makes the job's exit 2: invalid input, never retried.
    usage = failure.local_rank is not None and failure.exit_code == EXIT_USAGE
    code = EXIT_USAGE if usage else EXIT_FAILED
    return Outcome(state=JobState.FAILED, exit_code=code, failure=failure, message=failure.summary())


def controller_lost(record: JobRecord, status: JobStatus) -> Outcome:
    """How the job of ``record`` (now ``status``) ended, whose controller is gone and never recorded
    the end."""
    facts = gather(record, status.started_at or status.created_at)
    return verdict(replace(facts, controller_lost=True))
