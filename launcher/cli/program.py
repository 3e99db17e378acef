"""The user's own program on the command line: what follows ``--`` (``launcher.job.spec.split_program``)
and ``--resume-args``, into the job's config tree."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from launcher.job.spec import SpecError, split_program


def add_resume_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--resume-args",
        metavar="ARGS",
        help="your program's arguments from the job's second attempt on (retries, requeues), added "
        "after the others, e.g. --resume-args=--init_from=resume (one string, split as a shell does)",
    )


def set_program(tree: dict[str, Any], tail: list[str], resume_args: str | None) -> list[str]:
    """Put the program named in ``tail`` (and ``resume_args``) into ``tree``; the built-in trainer's
    arguments that remain. Raises SpecError for a form without its name, or --resume-args without
    a program."""
    program, trainer_args = split_program(tail)
    if program is not None:
        tree["program"] = program.model_dump()
    if resume_args is not None:
        if not isinstance(tree.get("program"), dict):
            raise SpecError(
                "--resume-args is for your own program: name it after --, e.g. -- train.py ARGS; the "
                "built-in trainer resumes by itself"
            )
        tree["program"]["resume_args"] = shlex.split(resume_args)
    return trainer_args
