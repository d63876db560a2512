"""Tiny random HF models saved by the tests themselves (random norm weights included), shared by
the tests of the model families (HF folders and GGUF files)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from conftest import make_tokenizer


def save_tiny_model(path: Path, model_cls, config, seed: int, norms: tuple[float, float] = (1.0, 0.2)):
    """`model_cls(config)` with seeded random weights, its norm weights drawn from N(norms) too (HF
    starts them constant: a norm applied the wrong way, or twice, would not show), saved to `path`
    with the test tokenizer. Returns the HF model, in eval mode."""
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(*norms)
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return model.eval()


def save_tiny_gemma(path: Path, family: str, config: dict, seed: int):
    """A `family` ("gemma2" or "gemma3") model of `config`: `save_tiny_model` with norms around
    w = 0 (Gemma scales by 1 + w: a (1 + w) applied twice, missing or not undone would show)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    config_cls, model_cls = {
        "gemma2": (Gemma2Config, Gemma2ForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    }[family]
    return save_tiny_model(path, model_cls, config_cls(**config), seed, norms=(0.0, 0.3))


def tiny_gemmas(tmp_path_factory, config_of: Callable[[str], dict], seed: int) -> Callable[[str], tuple[str, object]]:
    """For a module-scoped fixture: family -> (its folder, the HF model), each family saved once."""
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            path = tmp_path_factory.mktemp(family)
            cache[family] = (str(path), save_tiny_gemma(path, family, config_of(family), seed))
        return cache[family]

    return get
