"""The local scheduler: ``nnodes`` emulated nodes on this machine, one torchrun agent per node.

Agents meet at a c10d rendezvous on 127.0.0.1 at a free port and share the machine: the cores
(OMP_NUM_THREADS = cores / world_size) and, where there are GPUs, the devices (each node sees its
own slice through CUDA_VISIBLE_DEVICES). The job runs attached: output streams to the terminal,
prefixed by node and rank, and into ``node-<k>.log``. If any agent fails, the others are stopped at
once (fail fast); Ctrl-C, SIGTERM, SIGHUP or ``launcher cancel`` ask every rank to checkpoint and exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

from launcher import procs
from launcher.failures import root_cause
from launcher.jobs import FINAL_STATES, JobRecord, JobStatus
from launcher.logs import LogFollower
from launcher.plan import NodePlan, Plan
from launcher.spec import JobSpec, SpecError
from launcher.torchrun import LOG_LINE_PREFIX, torchrun_argv, with_run_dir
from trainer.checkpoint import EXIT_CHECKPOINTED, read_stop_marker

EXIT_INTERRUPTED = 130
FAIL_FAST_GRACE_S = 5.0  # a failed job cannot checkpoint (a peer is gone): stop the rest quickly
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def free_port(host: str) -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it). Raises SpecError when
    ``host`` is not an address of this machine."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    except OSError as e:
        raise SpecError(
            f"rendezvous.endpoint (--rdzv-endpoint) {host!r} is not an address of this machine ({e}): "
            "the local scheduler needs a local address such as 127.0.0.1"
        ) from None


def visible_gpus() -> list[str]:
    """Ids of the GPUs this process may use: CUDA_VISIBLE_DEVICES's list, else 0..count-1."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return listed[:count] if listed else [str(i) for i in range(count)]


class LocalScheduler:
    name = "local"

    def resolve(self, spec: JobSpec) -> JobSpec:
        """Free rendezvous port, absolute workdir, thread and GPU shares. Raises SpecError for what
        cannot run here (no such interpreter or directory, too few GPUs, a non-local endpoint)."""
        if shutil.which(spec.python) is None:
            raise SpecError(
                f"python (--python) {spec.python!r} is not an executable: pass an interpreter path"
            )
        if not spec.workdir.is_dir():
            raise SpecError(f"workdir (--workdir) {spec.workdir} is not a directory")
        rdzv = spec.rendezvous
        endpoint = rdzv.endpoint or "127.0.0.1"
        updates: dict[str, Any] = {
            "workdir": spec.workdir.absolute(),
            "rendezvous": rdzv.model_copy(
                update={"endpoint": endpoint, "port": rdzv.port or free_port(endpoint)}
            ),
        }
        if spec.omp_num_threads is None:
            updates["omp_num_threads"] = max(1, len(os.sched_getaffinity(0)) // spec.world_size)
        gpus = visible_gpus() if spec.local_gpus is None else spec.local_gpus
        if gpus and spec.world_size > len(gpus):
            raise SpecError(
                f"{spec.nnodes} node(s) × {spec.nproc_per_node} process(es) need {spec.world_size} GPUs, "
                f"{len(gpus)} are available: lower --nodes/--gpus-per-node, or set local_gpus: [] (CPU only)"
            )
        updates["local_gpus"] = gpus
        return spec.model_copy(update=updates)

    def render(self, spec: JobSpec, job_id: str, job_dir: Path) -> Plan:
        rdzv = spec.rendezvous
        endpoint = f"{rdzv.endpoint or '127.0.0.1'}:{rdzv.port or 29500}"
        args, run_dir = with_run_dir(spec.trainer_args, job_dir / "run")
        env = {"PYTHONUNBUFFERED": "1", **spec.network.as_env(), procs.JOB_ENV: job_id}
        if spec.omp_num_threads:
            env["OMP_NUM_THREADS"] = str(spec.omp_num_threads)
        nodes = []
        for k in range(spec.nnodes):
            argv = torchrun_argv(
                spec,
                node_rank=k,
                endpoint=endpoint,
                rdzv_id=rdzv.id or job_id,
                log_dir=str(job_dir / "torchelastic" / f"node-{k}"),
                trainer_args=args,
            )
            node_env = env | {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": LOG_LINE_PREFIX}
            if spec.local_gpus:  # node k's GPUs, so every node's LOCAL_RANK 0 is a different device
                first = k * spec.nproc_per_node
                node_env["CUDA_VISIBLE_DEVICES"] = ",".join(
                    spec.local_gpus[first : first + spec.nproc_per_node]
                )
            nodes.append(
                NodePlan(
                    node_rank=k,
                    host="localhost",
                    argv=argv,
                    env=node_env,
                    cwd=str(spec.workdir),
                    log=f"node-{k}.log",
                )
            )
        return Plan(
            job_id=job_id,
            scheduler=self.name,
            nnodes=spec.nnodes,
            nproc_per_node=spec.nproc_per_node,
            rdzv_endpoint=endpoint,
            run_dir=str(spec.workdir / run_dir),  # the trainer resolves a relative one in workdir
            nodes=nodes,
        )

    def launch(self, plan: Plan, record: JobRecord) -> JobStatus:
        procs.become_subreaper()
        stop = _StopOnSignal()
        agents = [_start(node, record) for node in plan.nodes]
        status = JobStatus(
            launcher_pid=os.getpid(),
            launcher_started=psutil.Process().create_time(),
            node_pids=[a.pid for a in agents],
            started_at=time.time(),
        )
        record.write_status(status)
        follower = LogFollower([(f"node{n.node_rank}", record.dir / n.log) for n in plan.nodes], sys.stdout)
        follower.start()
        try:
            final = _Supervisor(agents, stop, record.spec().grace_period_s, plan, record).run()
        except KeyboardInterrupt:  # a second Ctrl-C: stop waiting for checkpoints
            final = JobStatus(state="cancelled", exit_code=EXIT_INTERRUPTED, message="interrupted")
        except Exception as e:  # the launcher itself broke: record it, never leave "running" behind
            final = JobStatus(state="failed", exit_code=1, message=f"launcher error: {e!r}")
        finally:
            stop.ignore()  # cleanup must not be cut short by another Ctrl-C
            procs.terminate(_descendants(), FAIL_FAST_GRACE_S)
            procs.sweep(plan.job_id)
            follower.stop()
            stop.restore()
        return _finish(record, status, final)

    def cancel(self, record: JobRecord) -> JobStatus:
        status = record.status() or JobStatus()
        if status.state in FINAL_STATES:
            return status
        launcher = procs.launcher_process(status.launcher_pid, status.launcher_started)
        if launcher is not None:
            # The launcher owns the job: it relays SIGTERM, waits for checkpoints, records the end.
            launcher.send_signal(signal.SIGTERM)
            grace = record.spec().grace_period_s
            status = _wait_final(record, timeout_s=grace + 3 * FAIL_FAST_GRACE_S) or status
        if status.state not in FINAL_STATES:  # the launcher is gone: stop what is left ourselves
            asked = time.time()
            if procs.sweep(record.job_id, record.spec().grace_period_s):
                final = _stop_outcome(record.plan(), since=asked)
            else:  # it ended on its own while no launcher watched
                message = "the job ended while its launcher was gone: see its node logs and run dir"
                final = JobStatus(state="unknown", message=message)
            status = _finish(record, status, final)
        return status


class _Supervisor:
    """Follows the agents to the job's end: success, fail-fast on the first failure, or a stop."""

    def __init__(
        self,
        agents: list[subprocess.Popen[bytes]],
        stop: _StopOnSignal,
        grace: float,
        plan: Plan,
        record: JobRecord,
    ) -> None:
        self.agents, self.stop, self.grace, self.plan, self.record = agents, stop, grace, plan, record
        self.started = time.time()
        self.stop_at: float | None = None
        self.stop_asked = 0.0  # wall-clock time of the stop request

    def run(self) -> JobStatus:
        while True:
            codes = [a.poll() for a in self.agents]
            if all(c == 0 for c in codes):
                return JobStatus(state="succeeded", exit_code=0)
            if self.stop.requested and self.stop_at is None:
                self._begin_stop()
            failed = [k for k, c in enumerate(codes) if c not in (None, 0)]
            if self.stop_at is not None:
                if all(c is not None for c in codes) or time.monotonic() - self.stop_at > self.grace:
                    return self._stopped()
            elif failed:
                return self._failed(failed[0], codes[failed[0]])
            time.sleep(0.1)

    def _begin_stop(self) -> None:
        self.stop_at, self.stop_asked = time.monotonic(), time.time()
        procs.signal_all([psutil.Process(a.pid) for a in self.agents if a.poll() is None], signal.SIGTERM)

    def _stopped(self) -> JobStatus:
        return _stop_outcome(self.plan, since=self.stop_asked)

    def _failed(self, node: int, code: int | None) -> JobStatus:
        if read_stop_marker(Path(self.plan.run_dir), since=self.started) is not None:
            # A stop signal from outside the launcher (a shutdown, a scheduler): the ranks saved a
            # checkpoint and exited 75, which torchrun reports as a failure. Let every node finish so.
            psutil.wait_procs([psutil.Process(a.pid) for a in self.agents if a.poll() is None], self.grace)
            return _stop_outcome(self.plan, since=self.started)
        procs.terminate(_descendants(), FAIL_FAST_GRACE_S)
        failure = root_cause(self.record, self.plan.nnodes, node, code)
        return JobStatus(state="failed", exit_code=1, failure=failure, message=failure.summary())


def _finish(record: JobRecord, status: JobStatus, outcome: JobStatus) -> JobStatus:
    """``status`` with the fields ``outcome`` sets and the end time, written to the record."""
    update = {name: getattr(outcome, name) for name in outcome.model_fields_set}
    final = status.model_copy(update=update | {"ended_at": time.time()})
    record.write_status(final)
    return final


def _stop_outcome(plan: Plan, since: float) -> JobStatus:
    """ "checkpointed" (exit 75) when the ranks recorded a stop checkpoint at or after ``since``,
    else "cancelled" (exit 130)."""
    marker = read_stop_marker(Path(plan.run_dir), since)
    if marker is None:
        message = "stopped on request, no checkpoint saved"
        return JobStatus(state="cancelled", exit_code=EXIT_INTERRUPTED, message=message)
    return JobStatus(
        state="checkpointed",
        exit_code=EXIT_CHECKPOINTED,
        message=f"checkpoint {marker.get('checkpoint')} saved at step {marker.get('step')}; resume by "
        f"submitting again with -- --run-dir {plan.run_dir}",
    )


def _start(node: NodePlan, record: JobRecord) -> subprocess.Popen[bytes]:
    with open(record.dir / node.log, "ab") as log:
        # A new session per node: Ctrl-C reaches only the launcher, which stops the job in order.
        return subprocess.Popen(
            node.argv,
            env=os.environ | node.env,
            cwd=node.cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait_final(record: JobRecord, timeout_s: float) -> JobStatus | None:
    """The job's status once the launcher has recorded its end (None if it has not in ``timeout_s``).
    The status file, not the pid, tells: the launcher may linger as a zombie of its own parent."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = record.status()
        if status is not None and status.state in FINAL_STATES:
            return status
        time.sleep(0.2)
    return None


def _descendants() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


class _StopOnSignal:
    """SIGINT (Ctrl-C), SIGTERM (``launcher cancel``) and SIGHUP (terminal closed) ask the job to stop."""

    def __init__(self) -> None:
        self.requested = False
        # A signal ignored by whoever started us (nohup, `&` in a script) stays ignored.
        watched = [sig for sig in STOP_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN]
        self._previous = {sig: signal.signal(sig, self._handle) for sig in watched}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop waiting; cleanup kills everything
        self.requested = True
        with contextlib.suppress(OSError):  # SIGHUP: the terminal may be gone
            print(
                f"launcher: {signal.Signals(signum).name}: stopping the job (ranks checkpoint, then exit)",
                file=sys.stderr,
                flush=True,
            )

    def ignore(self) -> None:
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
