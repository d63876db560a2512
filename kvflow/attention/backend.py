"""The attention backends' common ground: the paged KV cache, a step's layout and metadata, and
the interface every backend implements (`AttentionBackend`). Torch, numpy, the standard library and
the config's names only: the backends themselves are in kvflow.attention.backends, and kvflow.attention.selector picks one.

A step's tokens are one flat axis mixing decodes (1 new token) and prefill chunks (many new
tokens starting at any position). Each layer writes its new K/V into the cache through
`slot_mapping`, then every new token attends to its sequence's cached prefix plus the chunk
itself (causal). The backend builds its metadata once per step (positions, slots to write, what
to read); layers only run `forward`.

KV cache layout: one `LayerKVCache` per layer, whose `data` is
``[num_blocks, block_size, 2, kv_heads, head_dim]`` (index 0 of the third axis is K, 1 is V), so a
block -- K and V of `block_size` tokens -- is one contiguous piece of memory. In the default
(`kv_cache_dtype="auto"`) mode `data` has the model's dtype and `scale` is None
(`"float32"` / `"bfloat16"`: that dtype, whatever the model's; no scale either). With
`kv_cache_dtype="int8"`, `data` is int8 and `scale` is float32 ``[num_blocks, block_size, 2,
kv_heads]``: one symmetric scale per token, per K/V, per kv head, written with the values at
cache-write time and applied when the keys and values are read for attention. The other quantized
dtypes (`fp8_e4m3`, `fp8_e5m2`, `int4`: kvflow.attention.kv_formats) have the same scales; their
`data` is float8_e4m3fn / float8_e5m2, or uint8 ``[..., head_dim / 2]`` for int4 (two values a byte). Scales live per slot
next to their values, so anything that moves or shares whole blocks (prefix caching, preemption,
offload) moves `data[b]` and `scale[b]` together.

Metadata holds groups of query rows: `AttentionGroup`s (rows padded into a batch of equal-length
sequences, their keys gathered: the torch reference) and `PagedRows` (rows read straight from the
paged cache by a kernel that walks each row's block table: the CPU backend).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from kvflow.attention.kv_formats import check_head_dim, kv_float_dtype, kv_format


@dataclass
class LayerKVCache:
    """One layer's paged K/V. data: [num_blocks, block_size, 2, kv_heads, head_dim];
    scale: [num_blocks, block_size, 2, kv_heads] float32 when the cache is quantized (int8, fp8,
    int4: kvflow.attention.kv_formats; int4's data has head_dim / 2 bytes), else None."""

    data: torch.Tensor
    scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # Slot-major views (slot = block * block_size + offset), used to write and gather tokens.
        nb, bs = self.data.shape[:2]
        self.slots = self.data.view(nb * bs, *self.data.shape[2:])  # [num_slots, 2, kv_heads, head_dim]
        self.slot_scales = None if self.scale is None else self.scale.view(nb * bs, *self.scale.shape[2:])

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    @property
    def k(self) -> torch.Tensor:
        """Keys as a view, dequantization not applied: [num_blocks, block_size, kv_heads, head_dim]."""
        return self.data[:, :, 0]

    @property
    def v(self) -> torch.Tensor:
        return self.data[:, :, 1]


@dataclass
class AttentionGroup:
    """Query rows of several sequences padded into one batch [B, q_len] whose keys are gathered from
    the cache (`slots`) and padded to the longest context: one SDPA call (the torch reference)."""

    rows: torch.Tensor | None  # [B * q_len] index into the step's token axis; None = the identity
    valid: torch.Tensor | None  # [B * q_len] bool, None when no row is padding
    dst: torch.Tensor | None  # token-axis indices of the valid rows, in order; None with rows None
    slots: torch.Tensor  # [B * kv_len] cache slots to gather, row-major by sequence (padding: slot 0)
    mask: torch.Tensor | None  # [B, 1, q_len, kv_len], True = may attend; None = attend to all kv_len
    batch: int
    q_len: int
    kv_len: int  # keys gathered per sequence: the longest context of the group
    # Every sequence's chunk starts at position 0 (a whole prompt, or its first chunk): the mask is
    # the plain causal one, which SDPA applies itself (its flash kernel skips the masked half)
    # instead of reading a [B, 1, q_len, kv_len] mask. A shorter sequence's padding keys lie past
    # its own rows, so causality alone keeps its valid rows off them.
    causal: bool = False
    # The absolute position of each query row, [B, q_len] (padding rows included): masks for windows
    # other than the one `mask` was built for (`mask_window`), made at a layer's first need and kept
    # in `window_masks` for the step's other layers with that window.
    q_pos: torch.Tensor | None = None
    mask_window: int | None = None
    window_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)


# The most new tokens of one sequence in a step that the fused decode pass still takes: a decode
# verifying up to 15 drafts (speculative decoding), or a prompt's chunk that short; longer chunks
# take the per-layer path (its batched matmuls and head-major attention). A bf16 model's pass keeps
# float32 activations where the per-layer path rounds to bf16 (kvflow.models.decode_pass), so a
# verifying step that left the pass would round differently from the decodes it stands for.
DECODE_LIKE_ROWS = 16


@dataclass
class PagedRows:
    """Query rows that a kernel reads the paged cache for in place: row r is the query at token
    `tokens[r]` of the step, attending to the first `context_lens[r]` keys of block table
    `tables[r]` (causal by construction: a row's context ends at its own position). decode_only:
    one row per sequence, each its one new token. decode_like: no sequence has more than
    `DECODE_LIKE_ROWS` new tokens (decodes, and decodes verifying their drafts): what a fused decode
    pass takes."""

    tables: torch.Tensor  # int32 [R, max_blocks]
    context_lens: torch.Tensor  # int32 [R]
    tokens: torch.Tensor  # int32 [R]
    decode_only: bool = True
    decode_like: bool = True


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] absolute position of each new token
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    groups: list[AttentionGroup | PagedRows]


@dataclass
class SeqLayout:
    """What the backend needs to know of one scheduled sequence."""

    start_pos: int
    num_new: int
    block_table: list[int]


@dataclass
class TokenLayout:
    """A step's sequences on the flat token axis (host tensors, int64): what every backend's
    metadata starts from."""

    starts: torch.Tensor  # [B] position of each sequence's first new token
    lens: torch.Tensor  # [B] new tokens of each sequence
    offsets: torch.Tensor  # [B] index of each sequence's first new token on the token axis
    tables: torch.Tensor  # [B, max_blocks] block tables, padded with block 0
    positions: torch.Tensor  # [T] absolute position of every new token
    slot_mapping: torch.Tensor  # [T] its cache slot

    @classmethod
    def of(cls, seqs: list[SeqLayout], block_size: int) -> TokenLayout:
        # numpy, then one zero-copy view each: the same arithmetic as a dozen small torch ops cost
        # ~5x the time, paid on every step (a batch-1 decode step of a small model is ~3 ms).
        n = len(seqs)
        starts = np.fromiter((s.start_pos for s in seqs), np.int64, n)
        lens = np.fromiter((s.num_new for s in seqs), np.int64, n)
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = np.zeros((n, max_blocks), np.int64)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
        offsets = np.cumsum(lens) - lens
        total = int(lens.sum())
        seq_of_token = np.repeat(np.arange(n), lens)
        positions = starts[seq_of_token] + np.arange(total) - offsets[seq_of_token]
        slot_mapping = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        return cls(*map(torch.from_numpy, (starts, lens, offsets, tables, positions, slot_mapping)))


def kv_cache_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes of KV cache one token occupies across all layers (K and V, scales included)."""
    fmt = kv_format(kv_cache_dtype)
    check_head_dim(fmt, head_dim)
    if fmt is not None:
        per_head = fmt.bytes_per_head(head_dim)  # the codes + one float32 scale
    else:
        per_head = head_dim * torch.empty((), dtype=kv_float_dtype(kv_cache_dtype, dtype)).element_size()
    return 2 * num_layers * num_kv_heads * per_head


def partition_groups(
    q_lens: list[int], kv_lens: list[int], max_waste: float = 1.5, small: int = 1 << 16
) -> list[list[int]]:
    """Split a step's sequences into attention groups, each a list of indices in token order.

    A group is padded to its longest chunk (queries) and longest context (keys), so one 1,000-token
    prompt grouped with thirty 64-token chunks would multiply the attention work by ~15. Decodes
    form one group; prefill chunks are taken largest first (q_len x kv_len) and join the current
    group while its padded size stays within `max_waste` times the work it really holds, or under
    `small` query-key pairs (tiny chunks: one SDPA call beats several)."""
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    prefill = sorted((i for i, n in enumerate(q_lens) if n > 1), key=lambda i: -q_lens[i] * kv_lens[i])
    groups: list[list[int]] = [decode] if decode else []
    current: list[int] = []
    max_q = max_kv = work = 0
    for i in prefill:
        q, kv = max(max_q, q_lens[i]), max(max_kv, kv_lens[i])
        padded = (len(current) + 1) * q * kv
        if current and padded > max(max_waste * (work + q_lens[i] * kv_lens[i]), small):
            groups.append(sorted(current))
            current, q, kv, work = [], q_lens[i], kv_lens[i], 0
        current.append(i)
        max_q, max_kv, work = q, kv, work + q_lens[i] * kv_lens[i]
    if current:
        groups.append(sorted(current))
    return groups


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV tensor. Zeroed, not empty: masked-out slots are still multiplied by 0 and NaN
    garbage would leak. On the CPU it is anonymous mmap memory, zero by the kernel's guarantee and
    faulted in page by page as blocks are first written, so start-up does not spend ~0.4 s per GiB
    writing zeros to a pool that is mostly empty. (In 4 KB pages: huge pages asked for here showed
    no difference in the decode pass's time and cost a 2 MB page per layer for the first block
    written; figures: docs/benchmarks/results/2026-12-07-epyc-avx512.md.)"""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape)
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    # torch.frombuffer keeps the mmap object alive as long as the tensor's storage.
    return torch.frombuffer(mmap.mmap(-1, n * dtype.itemsize), dtype=dtype).view(shape)


# `forward(window=...)` left at this: the backend's own `sliding_window` (what callers from before
# per-layer windows get). Any other value is the layer's window in tokens, None for full attention.
BACKEND_WINDOW = -1


def layer_window(backend_window: int | None, window: int | None) -> int | None:
    """The window a `forward` call attends within: the call's, or the backend's for BACKEND_WINDOW."""
    if window == BACKEND_WINDOW:
        return backend_window
    if window is not None and window < 1:
        raise ValueError(f"attention window must be a positive number of tokens or None, got {window}")
    return window


def check_softcap(softcap: float | None) -> None:
    if softcap is not None and not softcap > 0:
        raise ValueError(f"attention logit soft-cap must be positive or None, got {softcap}")


class AttentionBackend(Protocol):
    """What the model runner and the model need from an attention implementation."""

    # Whether decode-only steps can replay CUDA graphs over its static metadata buffers
    # (`static_decode_metadata` & co., kvflow.worker.cuda_graphs).
    supports_decode_graphs: bool
    block_size: int
    sliding_window: int | None
    device: torch.device

    def allocate_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> list[LayerKVCache]: ...

    def build_metadata(self, seqs: list[SeqLayout]) -> AttentionMetadata: ...

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = BACKEND_WINDOW,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D]; kv: [T, 2, KV, D] (the new keys and values, written into the cache first)
        -> [T, H * D] (contiguous). `window`: this layer's window (a query at position p attends to
        keys p - window + 1 .. p; None: all keys up to p; BACKEND_WINDOW: `sliding_window`).
        `softcap`: scores s = scale * q.k become tanh(s / softcap) * softcap before the softmax
        (Gemma 2's attention-logit soft-capping); None: none."""
        ...

    def decode_group(self, meta: AttentionMetadata) -> PagedRows | None:
        """The step's rows as one `PagedRows` when every sequence's are a decode or a decode with
        its drafts (`PagedRows.decode_like`) and this backend reads the cache as a fused decode pass
        does (kvflow.models.decode_pass), else None."""
        ...
