"""How a job ended: the root cause of a failure, or the checkpoint of a stop (the trainer's stop marker).

One cause per failure, deduplicated across nodes, by what it says about the job rather than by time
alone: an agent killed by a signal, then a lost host (the transport's explanation), then a worker
killed by a signal (torchrun's failure summary in its node log) that wrote no error file, then a
rank's own error (one that then died by a signal, e.g. SIGABRT at exit, is named by its error), and
last a peer's "connection closed / reset / timed out", which is what the healthy ranks see when
another one dies. Within a class, the earliest wins. Worker errors come from
``@record`` on the trainer's entry point: ``<log dir>/<run id>/attempt_<n>/<local rank>/error.json``.
The peers' errors stay in the node logs.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass
from pathlib import Path

from gptlaunch.contract import EXIT_CHECKPOINTED, EXIT_FAILED, EXIT_INTERRUPTED, StopMarker, read_stop_marker
from launcher.job.hang import HangReport, hang_message, suspects, write_stacks
from launcher.job.logs import log_end
from launcher.job.plan import Plan
from launcher.job.record import Failure, JobRecord, JobState, Outcome


@dataclass(frozen=True)
class RankError:
    node_rank: int
    local_rank: int
    timestamp: int  # seconds, from the error file
    written_ns: int  # the file's mtime: breaks ties within a second
    message: str


def read_errors(record: JobRecord, nnodes: int, since: float = 0.0) -> list[RankError]:
    """Every worker error file of the job written at or after ``since`` (epoch seconds; a requeued
    job's earlier runs left theirs), earliest first."""
    found = []
    for node in range(nnodes):
        for path in record.torchelastic_dir(node).glob("*/attempt_*/*/error.json"):
            try:
                data = json.loads(path.read_text())
                msg = data["message"]
                text = msg.get("message", "") if isinstance(msg, dict) else str(msg)
                ts = int(msg.get("extraInfo", {}).get("timestamp", 0)) if isinstance(msg, dict) else 0
            except (OSError, ValueError, KeyError, TypeError):
                continue
            written_ns = path.stat().st_mtime_ns
            if written_ns >= since * 1e9:
                found.append(RankError(node, int(path.parent.name), ts, written_ns, text))
    return sorted(found, key=lambda e: (e.timestamp, e.written_ns))


# What a healthy rank reports when a peer died or hung: a consequence, not a cause (gloo, NCCL, c10d).
_PEER_ERROR = re.compile(
    r"connection (?:closed|reset|refused)|closed by peer|broken pipe|timed out|timeout|"
    r"socket (?:closed|error)|ECONNRESET|EPIPE|communicator was aborted|watchdog|"
    r"rendezvous.*(?:closed|shut down)|peer",
    re.IGNORECASE,
)
# torchrun's failure summary: "rank      : 3 (local_rank: 1)" then "exitcode  : -9 (pid: 1234)".
_SUMMARY = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def is_peer_error(message: str) -> bool:
    """Whether a rank's error is what a peer's death or hang looks like from a healthy rank."""
    return _PEER_ERROR.search(message) is not None


@dataclass(frozen=True)
class WorkerDeath:
    node_rank: int
    rank: int
    local_rank: int
    signum: int


def worker_deaths(record: JobRecord, nnodes: int) -> list[WorkerDeath]:
    """The workers torchrun reported killed by a signal (a negative exit code in its failure summary),
    by node."""
    found = []
    for node in range(nnodes):
        for rank, local_rank, code in _SUMMARY.findall(log_end(record.node_log(node))):
            if int(code) < 0:
                found.append(WorkerDeath(node, int(rank), int(local_rank), -int(code)))
    return list(dict.fromkeys(found))  # the summary repeats the root cause: once each


def _global_rank(log: Path, local_rank: int) -> int | None:
    """The global rank of ``local_rank`` on a node, from torchrun's failure summary in the node log
    (``rank      : 3 (local_rank: 1)``)."""
    pattern = re.compile(rf"rank\s*:\s*(\d+)\s*\(local_rank:\s*{local_rank}\)")
    matches = pattern.findall(log_end(log))
    return int(matches[-1]) if matches else None


def root_cause(
    record: JobRecord,
    nnodes: int,
    failed_node: int,
    exit_code: int | None,
    since: float = 0.0,
    transport_error: str | None = None,
) -> Failure:
    """The first failure of the job (since ``since``); falls back to the first agent seen failing when
    no rank left an error file (e.g. a worker killed by a signal, or an agent that could not start).
    ``transport_error``: what the failed node's exit code means for its scheduler's transport (e.g. a
    lost ssh connection), which then is the cause."""
    errors = read_errors(record, nnodes, since)
    hosts = {n.node_rank: n.named_host for n in record.plan().nodes}
    signum = killed_by(exit_code)
    if signum is not None:  # the agent itself was killed: the peers' errors come after
        return Failure(
            node_rank=failed_node,
            host=hosts.get(failed_node),
            exit_code=exit_code,
            error=f"the torchrun agent of node {failed_node} was killed by signal {signum} (exit code "
            f"{exit_code}); "
            f"see {record.node_log(failed_node)}",
        )
    if transport_error is not None:
        return Failure(
            node_rank=failed_node,
            host=hosts.get(failed_node),
            exit_code=exit_code,
            error=f"{transport_error}; see {record.node_log(failed_node)}",
        )
    # A worker that wrote its own error died of it (then, e.g., aborted at exit): that error tells more.
    wrote = {(e.node_rank, e.local_rank) for e in errors}
    deaths = [d for d in worker_deaths(record, nnodes) if (d.node_rank, d.local_rank) not in wrote]
    if deaths:
        first_death = deaths[0]
        return Failure(
            node_rank=first_death.node_rank,
            host=hosts.get(first_death.node_rank),
            local_rank=first_death.local_rank,
            rank=first_death.rank,
            exit_code=exit_code,
            error=f"rank {first_death.rank} was killed by {signal_name(first_death.signum)}; its peers' "
            f"errors follow from it; see {record.node_log(first_death.node_rank)}",
        )
    if errors:
        first = min(errors, key=lambda e: is_peer_error(e.message))  # stable: earliest of its class
        return Failure(
            node_rank=first.node_rank,
            host=hosts.get(first.node_rank),
            local_rank=first.local_rank,
            rank=_global_rank(record.node_log(first.node_rank), first.local_rank),
            exit_code=exit_code,
            error=first.message,
        )
    return Failure(
        node_rank=failed_node,
        host=hosts.get(failed_node),
        exit_code=exit_code,
        error=f"the torchrun agent of node {failed_node} exited with code {exit_code}; "
        f"see {record.node_log(failed_node)}",
    )


def killed_by(exit_code: int | None) -> int | None:
    """The signal that killed an agent, from its exit code (-N from Popen, 128+N through a shell or
    ssh), else None. torchrun itself exits 1 when a worker dies, so this names the agent's death.
    255 is not 128+127 (no such signal) but ssh's own failure: a lost connection."""
    if exit_code is None or 0 <= exit_code <= 128 or exit_code - 128 > signal.SIGRTMAX:
        return None
    return -exit_code if exit_code < 0 else exit_code - 128


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``signal 42`` for a number without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


RUN_COPY = "run-copy"  # in the job record: a node-local run dir's copy (launcher.schedulers.slurm.run_copy)


def stop_marker(run_dir: Path, since: float, job_dir: Path | None = None) -> StopMarker | None:
    """The ranks' stop marker written at or after ``since`` (epoch seconds), in ``run_dir`` or, when
    ``job_dir`` is given, in its copy there (a SLURM job whose run dir is node-local)."""
    marker = read_stop_marker(run_dir, since)
    if marker is None and job_dir is not None:
        marker = read_stop_marker(job_dir / RUN_COPY, since)
    return marker


def stop_outcome(plan: Plan, since: float, job_dir: Path | None = None) -> Outcome:
    """ "checkpointed" (exit 75) when the ranks recorded a stop checkpoint at or after ``since`` (in
    the run dir, or its copy in ``job_dir``: see ``stop_marker``), else "cancelled" (exit 130)."""
    marker = stop_marker(Path(plan.run_dir), since, job_dir)
    if marker is None:
        message = "stopped on request, no checkpoint saved"
        return Outcome(state=JobState.CANCELLED, exit_code=EXIT_INTERRUPTED, message=message)
    trainer = any("trainer.cli" in node.argv for node in plan.nodes)  # not the user's own program
    resume = f"resume by submitting again with -- --run-dir {plan.run_dir}"
    if not trainer:
        resume = f"in {plan.run_dir}"
    message = f"checkpoint {marker.checkpoint} saved at step {marker.step}; {resume}"
    return Outcome(state=JobState.CHECKPOINTED, exit_code=EXIT_CHECKPOINTED, message=message)


def hang_outcome(job_dir: Path, report: HangReport) -> Outcome:
    """A hang as the job's end: every rank's stack kept in ``job_dir/hang/``, the suspect named."""
    message = hang_message(report, write_stacks(job_dir, report))
    nodes = sorted({r.node for r in report.ranks if r.rank in suspects(report)})
    return Outcome(state=JobState.FAILED, exit_code=EXIT_FAILED, message=message, suspect_nodes=nodes)
