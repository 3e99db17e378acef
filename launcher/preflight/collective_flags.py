"""The collective preflight worker's command line (``launcher.preflight.collective``): its flags,
each checked as argparse reads it."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from launcher.preflight.health import PRECISIONS

# Bytes of the float32 tensor: latency-bound, two mid sizes, and 32 MiB where bandwidth dominates.
# The whole run takes a couple of seconds over loopback or a veth link with CPU gloo.
DEFAULT_SIZES = (4, 65536, 4194304, 33554432)
FLOAT32_BYTES = 4


def _sizes(text: str) -> list[int]:
    """``4,65536`` -> [4, 65536]: positive multiples of 4 (whole float32 elements), in bytes."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give byte counts separated by commas") from None
    bad = [s for s in sizes if s < FLOAT32_BYTES or s % FLOAT32_BYTES]
    if not sizes or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be a positive multiple of 4 bytes")
    return sizes


def _size(text: str) -> int:
    """One size of ``_sizes``."""
    sizes = _sizes(text)
    if len(sizes) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give one byte count")
    return sizes[0]


def _positive(kind: type[int] | type[float], minimum: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text} is below {minimum:g}")
        return value

    return parse


def parser(description: str) -> argparse.ArgumentParser:
    """The worker's command line (``python -m launcher.preflight.collective --help``), checked as
    argparse reads it: sizes in bytes (whole float32 elements), counts, seconds, GB/s."""
    p = argparse.ArgumentParser(prog="python -m launcher.preflight.collective", description=description)
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto", help="auto: nccl with CUDA")
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=",".join(map(str, DEFAULT_SIZES)),  # argparse runs a string default through type
        help="float32 tensor sizes in bytes, comma-separated (default: %(default)s)",
    )
    p.add_argument("--iters", type=_positive(int, 1), default=5, help="timed calls per size")
    p.add_argument("--warmup", type=_positive(int, 0), default=2, help="untimed calls per size first")
    p.add_argument(
        "--compute-s",
        type=_positive(float, 0.0),
        default=0.0,
        help="seconds of matmuls on each rank's device first, reported in TFLOP/s (default: 0, no check)",
    )
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="bf16",
        help="the job's --precision: the compute check's dtype follows the trainer's rule (default: bf16)",
    )
    p.add_argument(
        "--pair-bytes",
        type=_size,
        help="also time an all_reduce of this many bytes between pairs of hosts, in rounds (default: off)",
    )
    p.add_argument(
        "--gpu-health",
        action="store_true",
        help="with nccl, also report each host's `nvidia-smi --query-gpu` (from its local rank 0)",
    )
    p.add_argument(
        "--min-busbw",
        type=_positive(float, 0.0),
        help="GB/s: a pair below it is slow, as is one below half the median (the gate's rule)",
    )
    p.add_argument(
        "--timeout-s",
        type=_positive(float, 0.001),
        default=30.0,
        help="seconds to form the group and for each collective (default: %(default)s)",
    )
    return p
