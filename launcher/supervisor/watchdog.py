"""The hang watchdog's eyes on the processes, once ``launcher.job.hang`` finds the ranks stalled:
before anything is killed, each rank's state (psutil) and Python stack (``py-spy dump``;
``--nonblocking`` where a stopped process refuses the default mode), the collective it waits in, and
its flight recorder's last collectives.

``Watchdog`` watches heartbeat directories on this machine: the node agent (``launcher.agent``) its own
node's, under every scheduler.

A hung rank's flight recorder is read through torch's worker server on its Unix socket
(``gptlaunch.flight_recorder``): which collective of its process group it reached, and whether that
one finished. Read from C++ in the rank, it answers where ``py-spy`` sees no Python frame. The trace
format is torch's (``torch/csrc/distributed/c10d/FlightRecorder*``, version 2.x): ``entries`` of
``{pg_id, collective_seq_id, profiling_name, retired, state, ...}``, oldest first.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from gptlaunch.contract import Beat, clear_beats, read_beats
from launcher.job.hang import EXIT_HANG, Collective, HangReport, HangSpec, RankReport, stalled
from launcher.job.programs import PY_SPY, find
from launcher.supervisor import procs

DUMP_TIMEOUT_S = 30.0
# How long a node-side watchdog keeps its hung ranks for the other nodes' dumps unless released: past
# the launcher's wait for every node's report (``launcher.job.hang.HANG_REPORTS_S``).
HOLD_S = 60.0
NONBLOCKING_TRIES = 5
POLL_S = 1.0
# torch.distributed's Python entry points a blocked rank sits in.
COLLECTIVES = frozenset(
    [
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "broadcast",
        "broadcast_object_list",
        "barrier",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "gather",
        "scatter",
        "send",
        "recv",
        "monitored_barrier",
    ]
)
# NCCL's recorder first (CUDA builds), then the one gloo's process groups write to.
FLIGHT_HANDLERS = ("dump_nccl_trace_json", "fr_trace_json")
FLIGHT_TIMEOUT_S = 5.0
FLIGHT_SHOWN = 8  # the last collectives written out with the rank's stack
_FRAME = re.compile(r"^\s+(?P<name>[\w<>.]+) \((?P<file>[^:()]+):\d+\)")
_NATIVE = re.compile(r"^\s+(?P<name>\S.*) \((?P<file>[^()]+\.so[.\d]*)\)$")  # `--native`: no line


def py_spy_dump(pid: int) -> str:
    """``py-spy dump`` of ``pid``: the blocking mode first (consistent stacks), then ``--nonblocking``
    (works on a stopped process, and where ptrace is not allowed), retried while the sample of a
    running process catches its main thread between frames. Never raises: a failure is described."""
    exe = find(PY_SPY)
    if exe is None:
        return "no stack: py-spy is not installed on this host (pip install py-spy)"
    errors, sample = [], ""
    # Last, --native: where no Python frame shows (a rank spinning in C++), the C++ stack still names it.
    for extra in ([], *[["--nonblocking"]] * NONBLOCKING_TRIES, ["--native"]):
        argv = [exe, "dump", "--pid", str(pid), *extra]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=DUMP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            errors.append(f"{' '.join(argv[1:])}: no answer within {DUMP_TIMEOUT_S:.0f} s")
            continue
        if proc.returncode == 0 and _main_frames(proc.stdout):
            return proc.stdout
        sample = proc.stdout if proc.returncode == 0 else sample
        errors.append(f"{' '.join(argv[1:])}: {(proc.stderr or proc.stdout).strip()[:500]}")
    return sample or "no stack:\n" + "\n".join(errors)


def _main_frames(stack: str) -> list[tuple[str, str]]:
    """(function, file or library) of the main thread's frames in a py-spy dump (Python frames, and
    C/C++ ones from ``--native``), innermost first."""
    main = stack.split('"MainThread"', 1)[1] if '"MainThread"' in stack else ""
    frames = (
        _FRAME.match(line) or _NATIVE.match(line) for line in main.split("\nThread ", 1)[0].splitlines()
    )
    return [(f["name"], f["file"]) for f in frames if f is not None]


def waits_in(stack: str) -> str | None:
    """The collective the main thread's innermost torch.distributed frame is, or None. A rank blocked
    in DDP's backward waits for its gradient all_reduce, which runs in C++ under ``backward``."""
    for name, file in _main_frames(stack):
        if name in COLLECTIVES and "torch/distributed" in file:
            return name
        if (
            name in ("backward", "run_backward") and "torch/" in file
        ) or "Reducer::finalize_backward" in name:
            return "backward (DDP's gradient all_reduce)"
        if name.startswith(("c10d::", "gloo::")) and "libtorch" in file:
            return f"a collective ({name.split('(')[0]})"
    return None


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def fetch_trace(path: str, timeout_s: float = FLIGHT_TIMEOUT_S) -> dict[str, Any] | str:
    """The trace served at ``path``, or why there is none (a string). Never raises."""
    why = "no recorder handler answered"
    for handler in FLIGHT_HANDLERS:
        conn = _UnixConnection(path, timeout_s)
        try:
            conn.request("POST", f"/handler/{handler}")
            response = conn.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException) as e:
            return f"the rank's worker server did not answer: {e}"
        finally:
            conn.close()
        if response.status == 200:
            try:
                trace = json.loads(body)
            except ValueError:
                return f"{handler}: not JSON"
            return trace if isinstance(trace, dict) else f"{handler}: not a trace"
        why = f"{handler}: HTTP {response.status}"
    return why


def last_collective(trace: dict[str, Any]) -> Collective | None:
    """The newest entry of ``trace``, or None when it holds none."""
    entries = [e for e in trace.get("entries", []) if isinstance(e, dict) and "collective_seq_id" in e]
    if not entries:
        return None
    e = entries[-1]
    return Collective(
        pg=int(e.get("pg_id", 0)),
        seq=int(e["collective_seq_id"]),
        op=str(e.get("profiling_name", "?")),
        done=bool(e.get("retired")) or e.get("state") == "completed",
    )


def describe_trace(trace: dict[str, Any]) -> str:
    """The last FLIGHT_SHOWN collectives of ``trace``, a line each, for the rank's stack file."""
    lines = [
        f"  {e.get('profiling_name', '?')} #{e.get('collective_seq_id')} (process group "
        f"{e.get('pg_id', 0)}, sizes {e.get('input_sizes')}): "
        + ("done" if e.get("retired") or e.get("state") == "completed" else f"NOT DONE ({e.get('state')})")
        for e in trace.get("entries", [])[-FLIGHT_SHOWN:]
        if isinstance(e, dict)
    ]
    return "\n".join(lines) or "  (no collective recorded)"


def _state(pid: int) -> str:
    try:
        return str(psutil.Process(pid).status())
    except psutil.Error:
        return "gone"


_CANNOT_ANSWER = ("stopped", "tracing-stop", "zombie", "gone")


def recorder(beat: Beat, state: str) -> tuple[Collective | None, str]:
    """The last collective in the flight recorder of ``beat``'s rank, and its last few as text for
    the stack file (where the rank serves none, or cannot answer: why not)."""
    if beat.debug_socket is None:
        return None, "not served (the rank predates it, or its torch has no worker server)"
    if state in _CANNOT_ANSWER:
        return None, f"not asked (the process is {state})"
    trace = fetch_trace(beat.debug_socket)
    if isinstance(trace, str):
        return None, trace
    return last_collective(trace), "the last collectives:\n" + describe_trace(trace)


def inspect(beat: Beat, node: int, host: str) -> RankReport:
    """The rank of ``beat`` (a process on this machine): its state, its stack, its flight recorder."""
    state = _state(beat.pid)
    stack = py_spy_dump(beat.pid) if state != "gone" else "no stack: the process is gone"
    collective, recorded = recorder(beat, state)
    python_frames = sum(file.endswith(".py") for _, file in _main_frames(stack))
    waits = waits_in(stack)
    if waits is None and not python_frames and collective is not None and not collective.done:
        waits = collective.describe()  # no Python frame to read: what its recorder says it waits in
    return RankReport(
        rank=beat.rank,
        local_rank=beat.local_rank,
        pid=beat.pid,
        node=node,
        host=host,
        step=beat.step,
        phase=beat.phase,
        state=state,
        waits_in=waits,
        python_frames=python_frames,
        collective=collective,
        stack=f"{stack}\n\nFlight recorder: {recorded}\n",
    )


@dataclass
class Watchdog:
    """Watches the heartbeats of one node's ranks in ``heartbeat_dir`` (on this machine) at most every
    POLL_S seconds; a stall of all of them is a hang, reported once with every rank's state and stack."""

    node: int
    host: str
    heartbeat_dir: Path
    nproc: int  # ranks expected to beat there
    spec: HangSpec

    def __post_init__(self) -> None:
        self._next = 0.0
        # An earlier run's beats (a requeue, a retry) would look like a hang at once.
        clear_beats(self.heartbeat_dir)

    def check(self) -> HangReport | None:
        """The hang's report once the ranks are stalled (after dumping their stacks), else None."""
        if time.monotonic() < self._next:
            return None
        self._next = time.monotonic() + POLL_S
        beats = read_beats(self.heartbeat_dir)
        stall = stalled(self.spec, beats, self.nproc, time.time())
        if stall is None:
            return None
        ranks = [inspect(b, self.node, self.host) for b in beats]
        return HangReport(
            silent_s=stall.silent_s, budget_s=stall.budget_s, step=stall.step, ranks=ranks, time=time.time()
        )


def end_hung(
    child: subprocess.Popen[bytes],
    hang: HangReport,
    report: Callable[[HangReport], object],
    released: Callable[[], bool],
) -> int:
    """After a node's watchdog took its ranks' stacks: ``report`` the hang (a ``reports.Hang`` on the
    node's channel), then keep the ranks as they are until ``released()`` (every node has reported, or
    the launcher ends the job) or HOLD_S seconds: killed now, they would wake their peers on other
    nodes with a connection error before those nodes' watchdogs took their stacks. Then end ``child``'s
    tree (a stopped rank never acts on SIGTERM). Returns EXIT_HANG."""
    report(hang)
    deadline = time.monotonic() + HOLD_S
    while child.poll() is None and not released() and time.monotonic() < deadline:
        time.sleep(POLL_S / 4)
    procs.kill_tree(child.pid)
    child.wait()
    return EXIT_HANG


def wait_watching(child: subprocess.Popen[bytes], watchdog: Watchdog | None) -> tuple[int, HangReport | None]:
    """Wait for ``child`` to exit: (its exit code, None); or for ``watchdog`` to report a hang of its
    ranks first: (-1, the report), ``child`` still running."""
    while True:
        try:
            return child.wait(timeout=POLL_S if watchdog is not None else None), None
        except subprocess.TimeoutExpired:
            assert watchdog is not None  # no timeout without one
            if (hang := watchdog.check()) is not None:
                return -1, hang
