"""Trainer configuration: presets, overrides, gradient accumulation, flag errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.cli import main
from trainer.config import TrainConfig
from trainer.data.corpus import DataSource
from trainer.errors import UsageError
from trainer.flags import CODE_ONLY, FLAG_GROUPS, config_from_args, parse_train_args
from trainer.optim import lr_at


def test_preset_fields_can_be_overridden_one_by_one() -> None:
    cfg = parse_train_args(["--preset", "gpt2", "--n-layer", "2"])
    shape = cfg.gpt_config(vocab_size=50_000)
    assert (shape.n_layer, shape.n_head, shape.d_model, shape.block_size) == (2, 12, 768, 1024)
    assert shape.vocab_size == 50_048  # padded to a multiple of 64


def test_presets_and_defaults_are_resolved_into_plain_fields() -> None:
    cfg = TrainConfig(run_dir=Path("r"), max_steps=50)
    assert (cfg.n_layer, cfg.n_head, cfg.d_model, cfg.block_size) == (4, 4, 256, 128)
    assert cfg.data_dir == Path("r/data") and cfg.warmup_steps == 5
    assert TrainConfig(max_steps=5000).warmup_steps == 100  # capped
    explicit = TrainConfig(preset="gpt2", block_size=64, data_dir=Path("d"), warmup_steps=0)
    assert (explicit.n_layer, explicit.block_size, explicit.data_dir, explicit.warmup_steps) == (
        12,
        64,
        Path("d"),
        0,
    )
    # A dump holds the resolved values: it validates back to the same config.
    assert TrainConfig(**cfg.model_dump()) == cfg


def test_a_bad_value_is_one_error_naming_its_flag() -> None:
    # Values the derived defaults depend on (argparse's choices and types stop these on the command
    # line; a config built from other input meets them here).
    for values, flag in (({"preset": "huge"}, "--preset"), ({"max_steps": "many"}, "--max-steps")):
        with pytest.raises(UsageError) as excinfo:
            config_from_args(values)
        assert str(excinfo.value).startswith(f"{flag}:") and ";" not in str(excinfo.value)


def test_help_shows_the_defaults_derived_from_the_preset(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "transformer blocks (default: the preset's: tiny 4, gpt2 12)" in help_text
    assert "(default: RUN_DIR/data)" in help_text and "(default: min(100, max_steps/10))" in help_text


def test_data_source_and_compile_mode_come_from_the_config() -> None:
    cfg = parse_train_args(["--text-files", "a.txt", "b.txt"])
    assert cfg.data_source() == DataSource(None, None, ("a.txt", "b.txt"))
    assert TrainConfig().resolved_compile_mode("cpu") == "max-autotune-no-cudagraphs"
    assert TrainConfig().resolved_compile_mode("cuda") == "default"
    assert TrainConfig(compile_mode="default").resolved_compile_mode("cpu") == "default"
    # DDP's compiled graph: split at its buckets for the overlap on GPUs only, unless asked.
    assert [TrainConfig().resolved_ddp_optimizer(d) for d in ("cpu", "cuda")] == [False, True]
    assert TrainConfig(ddp_optimizer="on").resolved_ddp_optimizer("cpu") is True
    assert TrainConfig(ddp_optimizer="off").resolved_ddp_optimizer("cuda") is False


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


def test_every_config_field_is_a_flag_or_set_in_code_only() -> None:
    grouped = [field for fields in FLAG_GROUPS.values() for field in fields]
    assert sorted(grouped + list(CODE_ONLY)) == sorted(TrainConfig.model_fields)
    assert len(set(grouped)) == len(grouped)  # each flag in one help section


def test_flag_help_is_the_field_description(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for fields in FLAG_GROUPS.values():
        for field in fields:
            description = TrainConfig.model_fields[field].description
            assert description and " ".join(description.split()) in help_text, field
