"""``trainer sample``: generate text from a run's newest checkpoint with the run's own tokenizer."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from gptlaunch.runtime import EXIT_OK
from trainer import checkpoint
from trainer.config import GPTConfig
from trainer.data.manifest import load_manifest
from trainer.data.splits import load_tokenizer
from trainer.errors import CheckpointError, ConfigError, DataError
from trainer.model import GPT


def sample_main(args: argparse.Namespace) -> int:
    """Print ``args.max_new_tokens`` generated tokens after ``args.prompt``.

    Raises CheckpointError when the run dir holds no checkpoint, ConfigError on a bad flag value.
    """
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise ConfigError(f"--device {args.device!r}: use cpu, cuda or cuda:N")
    if args.max_new_tokens < 1 or args.top_k < 1 or args.temperature < 0:
        raise ConfigError("--max-new-tokens and --top-k must be >= 1 and --temperature >= 0")
    found = checkpoint.list_checkpoints(args.run_dir)
    if not found:
        raise CheckpointError(f"no checkpoint in {args.run_dir}: train first, or pass the right --run-dir")
    state = checkpoint.load(found[-1])
    data_dir = _tokenizer_dir(state, args.run_dir)
    tokenizer = load_tokenizer(data_dir)
    device = torch.device(args.device)
    model = GPT(GPTConfig(**state["model_shape"])).to(device)
    model.load_state_dict(state["model"])
    model.eval()
    ids = tokenizer.encode(args.prompt).ids or [0]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    out = model.generate(
        torch.tensor([ids], device=device), args.max_new_tokens, args.temperature, args.top_k, gen
    )
    # The model's vocab is padded to a multiple of 64: pad ids are never trained as targets, so they
    # are practically never sampled; drop any that are before decoding.
    vocab = tokenizer.get_vocab_size()
    print(tokenizer.decode([i for i in out[0].tolist() if i < vocab]))
    return EXIT_OK


def _tokenizer_dir(state: dict[str, Any], run_dir: Path) -> Path:
    """The prepared-data directory holding the tokenizer the checkpoint was trained with: the run's
    --data-dir, else RUN_DIR/data. Raises CheckpointError when neither has it."""
    configured = state["config"].get("data_dir")
    candidates = [Path(configured)] if configured else []
    candidates.append(run_dir / "data")
    for data_dir in candidates:
        try:
            if load_manifest(data_dir).tokenizer_sha256 == state["tokenizer_sha256"]:
                return data_dir
        except DataError:
            continue
    where = " or ".join(str(d) for d in candidates)
    raise CheckpointError(f"the tokenizer this checkpoint was trained with is not in {where}")
