"""Inductor's probe of the CPU's vector ISAs, run once per host and library instead of once per process.

Before Inductor generates C++ for a CPU (and before ``trainer.compile_cache`` keys its artifacts by the
ISA it picks), it checks each vector ISA the CPU claims (AVX2, AVX-512, VNNI, AMX): it builds a tiny
library with that ISA's flags into its cache, once, and loads it in a fresh interpreter
(``VecISA._probe_load``, torch 2.13) so that a library that would crash on load crashes the probe, not
the rank. Each load starts an interpreter that maps libtorch: about 0.25 s on a 2-core CPU, 0.8 s for
the three ISAs of this machine, on every rank of every start before its first compiled step.

Whether a given library file loads on a given CPU does not change, so a success is kept as an empty
marker file beside the library, named by the host (its name and the CPU's flags), the interpreter and
torch's version (the probe loads the library against this libtorch) and the library's modification
time: a later such process on that host skips the probe of that file. A failure is not kept:
it is probed again. Where torch has no ``VecISA._probe_load`` nothing changes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import sys
from pathlib import Path


def remember_isa_probes() -> None:
    """Have Inductor's ISA probe (``VecISA._probe_load``) skip a library that loaded on this host
    before, and mark each one that loads. Idempotent."""
    from torch._inductor.cpu_vec_isa import VecISA

    probe = getattr(VecISA, "_probe_load", None)
    if probe is None or getattr(probe, "remembered", False):
        return
    host = _host_tag()

    def remembered(self: VecISA, output_path: str) -> bool:
        try:
            marker = Path(f"{output_path}.{host}-{os.stat(output_path).st_mtime_ns}.loads")
        except OSError:  # no library: the probe says so
            return bool(probe(self, output_path))
        if marker.exists():
            return True
        loads = bool(probe(self, output_path))
        if loads:
            with contextlib.suppress(OSError):  # a read-only cache: probed again next time
                marker.touch()
        return loads

    remembered.remembered = True  # type: ignore[attr-defined]
    VecISA._probe_load = remembered  # type: ignore[method-assign]


def _host_tag() -> str:
    """This host's name, its CPU's flags (``/proc/cpuinfo``), this interpreter and torch's version,
    hashed: a cache on a shared file system is not taken for another host's, nor for another torch."""
    import torch

    flags = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    what = [socket.gethostname(), flags, sys.executable, torch.__version__]
    return hashlib.sha256("\n".join(what).encode()).hexdigest()[:12]
