"""The SSH scheduler's options."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from launcher.job.options import ContainerOptions, Flag, GateOptions, WarmOptions
from launcher.schedulers.ssh.client import MAX_PARALLEL, SSH_OPT_RE, check_host

# ssh -o options the launcher sets itself (lower-case) and the setting that replaces them.
SSH_MANAGED = {
    "batchmode": "nothing: a launch cannot answer prompts",
    "stricthostkeychecking": "--ssh-host-key-check",
    "connecttimeout": "--ssh-connect-timeout-s",
    "controlmaster": "nothing: the launcher multiplexes connections itself",
    "controlpath": "nothing: the launcher multiplexes connections itself",
    "controlpersist": "nothing: the launcher multiplexes connections itself",
    "serveraliveinterval": "nothing: the keep-alives are how a dead host is noticed",
    "serveralivecountmax": "nothing: the keep-alives are how a dead host is noticed",
    "loglevel": "nothing: the launcher reads ssh's errors to explain them",
    "requesttty": "nothing: a terminal would change how signals and output travel",
}


class SshOptions(ContainerOptions, GateOptions, WarmOptions):
    """The SSH scheduler: one torchrun agent per host, started through the system OpenSSH client."""

    runtimes: ClassVar[tuple[str, ...]] = ("docker", "podman")
    scheduler: ClassVar[str] = "launcher.schedulers.ssh.scheduler:SshScheduler"
    kind: Literal["ssh"] = Field("ssh", description="where the job runs (ssh: hosts reached by ssh)")
    hosts: Annotated[list[str], Flag("--hosts", metavar="H1,H2,...", split=",")] = Field(
        default_factory=list,
        description="the hosts, comma-separated ([user@]host or ~/.ssh/config aliases); the first --nodes "
        "of them run the job, the first hosts the rendezvous; or --hostfile",
    )
    hostfile: Path | None = Field(
        None, description="file of hosts, one `host [slots=N]` per line, # comments (or hosts)"
    )
    ssh_opts: Annotated[list[str], Flag("--ssh-opt", metavar="KEY=VALUE")] = Field(
        default_factory=list,
        description="an ssh option for every connection (ssh -o), e.g. ProxyJump=bastion (repeatable)",
    )
    host_key_check: Annotated[Literal["yes", "accept-new"], Flag("--ssh-host-key-check")] = Field(
        "yes",
        description="StrictHostKeyChecking: yes (a host must be in known_hosts) or accept-new (record "
        "the key of a host seen for the first time; a changed key is still refused)",
    )
    connect_timeout_s: Annotated[int, Flag("--ssh-connect-timeout-s")] = Field(
        10,
        ge=1,
        le=300,
        description="seconds to wait for each ssh connection",
    )
    sync: Annotated[Path | None, Flag("--sync", metavar="DIR")] = Field(
        None,
        description="a directory here (your code) copied into the workdir on every host before launch, "
        "with rsync over these ssh settings: for hosts that share no file system with this machine",
    )
    max_parallel: Annotated[int, Flag("--ssh-max-parallel")] = Field(
        MAX_PARALLEL,
        ge=1,
        le=1024,
        description=f"ssh clients at once when probing, pulling on and checking the hosts (default "
        f"{MAX_PARALLEL}: 1,000 hosts in 16 waves without 1,000 processes here; through one ProxyJump "
        "bastion use 10, where sshd's MaxStartups starts dropping connections). The job itself and the "
        "collective preflight hold one connection per host",
    )

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        for host in v:
            check_host(host)
        if len(set(v)) != len(v):
            raise ValueError("a host is listed twice")
        return v

    @field_validator("ssh_opts")
    @classmethod
    def _opts(cls, v: list[str]) -> list[str]:
        for option in v:
            if not SSH_OPT_RE.fullmatch(option):
                raise ValueError(f"{option!r} is not an ssh option: use KEY=VALUE, e.g. Port=2222")
            instead = SSH_MANAGED.get(option.split("=", 1)[0].lower())
            if instead:
                raise ValueError(f"ssh option {option!r} is set by the launcher: use {instead}")
        return v

    @field_validator("sync")
    @classmethod
    def _sync(cls, v: Path | None) -> Path | None:
        # Absolute as given: the supervisor that copies to a spare host may run from elsewhere.
        return None if v is None else v.absolute()

    @model_validator(mode="after")
    def _one_host_list(self) -> SshOptions:
        if bool(self.hosts) == (self.hostfile is not None):
            raise ValueError(
                "give the hosts either as hosts (--hosts h1,h2) or as a hostfile (--hostfile FILE)"
            )
        if self.warm_workers and self.image is not None:
            raise ValueError(
                "--warm-workers forks the ranks from the hosts' own Python, and an --image job runs them in "
                "containers: drop one of them"
            )
        return self
