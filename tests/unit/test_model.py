"""The GPT model: shapes, weight tying, GPT-2 initialization, the PaLM FLOPs count."""

from __future__ import annotations

import math

import torch

from trainer.config import GPTConfig
from trainer.model import GPT

CFG = GPTConfig(vocab_size=320, block_size=16, n_layer=3, n_head=2, d_model=32)


def test_forward_returns_logits_per_position_and_mean_loss() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    idx = torch.randint(0, CFG.vocab_size, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, CFG.vocab_size)
    assert loss is not None and loss.ndim == 0
    # An untrained model is close to uniform: loss near ln(V).
    assert abs(loss.item() - math.log(CFG.vocab_size)) < 0.5


def test_attention_is_causal_future_tokens_do_not_change_the_past() -> None:
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    a = torch.randint(0, CFG.vocab_size, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % CFG.vocab_size
    la, _ = model(a)
    lb, _ = model(b)
    assert torch.allclose(la[0, :10], lb[0, :10], atol=1e-6)
    assert not torch.allclose(la[0, 10:], lb[0, 10:])


def test_lm_head_is_tied_to_token_embedding() -> None:
    model = GPT(CFG)
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()


def test_residual_projections_use_scaled_init() -> None:
    torch.manual_seed(0)
    big = GPT(GPTConfig(vocab_size=320, block_size=16, n_layer=8, n_head=4, d_model=256))
    resid = torch.cat([b.mlp.proj.weight.flatten() for b in big.blocks])
    other = torch.cat([b.mlp.fc.weight.flatten() for b in big.blocks])
    assert abs(other.std().item() - 0.02) < 0.002
    assert abs(resid.std().item() - 0.02 / math.sqrt(2 * 8)) < 0.0005


def test_flops_per_token_is_6n_plus_attention_term() -> None:
    model = GPT(CFG)
    n = sum(p.numel() for p in model.parameters()) - model.pos_emb.weight.numel()
    assert model.flops_per_token() == 6 * n + 12 * CFG.n_layer * CFG.d_model * CFG.block_size


def test_generate_appends_tokens_and_greedy_is_deterministic() -> None:
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    prompt = torch.tensor([[1, 2, 3]])
    a = model.generate(prompt, 5, temperature=0)
    b = model.generate(prompt, 5, temperature=0)
    assert a.shape == (1, 8) and torch.equal(a, b) and torch.equal(a[:, :3], prompt)
