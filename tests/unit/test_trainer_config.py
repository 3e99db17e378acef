"""Trainer configuration: presets, overrides, gradient accumulation, flag errors."""

from __future__ import annotations

import pytest

from trainer.cli import UsageError, main, parse_train_args
from trainer.config import TrainConfig
from trainer.optim import lr_at


def test_preset_fields_can_be_overridden_one_by_one() -> None:
    cfg = parse_train_args(["--preset", "gpt2", "--n-layer", "2"])
    shape = cfg.gpt_config(vocab_size=50_000)
    assert (shape.n_layer, shape.n_head, shape.d_model, shape.block_size) == (2, 12, 768, 1024)
    assert shape.vocab_size == 50_048  # padded to a multiple of 64


def test_grad_accum_is_derived_from_global_batch_tokens() -> None:
    cfg = TrainConfig(micro_batch_size=4, block_size=32, global_batch_tokens=4 * 32 * 2 * 3)
    assert cfg.grad_accum_steps(world_size=2) == 3
    with pytest.raises(ValueError, match="not divisible"):
        cfg.grad_accum_steps(world_size=4)


def test_bad_values_name_the_flag() -> None:
    with pytest.raises(UsageError, match="--max-steps"):
        parse_train_args(["--max-steps", "-5"])
    with pytest.raises(UsageError, match="--d-model"):
        parse_train_args(["--d-model", "30", "--n-head", "4"])


def test_trainer_exits_2_on_bad_input(capsys) -> None:
    assert main(["train", "--max-steps", "-5"]) == 2
    assert "--max-steps" in capsys.readouterr().err


def test_lr_warms_up_linearly_then_decays_to_the_floor() -> None:
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(0.55e-3)
    assert lr_at(110, cfg) == pytest.approx(1e-4)


def test_trainer_rejects_a_missing_text_file_without_writing_anything(tmp_path, capsys) -> None:
    run_dir = tmp_path / "run"
    code = main(["train", "--text-files", str(tmp_path / "missing.txt"), "--run-dir", str(run_dir)])
    assert code == 2 and "missing.txt" in capsys.readouterr().err
    assert not run_dir.exists()
