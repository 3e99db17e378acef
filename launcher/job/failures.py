"""The facts of a failure, read from the job record, and its root cause (``first_failure``).

One cause per failure, deduplicated across nodes, by what it says about the job rather than by time
alone: an agent killed by a signal, then a lost host (the transport's explanation), then a worker
killed by a signal (torchrun's failure summary in its node log) that wrote no error file, then a
rank's own error (one that then died by a signal, e.g. SIGABRT at exit, is named by its error), and
last the first failed agent's exit code. Among rank errors, one
raised inside torch.distributed or autograd's backward (where a healthy rank finds out that a peer
died or hung: DDP's gradient all_reduce) comes after any other; within a class, the earliest wins.
Where an error was raised is read from its traceback's frames, never from its message's words.
Worker errors come from ``@record`` on the trainer's entry point:
``<log dir>/<run id>/attempt_<n>/<local rank>/error.json``. The peers' errors stay in the node logs.
How an attempt ended as a whole is ``launcher.job.verdict``'s.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gptlaunch.contract import EXIT_USAGE, StopMarker, read_stop_marker
from launcher.job.logs import log_end
from launcher.job.plan import node_log_name
from launcher.job.record import Failure, JobRecord, torchelastic_dir
from launcher.job.reports import OomKilled

if TYPE_CHECKING:  # the verdict gathers the facts, then asks this module for their root cause
    from launcher.job.verdict import Facts

# Where a healthy rank finds out that a peer died or hung: torch.distributed's collectives, and
# autograd's backward, under which DDP's gradient all_reduce runs (its frames, not its words).
_CONSEQUENCE_FILES = ("/torch/distributed/", "/torch/autograd/")
_FRAME_FILE = re.compile(r'^\s*File "(?P<file>[^"]+)", line \d+', re.MULTILINE)
GPU_OOM_FIX = (
    "a smaller --micro-batch-size (the global batch kept with --global-batch-tokens), activation "
    "checkpointing, or fewer ranks per GPU"
)
# torchelastic's record writes an exception as f"{type(e).__name__}: {e}" (its ErrorHandler).
_EXCEPTION_TYPE = re.compile(r"^([A-Za-z_]\w*): ")


@dataclass(frozen=True)
class RankError:
    node_rank: int
    local_rank: int
    timestamp: int  # seconds, from the error file
    written_ns: int  # the file's mtime: breaks ties within a second
    message: str
    raised_in: str = ""  # the file of its traceback's innermost frame ("": no traceback)
    exception: str = ""  # its exception's type name, as torchelastic's record names it ("": unknown)

    @property
    def follows(self) -> bool:
        """Raised inside torch.distributed or autograd's backward: what a healthy rank sees when a
        peer dies or hangs, so it is a cause only when no other error is."""
        return any(part in self.raised_in for part in _CONSEQUENCE_FILES)


def read_errors(record: JobRecord, nnodes: int, since: float) -> list[RankError]:
    """Every worker error file of the job written at or after ``since`` (epoch seconds; a requeued
    job's earlier runs left theirs), earliest first."""
    found = []
    for node in range(nnodes):
        for path in torchelastic_dir(record.dir, node).glob("*/attempt_*/*/error.json"):
            try:
                msg = json.loads(path.read_text())["message"]
                text = msg.get("message", "") if isinstance(msg, dict) else str(msg)
                extra = msg.get("extraInfo", {}) if isinstance(msg, dict) else {}
                ts, stack = int(extra.get("timestamp", 0)), str(extra.get("py_callstack", ""))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
            written_ns = path.stat().st_mtime_ns
            if written_ns >= since * 1e9:
                frames = _FRAME_FILE.findall(stack)
                raised_in = frames[-1] if frames else ""
                kind = _EXCEPTION_TYPE.match(text)
                local_rank, exception = int(path.parent.name), kind[1] if kind else ""
                found.append(RankError(node, local_rank, ts, written_ns, text, raised_in, exception))
    return sorted(found, key=lambda e: (e.timestamp, e.written_ns))


# What a healthy rank reports when a peer died or hung (gloo, NCCL, c10d): the console's rule for which
# tracebacks to hide (``launcher.job.aftermath``). No decision of the job's end reads it.
_PEER_ERROR = re.compile(
    r"connection (?:closed|reset|refused)|closed by peer|broken pipe|timed out|timeout|"
    r"socket (?:closed|error)|ECONNRESET|EPIPE|communicator was aborted|watchdog|"
    r"rendezvous.*(?:closed|shut down)|peer",
    re.IGNORECASE,
)
# torchrun's failure summary: "rank      : 3 (local_rank: 1)" then "exitcode  : -9 (pid: 1234)".
_SUMMARY = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def is_peer_error(message: str) -> bool:
    """Whether a rank's error reads like a peer's death or hang seen from a healthy rank."""
    return _PEER_ERROR.search(message) is not None


@dataclass(frozen=True)
class WorkerDeath:
    node_rank: int
    rank: int
    local_rank: int
    signum: int


def torchrun_summary(record: JobRecord, nnodes: int) -> list[tuple[int, int, int, int]]:
    """(node, rank, local rank, exit code) of each worker in torchrun's failure summary in the node logs
    (``rank      : 3 (local_rank: 1)``, then ``exitcode  : -9``: killed by a signal), by node."""
    found = []
    for node in range(nnodes):
        for rank, local_rank, code in _SUMMARY.findall(log_end(record.node_log(node))):
            found.append((node, int(rank), int(local_rank), int(code)))
    return list(dict.fromkeys(found))  # the summary repeats the root cause: once each


def first_failure(facts: Facts) -> Failure | None:
    """The root cause of the attempt whose ``facts`` (``launcher.job.verdict.Facts``) these are, by the
    order in this module's docstring. A worker the kernel's OOM killer ended with SIGKILL is named out
    of memory; a failure names its worker's exit code where torchrun reported it, else its first failed
    agent's. None when nothing names a cause. Pure."""
    failed_node, ranks, exits = facts.first_failed, facts.ranks, facts.exits
    exit_code = facts.agents[failed_node] if failed_node is not None else None
    nodes = facts.plan.nodes if facts.plan is not None else []
    hosts = {n.node_rank: n.named_host for n in nodes if n.named_host}

    def failed(
        node: int, error: str, code: int | None, local_rank: int | None = None, rank: int | None = None
    ) -> Failure:  # a failure whose error points to its node's log
        error = f"{error}; see {facts.job_dir / node_log_name(node)}"
        return Failure(
            node_rank=node,
            host=hosts.get(node),
            local_rank=local_rank,
            rank=rank,
            exit_code=code,
            error=error,
        )

    if failed_node is not None and (signum := killed_by(exit_code)) is not None:
        error = (
            f"the torchrun agent of node {failed_node} was killed by signal {signum} (exit code {exit_code})"
        )
        return failed(failed_node, error, exit_code)
    if failed_node is not None and facts.transport_error is not None:
        return failed(failed_node, facts.transport_error, exit_code)
    # A worker that wrote its own error died of it (then, e.g., aborted at exit): that error tells more.
    wrote = {(e.node_rank, e.local_rank) for e in facts.errors}
    if deaths := [d for d in facts.deaths if (d.node_rank, d.local_rank) not in wrote]:
        d = deaths[0]
        error = f"rank {d.rank} was killed by {signal_name(d.signum)}; its peers' errors follow from it"
        if d.signum == signal.SIGKILL and (report := facts.oom.get(d.node_rank)) is not None:
            error = out_of_memory(d.rank, d.local_rank, report)
        return failed(
            d.node_rank, error, exits.get((d.node_rank, d.local_rank), exit_code), d.local_rank, d.rank
        )
    if facts.errors:
        first = min(facts.errors, key=lambda e: e.follows)  # stable: the earliest of its class
        worker = (first.node_rank, first.local_rank)
        error = first.message
        if first.exception == "OutOfMemoryError":  # torch's, for an accelerator's memory
            error = f"out of GPU memory: {error}; fix: {GPU_OOM_FIX}"
        return Failure(
            node_rank=first.node_rank,
            host=hosts.get(first.node_rank),
            local_rank=first.local_rank,
            rank=ranks.get(worker),
            exit_code=exits.get(worker, exit_code),
            error=error,
            exception=first.exception or None,
        )
    if failed_node is None:
        return None
    # A worker that exited with a code and wrote no error file (a script's sys.exit, argparse's exit 2).
    if ended := sorted(w for w, code in exits.items() if w[0] == failed_node and code > 0):
        node, local_rank = ended[0]
        code = exits[ended[0]]
        meaning = " (invalid input: its arguments, config or data)" if code == EXIT_USAGE else ""
        return failed(node, f"exited with code {code}{meaning}", code, local_rank, ranks.get(ended[0]))
    return failed(
        failed_node, f"the torchrun agent of node {failed_node} exited with code {exit_code}", exit_code
    )


def out_of_memory(rank: int, local_rank: int, report: OomKilled) -> str:
    """What a rank the kernel's OOM killer ended is named (``report``: its node's ``oom`` report)."""
    gib = 1 << 30
    rss = report.rss.get(local_rank)
    had = f"its RSS {rss / gib:.1f} GiB when last seen, " if rss is not None else ""
    limit = "the limit" if report.scope == "cgroup" else "the host's memory"
    return (
        f"out of host memory: the kernel's OOM killer ended rank {rank} on {report.host} ({had}{limit} "
        f"{report.limit_bytes / gib:.1f} GiB); fix: a smaller --micro-batch-size, fewer ranks per node, "
        "or a larger memory limit"
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


def stop_marker(run_dir: Path, since: float, job_dir: Path) -> StopMarker | None:
    """The ranks' stop marker written at or after ``since`` (epoch seconds), in ``run_dir`` or else in
    its copy in the job record ``job_dir`` (a SLURM job whose run dir is node-local)."""
    return read_stop_marker(run_dir, since) or read_stop_marker(job_dir / RUN_COPY, since)
