"""The one place that chooses an attention backend (`attention_backend`, `ATTENTION_BACKENDS`)."""

from __future__ import annotations

import logging

import torch

from kvflow.attention.backend import AttentionBackend
from kvflow.attention.backends.cpu import CpuPagedAttention, native_unsupported
from kvflow.attention.backends.torch import TorchPagedAttention
from kvflow.config import ATTENTION_BACKENDS

logger = logging.getLogger("kvflow")


def make_attention_backend(
    name: str,
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> AttentionBackend:
    """`attention_backend`: "torch" (the portable reference), "native" (the CPU kernel), "triton"
    (the Triton kernels: CUDA, or the CPU under TRITON_INTERPRET=1) -- an error if the one asked for
    cannot run here -- or "auto" (CUDA: triton; CPU: native; else, or when those cannot run: torch)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "torch":
        return TorchPagedAttention(block_size, sliding_window, device)
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        # (Imported when chosen: its kernels need the triton package, an optional dependency.)
        from kvflow.attention.backends.triton import TritonPagedAttention, triton_unsupported

        why = triton_unsupported(device)
        if why is None:
            return TritonPagedAttention(block_size, sliding_window, device)
        if name == "triton":
            raise ValueError(f"attention_backend='triton' is not available: {why}")
        logger.warning("attention: torch reference path (the Triton backend cannot run: %s)", why)
        return TorchPagedAttention(block_size, sliding_window, device)
    why = native_unsupported(device, dtype, num_heads, num_kv_heads, head_dim)
    if why is None:
        return CpuPagedAttention(block_size, sliding_window, device)
    if name == "native":
        raise ValueError(f"attention_backend='native' is not available: {why}")
    return TorchPagedAttention(block_size, sliding_window, device)
