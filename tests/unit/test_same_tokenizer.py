"""Nodes that prepared their own data (hosts that share no file system) must have one tokenizer: two
real gloo processes compare theirs (``trainer.run.check_same_tokenizer``)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.data.manifest import Manifest
from trainer.errors import DataError
from trainer.run import check_same_tokenizer


def _rank(rank: int, store: str, shas: list[str], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        check_same_tokenizer(Manifest.model_construct(tokenizer_sha256=shas[rank]))
        said = "ok"
    except DataError as e:
        said = str(e)
    finally:
        dist.destroy_process_group()
    Path(out, str(rank)).write_text(said)


def _both(tmp_path: Path, shas: list[str]) -> list[str]:
    mp.spawn(_rank, args=(str(tmp_path / "store"), shas, str(tmp_path)), nprocs=2)
    return [(tmp_path / str(rank)).read_text() for rank in (0, 1)]


def test_the_same_tokenizer_on_every_rank_passes(tmp_path: Path) -> None:
    assert _both(tmp_path, ["a" * 64, "a" * 64]) == ["ok", "ok"]


def test_different_tokenizers_are_refused_on_every_rank_naming_both(tmp_path: Path) -> None:
    said = _both(tmp_path, ["a" * 64, "b" * 64])
    assert said[0] == said[1] and "the ranks' tokenizers differ" in said[0]
    assert (
        "rank 0 on " in said[0]
        and "rank 1 on " in said[0]
        and "aaaaaaaaaaaa" in said[0]
        and "bbbbbbbbbbbb" in said[0]
    )
    assert "fix:" in said[0]
