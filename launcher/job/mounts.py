"""The host directories a node's container mounts, each at its own path, so that every path in the
Plan means the same inside the image as on the host."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from launcher.job.spec import SpecError
from trainer.precheck import paths_of


def container_mounts(
    trainer_args: list[str], workdir: str, job_dir: Path, extra: Iterable[str] = ()
) -> list[str]:
    """The job record (with the run dir by default), the workdir, the trainer's run, data, text-file
    and checkpoint directories (relative ones are the workdir's) and ``extra``: each once, none that
    another one holds, never ``/``, sorted. Raises SpecError for a path with ':' or ',' (the runtimes'
    separators: ``--volume P:P``, ``--container-mounts A:A,B:B``), and what
    ``trainer.precheck.paths_of`` raises."""
    base = Path(workdir)
    wanted = [job_dir, base, *(base / p for p in paths_of(trainer_args)), *map(Path, extra)]
    by_depth = sorted({Path(os.path.normpath(p)) for p in wanted} - {Path("/")}, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for path in by_depth:
        if not any(path.is_relative_to(k) for k in kept):
            kept.append(path)
    for path in kept:
        if ":" in str(path) or "," in str(path):
            raise SpecError(f"the container mount {path} contains ':' or ',': choose paths without them")
    return sorted(str(p) for p in kept)
