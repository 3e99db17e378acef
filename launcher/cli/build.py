"""``launcher build``: build the training image through the Docker SDK, read its versions back with the
probe inside it, record them, and optionally push it."""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptlaunch.contract import EXIT_OK
from launcher import __version__
from launcher.job.console import say

if TYPE_CHECKING:
    from launcher.image.record import ImageRecord

CHECKOUT = Path(__file__).resolve().parents[2]  # where the Dockerfile is, in a source checkout
_TLS_FAILURE = re.compile(r"CERTIFICATE_VERIFY_FAILED|certificate verify failed|SSLError")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # Long but flat: one declaration per flag, read top to bottom as `launcher build --help` shows them.
    s = sub.add_parser(
        "build",
        help="build the training image (pinned torch/CUDA/NCCL), record its versions, optionally push",
        description="Build the Dockerfile of a gptlaunch checkout through the Docker engine (DOCKER_HOST), "
        "streaming its steps; then run the version probe inside the image and write what it reports "
        "(torch, CUDA, NCCL, cuDNN, Python, key packages), the image id and size to a JSON record. "
        "A failing step is named with its last lines of output.",
        epilog="exit codes: 0 built (and pushed); 2 the engine is unreachable, an input is invalid, the "
        "build failed at a step, or the push failed",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    s.add_argument(
        "--variant",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda: PyPI's torch (CUDA 13.0 build) with its CUDA runtime and NCCL wheels, for GPU hosts "
        "(several GB); cpu: torch's CPU build, for machines without GPUs (default: cuda)",
    )
    s.add_argument(
        "--base-image",
        metavar="REF",
        help="the image to build FROM: a Python 3.11 Debian image (default: the Dockerfile's "
        "python:3.11-slim-bookworm, pinned by digest)",
    )
    s.add_argument("--tag", help=f"the image's name (default: gptlaunch:{__version__}-VARIANT)")
    s.add_argument("--push", action="store_true", help="push the image to the registry --tag names")
    s.add_argument(
        "--ca-bundle",
        type=Path,
        metavar="FILE",
        help="PEM CA bundle for a TLS-intercepting proxy: pip trusts it during the build; it is in no "
        "layer of the final image",
    )
    s.add_argument(
        "--wheelhouse",
        type=Path,
        metavar="DIR",
        help="wheels to install before the package index (default for cpu: torch's CPU wheel, fetched "
        "with this machine's pip)",
    )
    s.add_argument(
        "--pip-index-url",
        metavar="URL",
        help="the package index of the build and of the CPU wheel's download (default: PyPI; torch's CPU "
        "index for the CPU wheel); it is in the build's history: put no credentials in it",
    )
    s.add_argument(
        "--context",
        type=Path,
        default=CHECKOUT,
        metavar="DIR",
        help="the gptlaunch checkout to build (default: the one this launcher runs from)",
    )
    s.add_argument(
        "--record",
        type=Path,
        metavar="FILE",
        help="where to write the JSON record (default: images/TAG.json)",
    )
    s.add_argument("--verbose", "-v", action="store_true", help="print every line of the build's output")
    s.add_argument("--json", action="store_true", help="print the record as JSON on stdout")


def cmd_build(args: argparse.Namespace) -> int:
    """Stage the context, build, probe, record (and push). Raises DockerError (exit 2)."""
    from launcher.image.build import BuildFailed, BuildProgress, build, stage_context, variant
    from launcher.image.engine import connect  # the Docker SDK: only for the commands that use it
    from launcher.image.record import push, record_of

    started = time.monotonic()
    tag = args.tag or f"gptlaunch:{__version__}-{args.variant}"
    wanted = variant(args.variant, args.context)
    build_args = wanted.build_args | {"VERSION": __version__}
    if args.base_image:
        build_args["BASE_IMAGE"] = args.base_image
    if args.pip_index_url:
        build_args["PIP_INDEX_URL"] = args.pip_index_url
    client = connect()
    progress = BuildProgress(on_step=say, on_output=say if args.verbose else lambda line: None)
    progress.base_image = args.base_image
    with tempfile.TemporaryDirectory(prefix="gptlaunch-build-") as context:
        say(f"launcher: staging the build context of {args.context} ({args.variant})")
        stage_context(
            args.context, Path(context), wanted, args.ca_bundle, args.wheelhouse, args.pip_index_url
        )
        say(f"launcher: building {tag} on the engine")
        try:
            image_id = build(client, Path(context), tag, build_args, progress)
        except BuildFailed as e:
            if args.ca_bundle is None and any(_TLS_FAILURE.search(line) for line in progress.tail):
                e.args = (
                    f"{e}\n  TLS verification failed: behind a TLS-intercepting proxy, pass --ca-bundle",
                )
            raise
    record = record_of(client, tag, image_id, args.variant, time.monotonic() - started)
    path = args.record or Path("images") / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', tag)}.json"
    record.save(path)  # before the push: a failed push keeps the build's record
    if args.push:
        say(f"launcher: pushing {tag}")
        record = push(client, record)
        record.save(path)
    say(_summary(record, path))
    if args.json:
        print(record.model_dump_json(indent=2))
    return EXIT_OK


def _summary(record: ImageRecord, path: Path) -> str:
    versions: dict[str, Any] = record.versions
    shown = " ".join(f"{k}={v or '-'}" for k, v in versions.items() if not k.startswith("packages."))
    pushed = f"; pushed as {', '.join(record.repo_digests)}" if record.repo_digests else ""
    return (
        f"launcher: built {record.image} ({record.id[:19]}, {record.size_bytes / 1e9:.2f} GB) in "
        f"{record.build_s:.0f} s{pushed}\n  {shown}\n  record: {path}"
    )
