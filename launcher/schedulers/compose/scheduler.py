"""The compose scheduler: one container per node on one Docker engine, on the job's own network.
``submit`` creates them with ``<compose> up --no-start`` (the Docker SDK has no compose API); the
supervisor follows one ``docker start --attach --interactive`` per node as that node's agent (its output
the node log, its exit code the container's, the secrets on its stdin); stopping a node is ``docker
kill --signal TERM`` (torchrun forwards it, the ranks checkpoint); whatever the end, ``<compose> down``
removes the containers and the network."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import psutil
from docker.errors import DockerException

from gptlaunch.files import atomic_write_text
from launcher.image.engine import DockerError, connect, engine_env, with_engine
from launcher.job.hang import watch_args
from launcher.job.plan import Facts, NodeCommand, NodePlan, Plan, build_plan, container_name, workdir_of
from launcher.job.record import JobRecord
from launcher.job.spec import JobSpec, SpecError
from launcher.job.torchrun import IMAGE_PYTHON, agent_env, node_agents, worker_argv
from launcher.preflight.probe import IMAGE_DIGEST_ENV
from launcher.schedulers.compose.file import COMPOSE_FILE, Mount, render, service_name
from launcher.schedulers.compose.options import ComposeOptions
from launcher.supervisor import procs
from launcher.supervisor.scheduler import SupervisedScheduler
from launcher.supervisor.supervisor import SupervisorHandle, start_supervisor
from launcher.supervisor.transport import Transport, start_client
from trainer.precheck import expand_text_files, parse_train_args

CONTAINER_IFNAME = "eth0"  # a container's interface on the job network
DEFAULT_RDZV_PORT = 29500  # each container has its own ports: no need to look for a free one
COMPOSE_TIMEOUT_S = 300.0


class ComposeFacts(Facts):
    image: str  # as the user named it
    image_id: str  # what every node runs
    compose: list[str]  # the compose client's argv
    docker_env: dict[str, str]  # the engine's DOCKER_* variables: every later call goes there
    gpus: bool
    user: str  # uid:gid the containers run as
    rdzv_port: int
    omp_num_threads: int | None
    writable: tuple[str, ...] = ()  # host paths mounted read-write, created before the containers (render)


class ComposeScheduler(SupervisedScheduler):
    name = "compose"
    files_here = True  # the containers see the job's paths where this machine does (bind mounts)

    def resolve(self, spec: JobSpec) -> ComposeFacts:
        """The image's id (all nodes run exactly it), the compose client, whether to reserve GPUs, the
        user the containers run as. Raises DockerError (no engine, no such image, no compose client)."""
        opts = spec.options(ComposeOptions)
        if spec.rendezvous.endpoint is not None:
            raise SpecError("rendezvous.endpoint (--rdzv-endpoint): with compose, node0 hosts the rendezvous")
        if "python" in spec.model_fields_set:
            raise SpecError("python (--python): with compose, the image's Python runs torchrun; drop it")
        workdir = workdir_of(spec, files_here=self.files_here)
        client = connect()
        if shutil.which("docker") is None:  # the agents are `docker start --attach` clients
            raise DockerError(
                "the docker CLI is not installed: install it (Debian: apt-get install docker.io)"
            )
        try:
            image_id = client.images.get(opts.image).id
        except DockerException:  # not found, or a reference the engine cannot parse
            raise DockerError(
                f"image (--image) {opts.image} is not in the engine: build it (`launcher build --tag "
                f"{opts.image}`) or pull it"
            ) from None
        gpus = opts.gpus if opts.gpus is not None else "nvidia" in (client.info().get("Runtimes") or {})
        return ComposeFacts(
            workdir=workdir,
            image=opts.image,
            image_id=image_id,
            compose=compose_command(opts.compose_command),
            docker_env=engine_env(),
            gpus=gpus,
            user=f"{os.getuid()}:{os.getgid()}",
            rdzv_port=spec.rendezvous.port or DEFAULT_RDZV_PORT,
            omp_num_threads=_threads(spec),
        )

    def render(self, spec: JobSpec, facts: ComposeFacts, job_id: str, job_dir: Path) -> Plan:
        endpoint = f"{service_name(0)}:{facts.rdzv_port}"
        worker, run_dir = worker_argv(spec, job_dir / "run")
        inside = spec.model_copy(update={"python": IMAGE_PYTHON})
        env = agent_env(spec, job_id, facts.omp_num_threads, run_dir) | {
            IMAGE_DIGEST_ENV: facts.image_id,
            "HOME": "/tmp",  # the submitting user has no home in the image
        }
        env = {"NCCL_SOCKET_IFNAME": CONTAINER_IFNAME, "GLOO_SOCKET_IFNAME": CONTAINER_IFNAME} | env
        gpus = spec.nproc_per_node if facts.gpus else 0
        agents = node_agents(inside, endpoint=endpoint, job_id=job_id, job_dir=job_dir, worker=worker)

        def entry(k: int) -> list[str]:
            return [
                IMAGE_PYTHON, "-m", "launcher.schedulers.compose.node", "--job-dir", str(job_dir),
                "--node", str(k), "--nodes", str(spec.nnodes), "--gpus-per-node", str(gpus),
                *(["--skip-parity"] if spec.options(ComposeOptions).skip_parity else []),
                *watch_args(spec.hang, spec.nproc_per_node), "--",
            ]  # fmt: skip

        nodes = [  # host: the engine's machine; the service is node{k}
            NodeCommand(host="localhost", argv=[*entry(k), *agent], env=env) for k, agent in enumerate(agents)
        ]
        args = [*spec.trainer_args, "--run-dir", run_dir]  # the paths to mount (a program has none)
        mounts = job_mounts(args, Path(facts.workdir), job_dir, Path(facts.workdir) / run_dir)
        if spec.program is not None:  # its code and files: the working directory, as a bare node sees it
            mounts.append((str(Path(facts.workdir).absolute()), False))
        facts = facts.model_copy(
            update={"writable": tuple(path for path, read_only in mounts if not read_only)}
        )
        plan = build_plan(self.name, spec, facts, job_id, endpoint=endpoint, run_dir=run_dir, nodes=nodes)
        text = render(
            job_id,
            plan.nodes,
            image_id=facts.image_id,
            user=facts.user,
            mounts=mounts,
            shm_size=spec.options(ComposeOptions).shm_size,
            gpus_per_node=gpus,
        )
        return plan.model_copy(update={"files": {COMPOSE_FILE: text}, "primary": COMPOSE_FILE})

    def submit(self, plan: Plan, record: JobRecord, *, detach: bool) -> SupervisorHandle:
        """Write the compose file, create the network and containers, and start following them."""
        compose = Compose(plan, record.dir)
        atomic_write_text(compose.file, plan.files[COMPOSE_FILE])
        for path in plan.facts_as(ComposeFacts).writable:
            Path(path).mkdir(parents=True, exist_ok=True)  # else the engine makes it, owned by root
        try:
            compose.create()
            return start_supervisor(plan, record, detach=detach)
        except BaseException:  # refused, timed out or Ctrl-C: nothing will follow what was created
            if not record.has_handle():
                with contextlib.suppress(DockerError):
                    compose.down(0)
            raise

    def transport(self, plan: Plan, record: JobRecord) -> ComposeAgents:
        return ComposeAgents(Compose(plan, record.dir), record.spec().secrets_here())

    def remaining(self, record: JobRecord) -> str:
        """The containers that still run; the stopped ones (and the network) of a job nothing follows any
        more are removed here, so that a job whose supervisor died leaves nothing either."""
        compose = Compose(record.plan(), record.dir)
        try:
            running = compose.listed(stopped=False)
            if not running and compose.listed(stopped=True):
                compose.down(0)
        except DockerError as e:  # e.g. the engine is down: say so, end nothing we cannot see
            return f"its containers cannot be checked or removed ({e}); start the engine and ask again"
        if running:
            return f"container(s) {', '.join(running)} still run (`launcher cancel` stops them)"
        return ""

    def sweep(self, record: JobRecord, grace_s: float) -> None:
        Compose(record.plan(), record.dir).down(grace_s)


def _threads(spec: JobSpec) -> int | None:
    """OMP_NUM_THREADS of each rank: the engine's machine is this one, its cores shared out as the local
    scheduler does (None: the user set it with --env)."""
    if spec.omp_num_threads or "OMP_NUM_THREADS" in spec.network.env:
        return spec.omp_num_threads
    return max(1, (os.cpu_count() or 1) // spec.world_size)


def compose_command(choice: str) -> list[str]:
    """The compose client's argv: ``docker compose`` (v2) if it answers, else ``docker-compose`` (v1),
    or the one ``choice`` names. Raises DockerError when it is not installed."""
    candidates = [["docker", "compose"], ["docker-compose"]]
    if choice != "auto":
        candidates = [choice.split()]
    for argv in candidates:
        try:
            if subprocess.run([*argv, "version"], capture_output=True, timeout=30).returncode == 0:
                return argv
        except (OSError, subprocess.TimeoutExpired):
            continue
    wanted = "`docker compose` (v2) or `docker-compose` (v1)" if choice == "auto" else f"`{choice}`"
    raise DockerError(f"{wanted} is not installed: install it (Debian: apt-get install docker-compose)")


def job_mounts(trainer_args: list[str], workdir: Path, job_dir: Path, run_dir: Path) -> list[Mount]:
    """The host paths a job's containers need, at the same paths: the job dir, run dir and data dir
    (read-write), the text files and a resume checkpoint (read-only). Relative trainer paths are the
    workdir's."""
    cfg = parse_train_args(trainer_args)

    def here(path: str | Path) -> str:
        return str((workdir / path).absolute())

    mounts = {here(job_dir): False, here(run_dir): False, here(cfg.data_dir): False}
    for text in _text_files([here(p) for p in cfg.text_files]):
        mounts.setdefault(text, True)
    if cfg.resume not in ("auto", "never"):
        mounts.setdefault(here(cfg.resume), True)
    return list(mounts.items())


def _text_files(patterns: list[str]) -> list[str]:
    """The files the trainer will open, by the names it will open them with: patterns expanded, symlinks
    kept (the engine follows a symlink on the host side of a bind mount; inside, only the name given
    exists). Raises DataError for a missing file or a pattern that matches none."""
    if patterns:
        expand_text_files(patterns)  # the trainer's own checks and messages
    found: list[str] = []
    for pattern in map(os.path.expanduser, patterns):
        if glob.has_magic(pattern):
            found += [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
        else:
            found.append(pattern)
    return found


class Compose:
    """The compose project of one job: its file in the job dir, its client, its containers."""

    def __init__(self, plan: Plan, job_dir: Path) -> None:
        self.plan, self.file = plan, job_dir / COMPOSE_FILE
        facts = plan.facts_as(ComposeFacts)
        project = re.sub(r"[^a-z0-9_-]", "-", f"gptlaunch-{plan.job_id}".lower())
        self.argv = [*facts.compose, "--project-name", project, "--file", str(self.file)]
        # Every docker and compose call goes to the engine the image was found on, whatever the DOCKER_HOST
        # or docker context of the shell that runs `status` or `cancel` later.
        self.env = with_engine(facts.docker_env)

    def containers(self) -> list[str]:
        return [container_name(self.plan.job_id, n.node_rank) for n in self.plan.nodes]

    def run(self, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        """Run a docker or compose command against the job's engine. Raises DockerError when it cannot
        run or does not end within ``timeout_s`` seconds."""
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=self.env)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise DockerError(f"`{' '.join(argv[:2])}` failed: {e}") from None

    def create(self) -> None:
        """Create the network and every container (started later, one agent each). Raises DockerError."""
        proc = self.run([*self.argv, "up", "--no-start"], COMPOSE_TIMEOUT_S)
        if proc.returncode != 0:
            raise DockerError(f"compose could not create the job's containers: {_last_lines(proc.stderr)}")

    def listed(self, *, stopped: bool) -> list[str]:
        """The job's containers that run (and that have stopped but exist, if ``stopped``)."""
        label = f"label=io.gptlaunch.job={self.plan.job_id}"
        which = ["--all"] if stopped else []
        proc = self.run(["docker", "ps", *which, "--filter", label, "--format", "{{.Names}}"], 60)
        if proc.returncode != 0:
            raise DockerError(f"cannot list the job's containers: {_last_lines(proc.stderr)}")
        return proc.stdout.split()

    def down(self, grace_s: float) -> None:
        """Stop (TERM, KILL after ``grace_s`` seconds) and remove the containers and the network. Raises
        DockerError naming the command that removes them by hand when compose fails."""
        grace = str(max(0, round(grace_s)))
        proc = self.run(
            [*self.argv, "down", "--timeout", grace, "--remove-orphans"], COMPOSE_TIMEOUT_S + grace_s
        )
        if proc.returncode != 0:
            raise DockerError(
                f"compose could not remove the job's containers ({_last_lines(proc.stderr)}); remove them "
                f"with `{shlex.join([*self.argv, 'down'])}`"
            )


def _last_lines(text: str) -> str:
    return " / ".join(text.strip().splitlines()[-3:]) or "no output"


class ComposeAgents(Transport):
    """The supervisor's transport for compose: one ``docker start --attach --interactive`` per node."""

    def __init__(self, compose: Compose, secrets: dict[str, str]) -> None:
        self.compose, self.secrets = compose, secrets

    def start(self, node: NodePlan, record: JobRecord) -> subprocess.Popen[bytes]:
        # The secrets are read once by launcher.schedulers.compose.node, which gives them to torchrun
        # only. Stdin stays open: at its end, `docker start --attach` detaches and the node log would
        # stay empty.
        argv = ["docker", "start", "--attach", "--interactive", container_name(record.job_id, node.node_rank)]
        return start_client(argv, record.dir / node.log, self.secrets, keep_stdin=True, env=self.compose.env)

    def stop(self, agents: list[subprocess.Popen[bytes]]) -> None:
        names = [c for c, a in zip(self.compose.containers(), agents, strict=False) if a.poll() is None]
        if names:
            try:
                self.compose.run(["docker", "kill", "--signal", "TERM", *names], 60)
            except DockerError as e:  # the end of the grace period kills them all (kill below)
                print(f"stopping the containers: {e}", file=sys.stderr, flush=True)

    def renew(self, record: JobRecord, failed_hosts: Sequence[str]) -> None:
        """The containers anew (``kill`` removed them), on the same engine. Raises OSError."""
        try:
            self.compose.create()
        except DockerError as e:
            raise OSError(str(e)) from None

    def kill(self, job_id: str, grace_s: float) -> None:
        try:
            self.compose.down(grace_s)
        except DockerError as e:  # the supervisor must still record the job's end; its log says this
            print(e, file=sys.stderr, flush=True)
        procs.terminate(psutil.Process().children(recursive=True), grace_s)  # docker clients
