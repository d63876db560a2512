"""The native CPU paged-attention kernel (every query row, decode or prefill, read from the paged
cache in place) against a float64 brute-force recomputation and against the torch gather+SDPA path."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.attention.backend import DECODE_LIKE_ROWS, LayerKVCache, SeqLayout, partition_groups
from kvflow.attention.backends.cpu import CpuPagedAttention, native_unsupported
from kvflow.attention.backends.torch import TorchPagedAttention
from kvflow.attention.selector import make_attention_backend

from conftest import assert_no_leaks, paged_attention_reference, random_kv_cache

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    native_unsupported(CPU, torch.float32, 4, 2, 16) is not None,
    reason="no C compiler: the native kernel cannot be built here",
)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(4, 4, 16), (6, 2, 32), (8, 1, 64), (9, 3, 64), (4, 2, 128), (2, 1, 15)]
)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("prefill_path", ["native", "torch"])
def test_kernel_matches_float64_and_torch(kv_dtype, heads, kv_heads, head_dim, window, prefill_path):
    """prefill_path "torch": the step's prefill chunk through SDPA, its decodes still native."""
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    bs, num_blocks = 4, 48
    torch_attn = TorchPagedAttention(bs, window, CPU)
    native_attn = CpuPagedAttention(bs, window, CPU)
    native_attn.prefill_path = prefill_path
    cache = random_kv_cache(torch_attn, num_blocks, kv_heads, head_dim, kv_dtype, gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    # Decodes at block boundaries and mid-block, a 1-token context, and a prefill chunk in between:
    # the decode rows are not contiguous on the step's token axis.
    seqs = [
        SeqLayout(10, 1, perm[0:3]),
        SeqLayout(3, 6, perm[3:6]),
        SeqLayout(0, 1, perm[6:7]),
        SeqLayout(31, 1, perm[7:15]),
        SeqLayout(16, 1, perm[15:20]),
    ]
    t = sum(s.num_new for s in seqs)
    q = torch.randn(t, heads, head_dim, generator=gen)
    kv = torch.randn(t, 2, kv_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    outs = {}
    for name, attn in (("torch", torch_attn), ("native", native_attn)):
        c = LayerKVCache(cache.data.clone(), None if cache.scale is None else cache.scale.clone())
        outs[name] = attn.forward(q, kv, c, attn.build_metadata(seqs), scale)
    ref = paged_attention_reference(q, c, seqs, bs, scale, window)  # c: the cache after the new tokens were written
    assert (outs["native"].double() - ref).abs().max() < 2e-5
    assert (outs["torch"].double() - ref).abs().max() < 2e-5
    assert (outs["native"] - outs["torch"]).abs().max() < 2e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_row_same_bits_alone_or_in_a_batch(dtype):
    """A decode row alone runs as (row, kv head) tasks; among many rows as one task sweeping all its
    heads chunk by chunk (the fixed-shape path: head_dim 64, 3 query heads per kv head). Its result
    is the same bit for bit either way, and matches float64."""
    gen = torch.Generator().manual_seed(5)
    bs, rows, ctx = 16, 64, 75  # 75: a partial last block; chunks of 16 keys, then 32 across two blocks
    attn = CpuPagedAttention(bs, None, CPU)
    per_seq = -(-ctx // bs)
    cache = random_kv_cache(attn, rows * per_seq, 3, 64, "auto", gen, dtype)
    perm = torch.randperm(rows * per_seq, generator=gen).tolist()
    seqs = [SeqLayout(ctx - 1, 1, perm[i * per_seq : (i + 1) * per_seq]) for i in range(rows)]
    q = torch.randn(rows, 9, 64, generator=gen)
    together = attn._attend(q, cache, attn.build_metadata(seqs).groups[0], 0.125, None)
    for r in (0, 7, rows - 1):
        alone = attn._attend(q[r : r + 1], cache, attn.build_metadata([seqs[r]]).groups[0], 0.125, None)
        assert torch.equal(alone, together[r : r + 1])
    ref = paged_attention_reference(q, cache, seqs, bs, 0.125, None).reshape(rows, -1)
    assert (together.double() - ref).abs().max() < 2e-5


def check_rows_as_alone(layout, kv_heads, head_dim, group, dtype, seed, bs=16):
    """Sequences (start, new tokens) in random blocks of bs, attended in one call: each row the same
    bits as the row decoded alone (a call of its own), and within 2e-5 of float64. Returns the
    call's metadata."""
    gen = torch.Generator().manual_seed(seed)
    attn = CpuPagedAttention(bs, None, CPU)
    per_seq = [-(-(s + n) // bs) for s, n in layout]
    cache = random_kv_cache(attn, sum(per_seq), kv_heads, head_dim, "auto", gen, dtype)
    perm = torch.randperm(sum(per_seq), generator=gen).tolist()
    seqs, at = [], 0
    for (s, n), b in zip(layout, per_seq):
        seqs.append(SeqLayout(s, n, perm[at : at + b]))
        at += b
    q = torch.randn(sum(n for _, n in layout), group * kv_heads, head_dim, generator=gen)
    meta = attn.build_metadata(seqs)
    together = attn._attend(q, cache, meta.groups[0], 0.125, None)
    row = 0
    for seq in seqs:
        for j in range(seq.num_new):
            alone_seq = SeqLayout(seq.start_pos + j, 1, seq.block_table)
            alone = attn._attend(q[row : row + 1], cache, attn.build_metadata([alone_seq]).groups[0], 0.125, None)
            assert torch.equal(alone, together[row : row + 1]), (seq, j)
            row += 1
    ref = paged_attention_reference(q, cache, seqs, bs, 0.125, None).reshape(len(q), -1)
    assert (together.double() - ref).abs().max() < 2e-5
    return attn, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,head_dim,bs", [(3, 64, 16), (2, 128, 16), (3, 64, 6)])
def test_rows_verifying_drafts_same_bits_as_decode_rows(dtype, kv_heads, head_dim, bs):
    """Rows of one sequence at consecutive positions (a decode verifying its drafts) are computed as a
    run that reads the sequence's keys once for all its rows (csrc/attention.h's plan_runs), each row
    over its own chunks: the same bits as each row alone as a decode row, and float64's values. Runs
    of 1 to 13 rows (more than one piece), beside rows alone, in one call. Blocks of 6 tokens: the
    chunks (16 or 32 keys) start and end inside blocks."""
    # partial and whole blocks, a run starting at position 0
    layout = [(70, 5), (40, 1), (31, 13), (0, 2), (50, 9), (16, 1), (90, 3), (120, 8)]
    attn, meta = check_rows_as_alone(layout, kv_heads, head_dim, 3, dtype, seed=11 + kv_heads, bs=bs)
    assert attn.decode_group(meta) is not None and not meta.groups[0].decode_only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,head_dim,group", [(3, 64, 3), (2, 128, 4), (1, 64, 8)])
def test_long_rows_same_bits_in_segments_split_or_in_turn(dtype, kv_heads, head_dim, group):
    """Past 512 keys the fixed-shape path runs a row's keys in 512-key segments, each its own
    softmax, folded in order (csrc/attention.h's KEY_SEGMENT): a decode row alone takes them as
    separate tasks (its kv heads alone would leave a thread idle), rows in a batch and a decode's
    verifying rows take them in turn. The same bits each way, and float64's values."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (the split needs two threads to apply)
    try:
        layout = [(1099, 1), (512, 1), (511, 1), (1535, 1), (508, 9), (699, 1)]
        check_rows_as_alone(layout, kv_heads, head_dim, group, dtype, seed=21 + head_dim)
    finally:
        torch.set_num_threads(threads)


def test_native_metadata_is_one_group_and_the_decode_pass_takes_decode_like_steps():
    """Every row of a step is one native group; the decode pass is handed steps whose sequences
    each have at most DECODE_LIKE_ROWS new tokens (decodes, and decodes verifying drafts), not a
    step carrying a longer chunk, even alone; with the torch prefill path, such a chunk's step
    splits into groups while a decode-like step stays one native group."""
    attn = CpuPagedAttention(4, None, CPU)
    mixed = attn.build_metadata([SeqLayout(5, 1, [3, 1]), SeqLayout(0, 3, [6])])
    (g,) = mixed.groups
    assert g.tokens.tolist() == [0, 1, 2, 3] and g.context_lens.tolist() == [6, 1, 2, 3]
    assert g.tables[:, 0].tolist() == [3, 6, 6, 6]
    assert attn.decode_group(mixed) is g and not g.decode_only
    table = list(range(1, 2 + (2 + DECODE_LIKE_ROWS + 1) // 4))  # blocks of 4 for the longest chunk below
    long_chunk = [SeqLayout(2, DECODE_LIKE_ROWS + 1, table)]
    assert attn.decode_group(attn.build_metadata(long_chunk)) is None
    assert attn.decode_group(attn.build_metadata([SeqLayout(2, DECODE_LIKE_ROWS, table)])) is not None
    decodes = attn.build_metadata([SeqLayout(5, 1, [3, 1]), SeqLayout(2, 1, [6])])
    assert attn.decode_group(decodes) is decodes.groups[0] and decodes.groups[0].decode_only
    attn.prefill_path = "torch"
    assert len(attn.build_metadata([SeqLayout(5, 1, [3, 1]), *long_chunk]).groups) == 2
    assert attn.decode_group(attn.build_metadata([SeqLayout(5, 1, [3, 1]), SeqLayout(0, 3, [6])])) is not None


def test_kernel_reads_q_with_a_row_stride():
    """Layers pass q as a strided view of the fused qkv output; the kernel must not need a copy."""
    gen = torch.Generator().manual_seed(1)
    attn = CpuPagedAttention(4, None, CPU)
    cache = random_kv_cache(attn, 8, 2, 16, "auto", gen)
    seqs = [SeqLayout(5, 1, [3, 1]), SeqLayout(2, 1, [6])]
    qkv = torch.randn(2, (4 + 2 * 2) * 16, generator=gen)
    q_view = qkv[:, : 4 * 16].view(2, 4, 16)
    kv = qkv[:, 4 * 16 :].view(2, 2, 2, 16)
    meta = attn.build_metadata(seqs)
    a = attn.forward(q_view, kv, cache, meta, 0.25)
    b = attn.forward(q_view.contiguous(), kv, cache, meta, 0.25)
    assert torch.equal(a, b)


def test_backend_selection():
    assert isinstance(make_attention_backend("native", 16, None, CPU, torch.float32, 4, 2, 16), CpuPagedAttention)
    assert type(make_attention_backend("torch", 16, None, CPU, torch.float32, 4, 2, 16)) is TorchPagedAttention
    # auto falls back where the kernel does not apply; asking for native there is an error naming why
    assert isinstance(make_attention_backend("auto", 16, None, CPU, torch.bfloat16, 4, 2, 16), CpuPagedAttention)
    assert type(make_attention_backend("auto", 16, None, CPU, torch.float16, 4, 2, 16)) is TorchPagedAttention
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        make_attention_backend("native", 16, None, CPU, torch.float16, 4, 2, 16)
    with pytest.raises(ValueError, match="head_dim 512"):
        make_attention_backend("native", 16, None, CPU, torch.float32, 4, 2, 512)
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(model="unused", attention_backend="flash")


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (4, 2, 128), (2, 1, 15)])
@pytest.mark.parametrize("prefill_path", ["native", "torch"])
def test_bf16_cache_matches_float64(heads, kv_heads, head_dim, prefill_path):
    """A bfloat16 model: its cache holds bf16 K/V (written by the kernel, rounded to nearest even as
    torch rounds), the maths runs in float32 on them; the torch path computes in bf16 throughout.
    (prefill_path "torch": the prefill chunk's rows as the torch path computes them.)"""
    gen = torch.Generator().manual_seed(heads * 10 + head_dim)
    bs, num_blocks = 4, 48
    native_attn, torch_attn = CpuPagedAttention(bs, None, CPU), TorchPagedAttention(bs, None, CPU)
    native_attn.prefill_path = prefill_path
    cache = random_kv_cache(native_attn, num_blocks, kv_heads, head_dim, "auto", gen, torch.bfloat16)
    assert cache.data.dtype == torch.bfloat16
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = [
        SeqLayout(10, 1, perm[0:3]),
        SeqLayout(3, 6, perm[3:6]),
        SeqLayout(0, 1, perm[6:7]),
        SeqLayout(31, 1, perm[7:15]),
    ]
    t = sum(s.num_new for s in seqs)
    q = torch.randn(t, heads, head_dim, generator=gen).bfloat16()
    kv = torch.randn(t, 2, kv_heads, head_dim, generator=gen)  # float32: rounding on write is the kernel's
    scale = head_dim**-0.5
    outs = {}
    for name, attn in (("native", native_attn), ("torch", torch_attn)):
        c = LayerKVCache(cache.data.clone())
        outs[name] = attn.forward(q, kv.bfloat16() if name == "torch" else kv, c, attn.build_metadata(seqs), scale)
        assert outs[name].dtype == torch.bfloat16
        # the new tokens land in the cache as torch's own float32 -> bf16 rounding
        slots = attn.build_metadata(seqs).slot_mapping
        assert torch.equal(c.slots[slots], kv.bfloat16())
    ref = paged_attention_reference(q, c, seqs, bs, scale, None)
    if prefill_path == "torch":  # the chunk's rows (1..6) as the torch path's; the decodes native, held below
        torch.testing.assert_close(outs["native"][1:7], outs["torch"][1:7], rtol=2e-2, atol=2e-2)
        outs["native"][1:7] = ref[1:7].to(torch.bfloat16)
    # native: float32 maths on bf16 inputs, one rounding of the output; torch: bf16 SDPA
    assert (outs["native"].double() - ref).abs().max() < 1e-2
    assert (outs["native"].double() - ref).abs().max() <= (outs["torch"].double() - ref).abs().max() + 1e-3


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_engine_greedy_same_on_both_backends(tiny_llama, kv_dtype):
    path, _ = tiny_llama
    """A whole engine, batched decodes of different lengths and a pool small enough to preempt:
    the greedy tokens through the native kernel equal those through the torch path."""
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + 9 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results = {}
    for backend in ("torch", "native"):
        llm = LLM(
            model=path,
            attention_backend=backend,
            kv_cache_dtype=kv_dtype,
            num_kv_blocks=40,
            max_model_len=128,
            block_size=4,
            max_num_batched_tokens=32,
        )
        results[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.get_stats().num_preemptions > 0
        assert_no_leaks(llm.engine)
    assert results["native"] == results["torch"]


def test_partition_groups_bounds_padding():
    q_lens = [64] * 6 + [300, 1, 1, 5, 3]
    kv_lens = [400] * 6 + [300, 50, 70, 5, 3]
    groups = partition_groups(q_lens, kv_lens)
    assert sorted(i for g in groups for i in g) == list(range(len(q_lens)))  # each sequence once
    assert all(g == sorted(g) for g in groups)  # token order inside a group
    assert [7, 8] in groups  # decodes together
    assert [6] in groups  # the 300-token prompt is not padded into the 64-token chunks' group
    for g in groups:
        padded = len(g) * max(q_lens[i] for i in g) * max(kv_lens[i] for i in g)
        assert padded <= max(1.5 * sum(q_lens[i] * kv_lens[i] for i in g), 1 << 16)


@pytest.mark.parametrize("backend", [TorchPagedAttention, CpuPagedAttention])
def test_several_prefill_groups_match_float64(backend):
    """A long prompt, short chunks over long contexts, tiny prompts and decodes in one step: split
    into several groups, written back to the right rows."""
    gen = torch.Generator().manual_seed(5)
    bs, heads, kv_heads, head_dim = 4, 4, 2, 16
    attn = backend(bs, None, CPU)
    cache = random_kv_cache(attn, 200, kv_heads, head_dim, "auto", gen)
    perm = torch.randperm(200, generator=gen).tolist()
    seqs, used = [], 0
    for start, new in [(0, 3), (300, 6), (0, 300), (7, 1), (44, 5), (0, 2), (60, 1), (36, 8)]:
        n = -(-(start + new) // bs)
        seqs.append(SeqLayout(start, new, perm[used : used + n]))
        used += n
    assert len(partition_groups([s.num_new for s in seqs], [s.start_pos + s.num_new for s in seqs])) > 2
    t = sum(s.num_new for s in seqs)
    q = torch.randn(t, heads, head_dim, generator=gen)
    kv = torch.randn(t, 2, kv_heads, head_dim, generator=gen)
    out = attn.forward(q, kv, cache, attn.build_metadata(seqs), 0.25)
    assert (out.double() - paged_attention_reference(q, cache, seqs, bs, 0.25, None)).abs().max() < 2e-5
