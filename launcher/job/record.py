"""Job records: one directory per job holding the spec, the Plan, the scheduler's handle, per-node logs
and the status, for every scheduler.

Layout of ``<jobs root>/<job id>/``::

    spec.json      what the user asked for (JobSpec), never rewritten
    plan.json      what runs: every node's command, and the facts resolved at submit (written last of
                   the two: its presence marks a complete record)
    status.json    the job's state (JobStatus), rewritten as the job moves on
    handle.json    how the scheduler finds the job again (typed by the scheduler: pids, a job id, ...)
    node-<k>.log   node k's output; torchelastic/node-<k>/ its workers' error files
    reports/       the nodes' typed reports (``launcher.job.reports``); heartbeat/node-<k>/ the ranks'
                   beats where the nodes see the record; agent/ the local node agents' own files

Every file is written atomically (temporary file, fsync, rename), so a reader or a crash never sees
a half-written record.
"""

from __future__ import annotations

import fcntl
import glob
import itertools
import secrets
import shlex
import shutil
import socket
import time
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gptlaunch.contract import EXIT_FAILED
from gptlaunch.files import atomic_write_text
from launcher.job.plan import Plan, node_log_name
from launcher.job.spec import JobSpec

ModelT = TypeVar("ModelT", bound=BaseModel)


class JobState(StrEnum):
    """One set of states for every scheduler (listed in `launcher --help` and the docs' reference)."""

    CREATED = "created"  # the record is written; the job is not submitted yet
    PENDING = "pending"  # accepted by the scheduler, waiting for resources (a SLURM queue)
    RUNNING = "running"
    SUCCEEDED = "succeeded"  # every rank finished (exit 0)
    FAILED = "failed"  # a rank or a node failed; the job was stopped (exit 1)
    CHECKPOINTED = "checkpointed"  # stopped on request after the ranks saved a checkpoint (exit 75)
    CANCELLED = "cancelled"  # stopped on request before any checkpoint (exit 130)
    LOST = "lost"  # whatever followed the job died without recording its end; nothing of it runs
    UNKNOWN = "unknown"  # the job ended while nothing followed it: see its logs and run dir

    @property
    def is_terminal(self) -> bool:
        return self not in (JobState.CREATED, JobState.PENDING, JobState.RUNNING)


STATE_MEANINGS: dict[JobState, str] = {
    JobState.CREATED: "the job record is written; the job is not started yet",
    JobState.PENDING: "accepted by a queueing scheduler, waiting for resources (SLURM)",
    JobState.RUNNING: "the nodes are running",
    JobState.SUCCEEDED: "every rank finished",
    JobState.FAILED: "a rank or node failed; the others were stopped; `status` names the node, rank, error",
    JobState.CHECKPOINTED: "stopped on request after every rank saved a checkpoint: resubmit to resume",
    JobState.CANCELLED: "stopped on request before a checkpoint could be saved",
    JobState.LOST: "whatever followed the job died before recording its end, and nothing of the job runs",
    JobState.UNKNOWN: "the job ended while nothing observed it: see its node logs and run dir",
}


def state_help() -> str:
    """One state per line, with its meaning (``STATE_MEANINGS``), for the ``--help`` epilogs."""
    rows = [f"  {state.value:<13}{STATE_MEANINGS[state]}" for state in JobState]
    terminal = sum(state.is_terminal for state in JobState)
    return "\n".join([f"job states (the last {terminal} are terminal):", *rows])


class JobNotFound(LookupError):
    """No job record by that id or path."""


class JobError(RuntimeError):
    """A request about a job that cannot be carried out from here; the message says why and where."""


class RecordError(JobError, ValueError):
    """A file of a job record is missing, is not JSON, or does not fit this launcher's models (another
    version wrote it, or a submit stopped half-way); the message names the file and the fix. A
    ValueError too, like the ValidationError it stands for, so that callers that skip malformed files
    still do."""

    def __init__(self, path: Path, problem: str) -> None:
        self.path = path
        super().__init__(
            f"{path} {problem}: the job record was written by another version of the launcher, or only "
            f"in part; use the version that wrote it, or remove the record with `rm -r "
            f"{shlex.quote(str(path.parent))}`"
        )


def _read(model: type[ModelT], path: Path) -> ModelT:
    """``path`` validated as ``model``. Raises RecordError if it is missing, not JSON or does not fit;
    OSError if it cannot be read for another reason (permissions)."""
    try:
        return model.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        raise RecordError(path, "is missing") from None
    except ValidationError as e:
        raise RecordError(path, _problem(e)) from None


def _problem(e: ValidationError) -> str:
    """The first error of ``e`` in a few words, e.g. "has an unknown field 'nodes.0.foo' (and 2 more
    problems)": pydantic's own text is a dozen lines per error."""
    errors = e.errors(include_url=False)
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"])
    if first["type"] == "json_invalid":
        problem = f"is not valid JSON ({first['msg'].removeprefix('Invalid JSON: ')})"
    elif not where:
        problem = f"is not a record of this launcher ({first['msg']})"
    elif first["type"] == "extra_forbidden":
        problem = f"has an unknown field {where!r}"
    elif first["type"] == "missing":
        problem = f"lacks the field {where!r}"
    else:
        problem = f"has an invalid field {where!r} ({first['msg']})"
    more = len(errors) - 1
    return problem + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else "")


class Failure(BaseModel):
    """The root cause of a failed job: the first rank that failed and its error."""

    model_config = ConfigDict(extra="forbid")
    node_rank: int
    host: str | None = None  # the node's host, where the scheduler names one (SSH)
    rank: int | None = None
    local_rank: int | None = None
    exit_code: int | None = None  # the failed worker's, where torchrun reported it, else its agent's
    error: str = ""
    exception: str | None = None  # the type of the rank's exception (torchelastic's error record)

    def summary(self) -> str:
        who = f"node {self.node_rank}" + (f" (host {self.host})" if self.host else "")
        if self.rank is not None:
            who += f", rank {self.rank}"
        if self.local_rank is not None:
            who += f" (local_rank {self.local_rank})"
        return f"{who} failed: {self.error}"


class ProcessRef(BaseModel):
    """A process on host ``host``; its create time (epoch seconds) tells a reused pid apart."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    pid: int
    started: float
    host: str = Field(default_factory=socket.gethostname)


class Outcome(BaseModel):
    """How a job ended: what ``JobRecord.finish`` records."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    state: JobState
    exit_code: int
    message: str = ""
    failure: Failure | None = None
    # A hang's: the nodes of the ranks that stand out; the nodes a health gate named (node ranks).
    suspect_nodes: list[int] = []

    @property
    def cause(self) -> str:
        """One line: the root cause's summary, else the message."""
        return self.failure.summary() if self.failure is not None else self.message

    def blamed_nodes(self) -> list[int]:
        """The node ranks a retry should avoid: the failed rank's node, else the suspects' (a hang's,
        or the nodes a health gate named)."""
        return [self.failure.node_rank] if self.failure is not None else self.suspect_nodes


class Attempt(BaseModel):
    """One ended attempt of a job that retries (``JobSpec.retries``). Times are epoch seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    number: int  # 1 for the first
    started_at: float
    ended_at: float  # when its end was known (the failure detected)
    cleaned_at: float | None = None  # when its processes were gone and the next nodes chosen
    exit_code: int
    cause: str  # one line: the failure's summary, the hang, ...
    step: int | None = None  # the furthest step its ranks reported, where known
    failure: Failure | None = None
    replaced: dict[str, str] = {}  # host -> the spare the next attempt runs on instead
    excluded: list[str] = []  # hosts the next attempt may not run on (SLURM: --exclude)

    def describe(self) -> str:
        at = f" at step {self.step:,}" if self.step is not None else ""
        spares = "".join(f"; {old} → replaced by {new}" for old, new in self.replaced.items())
        excluded = f"; {', '.join(self.excluded)} excluded" if self.excluded else ""
        return f"attempt {self.number}{at}: {self.cause}{spares}{excluded}"


class Failing(BaseModel):
    """The controller found attempt ``attempt`` failing at ``at`` (epoch seconds). Written before it
    stops anything, then again once the verdict is known (``decided``), naming the rank that failed
    (``node``, ``rank``; None where the cause is no one rank's: a hang, a lost host). What the ranks
    and torchruns print from then on follows from the failure, but for that rank's own lines: the
    console leaves it to the node logs (``launcher.job.survivors``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    attempt: int
    at: float
    decided: bool = False
    node: int | None = None
    rank: int | None = None


class JobStatus(BaseModel):
    """Where a job is. Times are epoch seconds."""

    model_config = ConfigDict(extra="forbid")
    state: JobState = JobState.CREATED
    exit_code: int | None = None  # set with a terminal state
    created_at: float
    started_at: float | None = None
    ended_at: float | None = None
    submitter: ProcessRef | None = None  # the `launcher submit` that wrote the record
    stop_requested_at: float | None = None  # when `launcher cancel` first asked it to stop
    failure: Failure | None = None
    message: str = ""
    attempt: int = 1  # the attempt running (or the last one)
    attempt_started_at: float | None = None  # when it started (``started_at``: the job's first)
    attempts: list[Attempt] = []  # the attempts that ended before it, oldest first
    failing: Failing | None = None  # the running attempt, once the controller found it failing

    @property
    def job_exit_code(self) -> int:
        """The exit code `launcher submit` and `launcher wait` return for this (terminal) status."""
        return self.exit_code if self.exit_code is not None else EXIT_FAILED


def new_job_id(name: str) -> str:
    """``<name>-<UTC yyyymmdd-hhmmss>-<6 hex>``: sortable by time and unique."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def torchelastic_dir(job_dir: Path, node_rank: int) -> Path:
    """Where node ``node_rank``'s torchrun agent writes its workers' error files."""
    return job_dir / "torchelastic" / f"node-{node_rank}"


def agent_dir(job_dir: Path) -> Path:
    """Where node agents that run on this machine (the local scheduler's) keep their pid and exit
    files and their processes' reports (``launcher.agent.cli --state-dir``)."""
    return job_dir / "agent"


class JobRecord:
    """The directory of one job."""

    def __init__(self, path: Path, created_dir: bool = False) -> None:
        self.dir = path
        self._created_dir = created_dir  # whether create() made the directory (discard() removes it)

    @property
    def job_id(self) -> str:
        return self.plan().job_id

    @staticmethod
    def check_new(path: Path) -> None:
        """Raises FileExistsError when ``path`` holds anything: a new job's record needs a new or empty
        directory."""
        if path.is_dir() and any(path.iterdir()):
            what = "a job record" if (path / "plan.json").exists() else "files"
            raise FileExistsError(f"{path} already holds {what}: choose another --job-dir")

    @classmethod
    def create(cls, path: Path, spec: JobSpec, plan: Plan, status: JobStatus) -> JobRecord:
        """Make the record of a new job in ``path``, a new or empty directory. Raises FileExistsError if
        it holds anything."""
        created = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
        cls.check_new(path)
        rec = cls(path, created_dir=created)
        atomic_write_text(path / "spec.json", spec.model_dump_json(indent=2, exclude_unset=True))
        rec.write_status(status)
        rec.write_plan(plan)  # written last: it marks a complete record
        return rec

    @classmethod
    def open(cls, ref: str, jobs_root: Path) -> JobRecord:
        """A job by id (under ``jobs_root``, or a sweep's run: under its sweep's directory there) or by
        directory path. Raises JobNotFound, or RecordError for a record whose submit stopped before it
        wrote the Plan."""
        in_sweeps = jobs_root.glob(f"*/{glob.escape(ref)}/plan.json") if "/" not in ref else iter(())
        for plan in itertools.chain((jobs_root / ref / "plan.json", Path(ref) / "plan.json"), in_sweeps):
            if plan.is_file():  # the sweeps are looked in only when neither is (a glob is lazy)
                return cls(plan.parent)
        for path in (jobs_root / ref, Path(ref)):
            if (path / "spec.json").is_file():
                raise RecordError(path / "plan.json", "is missing")
        raise JobNotFound(f"no job {ref!r} in {jobs_root} (see `launcher list`, or pass the job directory)")

    def discard(self) -> None:
        """Remove the record of a job that never started (the scheduler refused it): everything in
        its directory, and the directory if ``create`` made it."""
        if self._created_dir:
            shutil.rmtree(self.dir)
            return
        for path in self.dir.iterdir():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()

    def check(self) -> None:
        """Read every file of the record, so that a command refuses a record of another version
        before it does anything. Raises RecordError (or OSError), as the readers below do. The
        handle is checked for JSON only: its model is the scheduler's."""
        self.plan()
        self.status()
        self.spec()
        self.handle(_AnyJson)

    def spec(self) -> JobSpec:
        """Raises RecordError if missing or malformed, OSError if unreadable (as do the readers below)."""
        return _read(JobSpec, self.dir / "spec.json")

    def plan(self) -> Plan:
        return _read(Plan, self.dir / "plan.json")

    def write_plan(self, plan: Plan) -> None:
        """Replace the Plan (a retry onto other hosts); atomic for its readers."""
        atomic_write_text(self.dir / "plan.json", plan.to_json())

    def status(self) -> JobStatus:
        """The recorded status."""
        return _read(JobStatus, self.dir / "status.json")

    def write_status(self, status: JobStatus) -> None:
        atomic_write_text(self.dir / "status.json", status.model_dump_json(indent=2))

    def update_status(self, *, if_state: JobState | None = None, **changes: Any) -> JobStatus:
        """Apply ``changes`` to the recorded status and return it, unless it is terminal already: a
        terminal status is never replaced (then it is returned unchanged); with ``if_state``, only while
        the recorded state is still that one (a reader's change, derived from what it read before, must
        not undo what a writer recorded since). Writers on this machine (supervisor, ``cancel``, readers
        recording a derived end) take turns on a lock file."""
        with open(self.dir / ".status.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            current = self.status()
            if current.state.is_terminal or if_state not in (None, current.state):
                return current
            updated = current.model_copy(update=changes)
            self.write_status(updated)
            return updated

    def finish(self, outcome: Outcome, ended_at: float | None = None) -> JobStatus:
        """Record how the job ended (``outcome`` and the end time, epoch seconds: ``ended_at``, default
        now), unless an end is recorded already; returns the recorded status."""
        return self.update_status(**dict(outcome), ended_at=ended_at or time.time())

    def handle(self, model: type[ModelT]) -> ModelT | None:
        """The scheduler's handle (None before the job was submitted)."""
        return _read(model, self.dir / "handle.json") if self.has_handle() else None

    def has_handle(self) -> bool:
        """Whether the scheduler accepted the job (and saved how to find it)."""
        return (self.dir / "handle.json").is_file()

    def write_handle(self, handle: BaseModel) -> None:
        atomic_write_text(self.dir / "handle.json", handle.model_dump_json(indent=2))

    def node_log(self, node_rank: int) -> Path:
        return self.dir / node_log_name(node_rank)


class _AnyJson(BaseModel):
    """Any JSON object: what ``check`` asks of a handle."""

    model_config = ConfigDict(extra="allow")


def list_jobs(jobs_root: Path) -> list[JobRecord]:
    """Complete job records under ``jobs_root``, oldest first."""
    if not jobs_root.is_dir():
        return []
    found = [JobRecord(p) for p in jobs_root.iterdir() if (p / "plan.json").is_file()]
    return sorted(found, key=lambda r: (r.dir / "plan.json").stat().st_mtime)
