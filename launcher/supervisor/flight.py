"""A hung rank's flight recorder, read through torch's worker server on its Unix socket
(``gptlaunch.flight_recorder``): which collective of its process group it reached, and whether that
one finished. Read from C++ in the rank, it answers where ``py-spy`` sees no Python frame.

The trace format is torch's (``torch/csrc/distributed/c10d/FlightRecorder*``, version 2.x): ``entries``
of ``{pg_id, collective_seq_id, profiling_name, retired, state, ...}``, oldest first.
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any

from launcher.job.hang import Collective

# NCCL's recorder first (CUDA builds), then the one gloo's process groups write to.
HANDLERS = ("dump_nccl_trace_json", "fr_trace_json")
TIMEOUT_S = 5.0
SHOWN = 8  # the last collectives written out with the rank's stack


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def fetch(path: str, timeout_s: float = TIMEOUT_S) -> dict[str, Any] | str:
    """The trace served at ``path``, or why there is none (a string). Never raises."""
    why = "no recorder handler answered"
    for handler in HANDLERS:
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


def describe(trace: dict[str, Any]) -> str:
    """The last SHOWN collectives of ``trace``, a line each, for the rank's stack file."""
    lines = [
        f"  {e.get('profiling_name', '?')} #{e.get('collective_seq_id')} (process group "
        f"{e.get('pg_id', 0)}, sizes {e.get('input_sizes')}): "
        + ("done" if e.get("retired") or e.get("state") == "completed" else f"NOT DONE ({e.get('state')})")
        for e in trace.get("entries", [])[-SHOWN:]
        if isinstance(e, dict)
    ]
    return "\n".join(lines) or "  (no collective recorded)"
