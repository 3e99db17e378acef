"""Plan: the exact processes a job will start, rendered from a JobSpec without side effects.

``--dry-run`` prints it, golden tests pin it, and a scheduler executes nothing that is not in it.
Every value in it is a literal, except the documented ``{{placeholders}}`` of ``launcher.job.placeholders``
(values only a node knows at run time), which ``python -m launcher.job.node`` fills in on the node.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, JsonValue

from launcher.job.options import HOST_RE
from launcher.job.spec import JobSpec, SpecError

FactsT = TypeVar("FactsT", bound="Facts")


def node_log_name(node_rank: int) -> str:
    """The file name of node ``node_rank``'s log in the job record."""
    return f"node-{node_rank}.log"


def container_name(job_id: str, node_rank: int) -> str:
    """The name of node ``node_rank``'s container of ``job_id`` on its host (the agent's and compose's)."""
    return f"gptlaunch-{job_id}-node{node_rank}"


class NodePlan(BaseModel):
    """What one node runs: argv (no shell), the environment it adds, and where."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node_rank: int
    host: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    log: str  # file name inside the job dir

    @property
    def named_host(self) -> str | None:
        """The host, when it is a real host name worth showing (not this machine, a placeholder or a
        note like "(allocated by SLURM)")."""
        return self.host if self.host != "localhost" and HOST_RE.fullmatch(self.host) else None

    @property
    def label(self) -> str:
        """How the node's output lines are prefixed: ``node1``, or ``gpu-b node1`` with a named host."""
        return f"{self.named_host} node{self.node_rank}" if self.named_host else f"node{self.node_rank}"

    def shell_command(self) -> str:
        """One shell line equivalent to running ``argv`` with ``env`` in ``cwd``: every value quoted,
        so it can be pasted into a terminal or sent over ssh as is."""
        # Prefix assignments (not `env K=V`, which would take an argv[0] containing "=" for one more).
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"cd -- {shlex.quote(self.cwd)} && {env} {shlex.join(self.argv)}"


class Plan(BaseModel):
    """Every node's process, plus files the scheduler writes (sbatch script, compose file, ...)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str
    scheduler: str
    nnodes: int
    nproc_per_node: int
    rdzv_endpoint: str
    run_dir: str
    nodes: list[NodePlan]
    files: dict[str, str] = {}
    # The file of ``files`` that is the job itself (an sbatch script): what `launcher render` prints.
    primary: str | None = None
    # What the scheduler's resolve step found at submit (free port, workdir, GPU slices, hosts):
    # recorded here, apart from the user's spec, as JSON; read back typed by its scheduler alone
    # (``facts_as``). Not a tagged union of every scheduler's Facts: each is defined beside its
    # scheduler, and every command reads Plans without importing the schedulers (SLURM's imports
    # submitit, compose's the Docker SDK), which a union would make them do.
    facts: dict[str, JsonValue] = {}

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def facts_as(self, model: type[FactsT]) -> FactsT:
        """The facts as the scheduler's own model. Raises pydantic's ValidationError when they are
        another scheduler's or another version's."""
        return model.model_validate(self.facts)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True)

    def to_text(self) -> str:
        """Readable form for ``launcher render`` and ``--dry-run``: the primary file when there is one
        (it holds every node's command), else every node's command line."""
        if self.primary is not None:
            return self.files[self.primary]
        lines = [
            f"job {self.job_id} on scheduler {self.scheduler}: {self.nnodes} node(s) × "
            f"{self.nproc_per_node} process(es) = world_size {self.world_size}",
            f"rendezvous endpoint {self.rdzv_endpoint}; run dir {self.run_dir}",
        ]
        if self.facts:
            lines.append(
                "resolved at submit: " + ", ".join(f"{k}={v}" for k, v in sorted(self.facts.items()))
            )
        for node in self.nodes:
            lines += ["", f"# node {node.node_rank} on {node.host} (log: {node.log})", node.shell_command()]
        for name, content in sorted(self.files.items()):
            lines += ["", f"# file {name}", content.rstrip("\n")]
        return "\n".join(lines) + "\n"


class Facts(BaseModel):
    """What a scheduler's ``resolve`` found at submit (a free port, hosts, GPU slices, an image id),
    recorded in the Plan apart from the user's spec. Each scheduler extends it with its own fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    workdir: str  # absolute: every node's processes start there


class UnresolvedHosts(SpecError):
    """Hosts whose names do not resolve on this machine, so the checks that reach them (parity, routes,
    a free port) cannot run. ``facts``: the job's facts without those checks, for a dry run to print
    the Plan with these hosts marked (``launcher submit`` itself refuses the job)."""

    def __init__(self, message: str, hosts: list[str], facts: Facts | None = None) -> None:
        super().__init__(message)
        self.hosts, self.facts = hosts, facts


class NodeCommand(BaseModel):
    """One node's process before it is numbered: where, what, with which added environment."""

    model_config = ConfigDict(frozen=True)
    host: str
    argv: list[str]
    env: dict[str, str]


def build_plan(
    scheduler: str,
    spec: JobSpec,
    facts: Facts,
    job_id: str,
    *,
    endpoint: str,
    run_dir: str,
    nodes: list[NodeCommand],
    files: dict[str, str] | None = None,
    primary: str | None = None,
) -> Plan:
    """The Plan of ``nodes`` (node k is the k-th, all in ``facts.workdir``, each logging to its
    ``node-<k>.log``). ``run_dir``: the trainer's, relative ones taken in the workdir as it does."""
    return Plan(
        job_id=job_id,
        scheduler=scheduler,
        nnodes=spec.nnodes,
        nproc_per_node=spec.nproc_per_node,
        rdzv_endpoint=endpoint,
        run_dir=str(Path(facts.workdir) / run_dir),
        nodes=[
            NodePlan(
                node_rank=k, host=n.host, argv=n.argv, env=n.env, cwd=facts.workdir, log=node_log_name(k)
            )
            for k, n in enumerate(nodes)
        ],
        files=files or {},
        primary=primary,
        facts=facts.model_dump(mode="json"),
    )


def workdir_of(spec: JobSpec, *, files_here: bool) -> str:
    """The job's absolute working directory. Raises SpecError when the nodes see this machine's files
    (``files_here``) and it is not a directory here."""
    workdir = (spec.workdir or Path.cwd()).absolute()
    if files_here and not workdir.is_dir():
        raise SpecError(f"workdir (--workdir) {workdir} is not a directory")
    return str(workdir)
