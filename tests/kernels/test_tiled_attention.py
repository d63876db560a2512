"""Prefill rows computed a tile at a time (csrc/tiled_attention.h) against a float64 brute-force
recomputation, against the per-row path, and a row's result against itself in other tiles. Over a
bfloat16 cache on a CPU with AVX512_BF16 the tiles multiply in bf16: their reference takes the
query rounded as the kernel rounds it, within the probabilities' bf16 rounding."""

from __future__ import annotations

import pytest
import torch

from kvflow.attention.backend import LayerKVCache, SeqLayout
from kvflow.attention.backends.cpu import CpuPagedAttention, native_unsupported
from kvflow.kernels.cpu import paged_attention as kernel

from conftest import bf16_product_rows, bf16_query_reference, paged_attention_reference, random_kv_cache

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    native_unsupported(CPU, torch.float32, 4, 2, 16) is not None,
    reason="no C compiler: the native kernel cannot be built here",
)
BS = 16


def _layout(spans: list[tuple[int, int]], gen: torch.Generator, num_blocks: int) -> list[SeqLayout]:
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    seqs, used = [], 0
    for start, new in spans:
        n = -(-(start + new) // BS)
        seqs.append(SeqLayout(start, new, perm[used : used + n]))
        used += n
    return seqs


def _attend(attn, q, cache, seqs, scale, window=None, tiled=True):
    g = attn.build_metadata(seqs).groups[0]
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2])
    kernel.paged_attention(
        q, cache.data, cache.scale, g.tables, g.context_lens, g.tokens, BS, window, scale, out, True, tiled=tiled
    )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 1, 64), (4, 4, 128), (16, 2, 128), (6, 2, 32)])
@pytest.mark.parametrize("window", [None, 37])
def test_tiles_match_float64_and_the_per_row_path(dtype, heads, kv_heads, head_dim, window):
    """A long prompt, a chunk over cached context, a 3-token chunk (too short for a tile: per-row
    path) and decodes in one step; head_dim 32 is a shape the tiled path does not take."""
    gen = torch.Generator().manual_seed(heads * 10 + head_dim)
    attn = CpuPagedAttention(BS, window, CPU)
    cache = random_kv_cache(attn, 64, kv_heads, head_dim, "auto", gen, dtype)
    seqs = _layout([(0, 150), (120, 70), (9, 1), (40, 3), (200, 1)], gen, 64)
    q = torch.randn(sum(s.num_new for s in seqs), heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    ref = paged_attention_reference(q, cache, seqs, BS, scale, window)
    tiled = _attend(attn, q, cache, seqs, scale, window)
    per_row = _attend(attn, q, cache, seqs, scale, window, tiled=False)
    assert (per_row.double() - ref).abs().max() < 2e-5
    bf16_rows = bf16_product_rows(cache, seqs, heads, head_dim, native=True)
    assert any(bf16_rows) == (dtype == torch.bfloat16 and head_dim != 32 and kernel.bf16_products())
    ref_used = bf16_query_reference(q, cache, seqs, BS, scale, window, bf16_rows)
    bound = torch.tensor([2**-9 * float(cache.data.float().abs().max()) if b else 0.0 for b in bf16_rows]) + 2e-5
    assert ((tiled.double() - ref_used).abs().amax(1) < bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 45])
def test_a_rows_result_does_not_depend_on_its_tile(dtype, window):
    """The same prompt rows attended as one 200-token chunk, as chunks of 61 + 139 tokens, and behind
    another sequence's rows (so every tile boundary moves): bit for bit the same."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, d = 9, 3, 64
    attn = CpuPagedAttention(BS, window, CPU)
    cache = random_kv_cache(attn, 40, kv_heads, d, "auto", gen, dtype)
    table = torch.randperm(40, generator=gen).tolist()[:13]
    q = torch.randn(200, heads, d, generator=gen)
    whole = _attend(attn, q, cache, [SeqLayout(0, 200, table)], 0.125, window)
    head = _attend(attn, q[:61], cache, [SeqLayout(0, 61, table[:4])], 0.125, window)
    tail = _attend(attn, q[61:], cache, [SeqLayout(61, 139, table)], 0.125, window)
    assert torch.equal(torch.cat([head, tail]), whole)
    other = SeqLayout(0, 23, [b for b in torch.randperm(40, generator=gen).tolist() if b not in table][:2])
    q_other = torch.randn(23, heads, d, generator=gen)
    behind = _attend(attn, torch.cat([q_other, q]), cache, [other, SeqLayout(0, 200, table)], 0.125, window)
    assert torch.equal(behind[23:], whole)


def test_same_table_different_rows_share_a_tile_correctly():
    """Two sequences with the same block table (a fork that has not diverged) in one step: rows of
    both may share tiles; each still attends to exactly its own positions."""
    gen = torch.Generator().manual_seed(8)
    attn = CpuPagedAttention(BS, None, CPU)
    cache = random_kv_cache(attn, 16, 2, 64, "auto", gen)
    table = torch.randperm(16, generator=gen).tolist()[:8]
    seqs = [SeqLayout(0, 60, table), SeqLayout(30, 70, table)]
    q = torch.randn(130, 8, 64, generator=gen)
    out = _attend(attn, q, cache, seqs, 0.125, None)
    assert (out.double() - paged_attention_reference(q, cache, seqs, BS, 0.125, None)).abs().max() < 2e-5


def test_backend_forward_takes_the_tiled_path_and_writes_back_bf16_rows():
    """Through the backend: a bfloat16 model's chunk (queries widened, outputs rounded back)."""
    gen = torch.Generator().manual_seed(4)
    attn = CpuPagedAttention(BS, None, CPU)
    cache = random_kv_cache(attn, 24, 3, 64, "auto", gen, torch.bfloat16)
    seqs = _layout([(0, 90), (33, 1)], gen, 24)
    q = torch.randn(91, 9, 64, generator=gen).bfloat16()
    kv = torch.randn(91, 2, 3, 64, generator=gen).bfloat16()
    c = LayerKVCache(cache.data.clone(), None)
    out = attn.forward(q, kv, c, attn.build_metadata(seqs), 0.125)
    ref = paged_attention_reference(q.float(), c, seqs, BS, 0.125, None)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() < 2e-2  # (the output's own bf16 rounding, ~4 * 2^-9)
