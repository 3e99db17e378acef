"""torch.compile's artifacts in the run dir (trainer.compile_cache): the key picks one file per set of
compiled graphs, and a load never fails a start. A real compile and a real load in two processes:
tests/integration/test_compile_cache.py."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.compiler._cache import CacheInfo

from gptlaunch.files import check_digest, digest_path
from trainer import compile_cache
from trainer.compile_cache import CompileCache, cache_path, run_key
from trainer.config import TrainConfig

CPU = {"torch": "2.13.0+cpu", "device_type": "cpu", "isa": "avx512 avx512_vnni amx_tile", "threads": 2}
GPU = {
    "torch": "2.13.0+cu128",
    "device_type": "cuda",
    "gpu": "NVIDIA H100",
    "capability": [9, 0],
    "cuda": "12.8",
}
VOCAB = 8192


def _key(
    cfg: TrainConfig,
    platform: dict[str, Any] = CPU,
    dtype: torch.dtype | None = torch.bfloat16,
    world_size: int = 2,
    vocab: int = VOCAB,
) -> str:
    shape = asdict(cfg.gpt_config(vocab))
    return run_key(cfg, platform, model_shape=shape, autocast_dtype=dtype, world_size=world_size)


BASE = TrainConfig(run_dir=Path("runs/a"), n_layer=2, n_head=2, d_model=64, micro_batch_size=4)


def test_the_key_changes_with_everything_the_compiled_graphs_depend_on() -> None:
    base = _key(BASE)
    assert len(base) == compile_cache.KEY_CHARS and base == _key(BASE.model_copy())
    changed = {
        "torch version": _key(BASE, platform=CPU | {"torch": "2.14.0+cpu"}),
        "device type": _key(BASE, platform=GPU),
        "CPU vector ISA": _key(BASE, platform=CPU | {"isa": "avx2"}),
        "CPU threads": _key(BASE, platform=CPU | {"threads": 16}),
        "layers": _key(BASE.model_copy(update={"n_layer": 3})),
        "heads": _key(BASE.model_copy(update={"n_head": 4})),
        "width": _key(BASE.model_copy(update={"d_model": 128})),
        "context": _key(BASE.model_copy(update={"block_size": 64})),
        "dropout": _key(BASE.model_copy(update={"dropout": 0.1})),
        "vocabulary": _key(BASE, vocab=16384),
        "micro-batch (the inputs' shape)": _key(BASE.model_copy(update={"micro_batch_size": 8})),
        "compile mode": _key(BASE.model_copy(update={"compile_mode": "default"})),
        "precision": _key(BASE, dtype=None),
        "fp16 against bf16": _key(BASE, dtype=torch.float16),
        "DDP or not": _key(BASE, world_size=1),
        "DDP's graph split at its buckets": _key(BASE.model_copy(update={"ddp_optimizer": "on"})),
    }
    assert base not in changed.values()
    assert len(set(changed.values())) == len(changed), changed
    on_gpu = _key(BASE, platform=GPU)
    assert _key(BASE, platform=GPU | {"capability": [8, 0], "gpu": "NVIDIA A100"}) != on_gpu
    assert _key(BASE, platform=GPU | {"cuda": "12.6"}) != on_gpu


def test_the_key_stays_for_what_does_not_reach_the_compiled_graphs() -> None:
    base = _key(BASE)
    same = [
        BASE.model_copy(update={"run_dir": Path("runs/b"), "data_dir": Path("elsewhere")}),
        BASE.model_copy(update={"lr": 3e-4, "seed": 7, "max_steps": 5, "warmup_steps": 0}),
        BASE.model_copy(update={"checkpoint_interval": 3, "eval_interval": 2, "log_interval": 1}),
        BASE.model_copy(update={"global_batch_tokens": 4 * 128 * 2 * 4}),  # gradient accumulation
        BASE.model_copy(update={"precision": "fp16"}),  # the flag: the resolved dtype is what counts
        BASE.model_copy(update={"compile_mode": "max-autotune-no-cudagraphs"}),  # what auto is on a CPU
        BASE.model_copy(update={"ddp_optimizer": "off"}),  # likewise
    ]
    assert [_key(cfg) for cfg in same] == [base] * len(same)
    # The world size beyond one: DDP's graph split is by bucket, not by rank count.
    assert _key(BASE, world_size=4) == base
    # Without DDP there is nothing to split.
    split = BASE.model_copy(update={"ddp_optimizer": "on"})
    assert _key(split, world_size=1) == _key(BASE, world_size=1)
    # The platform's keys in another order.
    assert _key(BASE, platform=dict(reversed(CPU.items()))) == base


def _artifacts(monkeypatch: pytest.MonkeyPatch, data: bytes | None, misses: int = 0) -> None:
    """torch's artifacts and cache counters as a compile would have left them in this process."""
    info = CacheInfo(defaultdict(list, {"inductor": ["a", "b"], "aot_autograd": ["c"]}))
    monkeypatch.setattr(
        torch.compiler, "save_cache_artifacts", lambda: None if data is None else (data, info)
    )
    counts = dict.fromkeys(compile_cache.cache_counters(), 0) | {"fxgraph_cache_miss": misses}
    monkeypatch.setattr(compile_cache, "cache_counters", lambda: counts)


def test_rank_0_writes_the_artifacts_once_with_their_checksum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = cache_path(tmp_path, "k")
    _artifacts(monkeypatch, b"compiled" * 1000)
    with CompileCache(path, is_main=False) as other:
        assert not other.load() and other.after_first_step(1.0) is None
    assert not path.parent.exists()  # only rank 0 writes
    with CompileCache(path, is_main=True) as main:
        assert not main.load()
        line = main.after_first_step(1.0)
        assert line is not None and "saving the artifacts (aot_autograd 1, inductor 2: 0.0 MB" in line
    assert path.read_bytes() == b"compiled" * 1000 and check_digest(path)
    assert "compile: no cached artifacts: compiling" in capsys.readouterr().out

    # The next attempt loads it and, with nothing missed, writes nothing.
    loaded: list[bytes] = []
    monkeypatch.setattr(
        torch.compiler, "load_cache_artifacts", lambda data: loaded.append(data) or CacheInfo()
    )
    before = path.stat().st_mtime_ns
    with CompileCache(path, is_main=True) as again:
        assert again.load() and loaded == [b"compiled" * 1000]
        assert "saving" not in (again.after_first_step(1.0) or "")
    assert path.stat().st_mtime_ns == before
    assert f"compile: loaded cached artifacts (none) from {path}" in capsys.readouterr().out


def test_a_load_that_still_missed_is_rewritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = cache_path(tmp_path, "k")
    path.parent.mkdir()
    compile_cache.write_artifacts(path, b"old")
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: CacheInfo())
    _artifacts(monkeypatch, b"new", misses=1)
    with CompileCache(path, is_main=True) as cache:
        assert cache.load()
        assert "saving" in (cache.after_first_step(1.0) or "")
    assert path.read_bytes() == b"new" and check_digest(path)


@pytest.mark.parametrize("damage", ["flipped", "no digest", "unreadable", "not torch's"])
def test_a_damaged_file_is_one_warning_and_a_normal_compile(
    damage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = cache_path(tmp_path, "k")
    path.parent.mkdir()
    compile_cache.write_artifacts(path, b"not torch's artifacts")
    loads: list[bytes] = []
    if damage == "flipped":
        path.write_bytes(b"nOt torch's artifacts")
    elif damage == "no digest":
        digest_path(path).unlink()
    elif damage == "unreadable":  # a directory under its name: reading it raises IsADirectoryError
        path.unlink()
        path.mkdir()
    else:  # whole bytes that torch cannot read as its artifacts: its loader says None
        monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loads.append(data))
    with CompileCache(path, is_main=True) as cache:
        assert not cache.load() and not cache.loaded
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainer: warning: compile: skipped the cached artifacts in")
    assert err[0].endswith("; compiling")
    with CompileCache(path, is_main=False) as other:  # the other ranks skip it quietly
        assert not other.load()
    assert capsys.readouterr() == ("", "")


def test_a_write_that_fails_is_a_warning_not_the_runs_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / compile_cache.CACHE_DIR).write_text("a file where the dir should be")
    _artifacts(monkeypatch, b"compiled")
    with CompileCache(cache_path(tmp_path, "k"), is_main=True) as cache:
        cache.after_first_step(1.0)
    assert "trainer: warning: compile: could not save the artifacts to" in capsys.readouterr().err


def test_no_artifacts_no_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _artifacts(monkeypatch, None)  # Inductor's caches turned off: torch recorded nothing
    with CompileCache(cache_path(tmp_path, "k"), is_main=True) as cache:
        assert cache.after_first_step(1.0) is not None and cache.close() is None
    assert not cache_path(tmp_path, "k").exists()


def test_the_first_steps_time_is_what_the_next_start_in_the_same_state_expects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _artifacts(monkeypatch, b"compiled")
    path = cache_path(tmp_path, "k")
    with CompileCache(path, is_main=True) as first:
        assert first.expected_s() is None  # nothing timed yet
        first.after_first_step(38.5)
    compiled, loaded = CompileCache(path, is_main=True), CompileCache(path, is_main=True)
    loaded.loaded = True  # as a load of the artifacts leaves it
    assert (compiled.expected_s(), loaded.expected_s()) == (38.5, None)  # with the artifacts: not timed yet
    with loaded:
        loaded.after_first_step(4.25)
    assert (compiled.expected_s(), loaded.expected_s()) == (38.5, 4.25)
    path.with_suffix(".json").write_text("{cut")
    assert compiled.expected_s() is None  # a damaged file: nothing expected, no error


def test_a_killed_writes_temporary_file_is_removed_by_rank_0(tmp_path: Path) -> None:
    path = cache_path(tmp_path, "k")
    path.parent.mkdir()
    partial = path.parent / ".k.bin.0123456789ab.tmp"
    partial.write_bytes(b"half")
    CompileCache(path, is_main=False).load()
    assert partial.exists()
    CompileCache(path, is_main=True).load()
    assert not partial.exists()
