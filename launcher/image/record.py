"""What a built image holds, read from the image itself: the version probe (``launcher.preflight.probe``) runs
inside it, so the record states what is installed, not what the build arguments asked for. Also the
image's id, size and labels, and after ``--push`` its registry digest."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import docker
from docker.errors import DockerException, ImageNotFound
from docker.utils import parse_repository_tag
from pydantic import BaseModel, ConfigDict, ValidationError
from requests import RequestException

from gptlaunch.files import atomic_write_text
from launcher.image.engine import DockerError
from launcher.job.measurements import Probe
from launcher.preflight.parity import MUST_MATCH, field_value
from launcher.preflight.probe import IMAGE_DIGEST_ENV

PROBE_TIMEOUT_S = 300  # a CUDA image imports torch to read NCCL and cuDNN: seconds, not minutes
VERSION_FIELDS = tuple(f for f in MUST_MATCH if f != "image_digest")


class ImageRecord(BaseModel):
    """One ``launcher build``: saved as JSON (``--record``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    image: str  # the tag it was built as, e.g. gptlaunch:cpu
    id: str  # sha256:… of the image configuration: what the tag resolved to after the build
    repo_digests: list[str]  # registry@sha256:… once pushed
    variant: str  # cpu or cuda
    size_bytes: int
    build_s: float  # seconds, context staging included
    labels: dict[str, str]
    versions: dict[str, str | None]  # VERSION_FIELDS, as the probe inside the image reported them

    def save(self, path: Path) -> None:
        """Write the record atomically (a reader never sees half of it)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, self.model_dump_json(indent=2) + "\n")


def probe_image(client: docker.DockerClient, image: str) -> Probe:
    """Run ``python -m launcher.preflight.probe --json`` in a throwaway container of ``image`` (no
    network) and return its report. The container is removed whatever happens (an error, a timeout,
    Ctrl-C). Raises DockerError when the image has no working probe or the engine fails."""
    argv = ["python", "-m", "launcher.preflight.probe", "--json"]
    try:
        container = client.containers.create(
            image, argv, environment={IMAGE_DIGEST_ENV: image}, network_mode="none"
        )
    except ImageNotFound:
        raise DockerError(f"image {image} not found in the engine") from None
    except (DockerException, RequestException) as e:
        raise DockerError(f"cannot create a container of {image}: {e}") from None
    try:
        container.start()
        exit_code = container.wait(timeout=PROBE_TIMEOUT_S)["StatusCode"]
        out, err = container.logs(stderr=False), container.logs(stdout=False)
    except (DockerException, RequestException) as e:
        raise DockerError(f"the version probe could not run in {image}: {e}") from None
    finally:
        with contextlib.suppress(DockerException, RequestException):
            container.remove(force=True)
    if exit_code != 0:
        last = err.decode(errors="replace").strip()[-2000:]
        raise DockerError(f"the version probe failed inside {image} (exit {exit_code}): {last}")
    try:
        return Probe.model_validate(json.loads(out))
    except (ValueError, ValidationError) as e:
        raise DockerError(f"the version probe inside {image} printed no report: {e}") from None


def record_of(
    client: docker.DockerClient, tag: str, image_id: str, variant: str, build_s: float
) -> ImageRecord:
    """The record of the image ``image_id`` built as ``tag``: its probe, size and labels."""
    image = client.images.get(image_id)
    probe = probe_image(client, image_id)
    return ImageRecord(
        image=tag,
        id=image_id,
        repo_digests=list(image.attrs.get("RepoDigests") or []),
        variant=variant,
        size_bytes=int(image.attrs.get("Size") or 0),
        build_s=build_s,
        labels=dict(image.labels),
        versions={f: field_value(probe, f) for f in VERSION_FIELDS},
    )


def push(client: docker.DockerClient, record: ImageRecord) -> ImageRecord:
    """Push the image to the registry its tag names; returns the record with the one digest this push
    produced (``registry/repo@sha256:…``). Raises DockerError naming the registry's answer
    (unreachable, unauthorized, ...) or when the engine reported no digest."""
    repository, tag = parse_repository_tag(record.image)
    digest = None
    try:
        for chunk in client.images.push(repository, tag=tag or "latest", stream=True, decode=True):
            if "error" in chunk:
                raise DockerError(f"push of {record.image} failed: {chunk['error']}")
            # the engine's last message names the manifest it pushed (what `docker push` prints as
            # "digest: sha256:…"); the image's RepoDigests would also list every earlier push's
            digest = (chunk.get("aux") or {}).get("Digest") or digest
    except (DockerException, RequestException) as e:  # an APIError carries the registry's answer
        raise DockerError(f"push of {record.image} failed: {getattr(e, 'explanation', None) or e}") from None
    if not digest:
        raise DockerError(f"push of {record.image} ended without the registry's digest; run it again")
    return record.model_copy(update={"repo_digests": [f"{repository}@{digest}"]})
