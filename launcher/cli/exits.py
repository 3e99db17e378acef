"""The launcher's exit codes and what each means: one table for ``--help`` and the docs' reference
(``tools/reference.py``). The codes themselves are the contract's (``gptlaunch.contract``)."""

from __future__ import annotations

import textwrap

from gptlaunch.contract import (
    EXIT_CHECKPOINTED,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
)
from launcher.job.hang import EXIT_HANG

# (code, the job state it goes with, what it means)
EXIT_MEANINGS: tuple[tuple[int, str, str], ...] = (
    (EXIT_OK, "succeeded", "success"),
    (
        EXIT_FAILED,
        "failed, lost, unknown",
        "job failed (the failing node, rank and error are printed: a hang, a rank the kernel's OOM killer "
        "ended, a non-finite loss, a checkpoint that did not fit on the run dir's disk too) or lost",
    ),
    (
        EXIT_USAGE,
        "failed (a rank's)",
        "invalid input: the message names the flag or field and the fix; nothing is written. Also a job "
        "whose rank exited 2 itself (its arguments, config or data: the trainer's usage errors, argparse "
        "in your script), which is never retried",
    ),
    (
        EXIT_REFUSED,
        "failed",
        "nodes refused before training: the hosts' versions differ (parity check; the diff is printed), "
        "the health check named a node (one line each), a host lacks a program the job needs (rsync, a "
        "container runtime; the package is named) or the newest checkpoint is out of reach; no rank "
        "started",
    ),
    (
        EXIT_CHECKPOINTED,
        "checkpointed",
        "stopped on request after a checkpoint (submit again with the same --run-dir to resume)",
    ),
    (EXIT_INTERRUPTED, "cancelled", "stopped on request, no checkpoint"),
)

SACCT_NOTE = (
    "A SLURM job ends in `sacct` with the same code: its batch step runs the job's controller, whose "
    f"exit code is the job's (a hang too: {EXIT_FAILED}, its node agents' {EXIT_HANG} being theirs)."
)


def exit_codes_help() -> str:
    """A code per line (meanings wrapped to 100 columns), for the ``--help`` epilogs."""
    rows = [
        textwrap.fill(text, 100, initial_indent=f"  {code:<5}", subsequent_indent=" " * 7)
        for code, _, text in EXIT_MEANINGS
    ]
    return "\n".join(["exit codes:", *rows])
