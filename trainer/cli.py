"""``trainer`` command line: ``train``, ``prepare`` and ``sample``.

Exit codes: 0 success, 1 training failed, 2 invalid input (the message names the flag and the fix),
75 stopped by a signal after saving a checkpoint (requeue to resume). The flags are in
``trainer.flags``; this module runs the command and maps its errors to exit codes.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from gptlaunch import runtime
from gptlaunch.exits import exit_code, exit_now
from gptlaunch.runtime import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from trainer.errors import RUN_ERRORS, USER_ERRORS
from trainer.flags import build_parser, config_from_args, flag_values


def _run(args: argparse.Namespace) -> int:
    # The commands' modules import torch, numpy or tokenizers: only the one that runs is imported.
    if args.command == "sample":
        from trainer.sample import sample_main

        return sample_main(args)
    cfg = config_from_args(flag_values(args))
    if args.command == "prepare":
        from trainer.data.prepare import prepare_data

        prepare_data(cfg.data_dir, cfg.data_source(), vocab_size=cfg.vocab_size, token_dtype=cfg.token_dtype)
        return EXIT_OK
    from trainer.console import quiet_torch_chatter
    from trainer.train import train

    quiet_torch_chatter(compiling=cfg.compile)  # before anything compiles or warns
    return train(cfg)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``trainer ARGV``; returns the exit code (argparse exits 2 itself on an unknown flag)."""
    # @record writes a worker's exception to torchrun's error file, so the launcher can name the
    # failing rank and the root cause.
    from torch.distributed.elastic.multiprocessing.errors import record

    args = build_parser().parse_args(argv)
    try:
        code = record(_run)(args)
    except USER_ERRORS as e:
        print(f"trainer: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except RUN_ERRORS as e:  # already in torchrun's error file (via @record); no traceback needed
        print(f"trainer: training failed: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    return EXIT_OK if code is None else code


def _entry() -> NoReturn:
    runtime.whole_lines()  # each line one write: torchrun's rank prefix never lands mid-line
    try:
        code = main()
    except SystemExit as e:  # argparse's usage errors and --help
        code = exit_code(e)
    except BaseException:  # as Python would print it; the error file is written already (@record)
        traceback.print_exc()
        code = EXIT_FAILED
    exit_now(code)


if __name__ == "__main__":
    _entry()
