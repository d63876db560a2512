"""Hybrid KV memory: sliding-window layers hold only their window's blocks (kvflow.core.kv_groups).

Bookkeeping against brute-force references written here (which blocks a window can still reach,
which prefix hits are usable), and a Gemma-3-shaped model (five windowed layers to one full) that
holds a bounded number of blocks per request as its context grows and gives the same tokens as
with the saving turned off.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvflow import LLM, SamplingParams
from kvflow.config import ModelConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.kv_groups import NULL_BLOCK, kv_layout
from kvflow.core.request import Request

from conftest import assert_no_leaks

BS = 4
WINDOW = 10  # not a multiple of the block size: a block can be partly in the window
GEMMA3_SHAPE = (WINDOW,) * 5 + (None,)  # five local layers to one global


def _config(windows: tuple[int | None, ...], sliding: int | None = WINDOW) -> ModelConfig:
    """`windows` empty: four layers, each with the `sliding` window (Mistral)."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=100,
        hidden_size=8,
        intermediate_size=16,
        num_layers=len(windows) or 4,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        sliding_window=sliding,
        layer_windows=windows,
    )


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, rid, 0, list(tokens), SamplingParams(max_tokens=1000, ignore_eos=True), 1000, 0.0)


def test_layouts():
    g3 = kv_layout(_config(GEMMA3_SHAPE))
    assert g3.slots == 1 and g3.num_groups == 6
    assert [g.window for g in g3.groups] == [None] + [WINDOW] * 5  # full attention first
    assert g3.groups[0].layers == (5,)
    # Gemma 2: alternating, two groups of 13 layers sharing 13 tensors
    g2 = kv_layout(_config(tuple(WINDOW if i % 2 == 0 else None for i in range(26))))
    assert g2.slots == 13 and g2.num_groups == 2
    # every layer has exactly one (group, slot), and no two layers of a group share a slot
    for layout in (g3, g2):
        seen = {layout.slot_of(i) for i in range(layout.num_layers)}
        assert len(seen) == layout.num_layers
    mistral = kv_layout(_config((), sliding=WINDOW))
    assert mistral.num_groups == 1 and mistral.groups[0].window == WINDOW and mistral.frees_blocks
    off = kv_layout(_config(GEMMA3_SHAPE), disable_hybrid=True)
    assert off.num_groups == 1 and not off.frees_blocks


def _reachable(first_query: int, window: int | None) -> int:
    """Brute force: the first block any query at first_query or later can read."""
    if window is None:
        return 0
    lowest_key = max(0, first_query - window + 1)
    return next(b for b in range(10**6) if (b + 1) * BS > lowest_key)


@pytest.mark.parametrize("windows", [GEMMA3_SHAPE, ()], ids=["gemma3-shaped", "mistral"])
def test_a_growing_request_holds_its_windows_only(windows):
    layout = kv_layout(_config(windows))
    kv = KVCacheManager(200, BS, enable_caching=True, layout=layout)
    rng = random.Random(0)
    req = _request("a", [rng.randrange(100) for _ in range(23)])
    steps = [7, 9, 7] + [1] * 40  # chunked prefill whose chunks cross the window, then decodes
    most = 0
    for n in steps:
        assert kv.allocate_slots(req, n)
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        for g, table in enumerate(kv.tables["a"]):
            first = _reachable(start, layout.groups[g].window)
            assert len(table) == -(-end // BS)
            # every block a query of this step can read is held, none before is
            assert all(b != NULL_BLOCK for b in table[first:]), (g, table)
            assert all(b == NULL_BLOCK for b in table[:first]), (g, table)
        most = max(most, kv.num_held_blocks("a"))
        req.num_computed_tokens = end
        if end >= req.num_tokens:
            req.output_token_ids.append(rng.randrange(100))
    kv.pool.check_consistency()
    # bounded: the full group grows with the context, each window group stays within its window
    context_blocks = -(-req.num_computed_tokens // BS)
    windowed = sum(g.window is not None for g in layout.groups)
    full = layout.num_groups - windowed
    assert most <= full * context_blocks + windowed * (-(-(WINDOW - 1 + 9) // BS) + 1)
    assert most < layout.num_groups * context_blocks / 2
    kv.free(req)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - 1  # all but the null block
    kv.pool.check_consistency()


def test_prefix_hits_need_the_window_blocks():
    layout = kv_layout(_config(GEMMA3_SHAPE))
    kv = KVCacheManager(400, BS, enable_caching=True, layout=layout)
    rng = random.Random(1)
    prompt = [rng.randrange(100) for _ in range(41)]
    a = _request("a", prompt)
    for n in (16, 16, 9):
        assert kv.allocate_slots(a, n)
        a.num_computed_tokens += n
    kv.free(a)
    kv.pool.check_consistency()

    def reference(req: Request) -> int:
        """Brute force: the longest prefix (blocks) whose blocks every group can still read."""
        hashes = req.block_hashes[: (req.num_tokens - 1) // BS]
        best = 0
        for p in range(len(hashes) + 1):
            ok = True
            for g, group in enumerate(layout.groups):
                need = range(_reachable(p * BS, group.window), p)
                ok &= all(kv._key(hashes[i], g) in kv.pool.cached for i in need)
            if ok:
                best = p
        return best

    b = _request("b", prompt)
    hit = kv.get_computed_blocks(b)
    # window blocks that left the window were released, but stay cached until evicted: a full hit
    assert len(hit.blocks) == reference(b) == 10
    # Evict the window groups' cached copies of blocks 6..7 (one group is enough): the hit must
    # shrink to where that group's window no longer reaches them.
    for i in (6, 7):
        key = kv._key(b.block_hashes[i], 3)
        blk = kv.pool.cached.pop(key)
        kv.pool.block_hashes[blk] = None
        kv.pool._num_cached_free -= 1
    kv.pool.check_consistency()
    hit = kv.get_computed_blocks(b)
    assert len(hit.blocks) == reference(b) == 6
    for g, blocks in enumerate(hit.group_blocks):
        first = _reachable(len(blocks) * BS, layout.groups[g].window)
        assert all(x == NULL_BLOCK for x in blocks[:first]) and NULL_BLOCK not in blocks[first:]
    assert kv.allocate_slots(b, b.num_tokens - 6 * BS, hit)
    kv.free(b)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - 1
    kv.pool.check_consistency()


# ---- the engine, on a Gemma-3-shaped model ------------------------------------------------------
GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


@pytest.fixture
def gemma3_shaped(model_factory, monkeypatch):
    """A tiny Llama whose six layers take Gemma 3's pattern of windows (five local to one global)."""
    import kvflow.models.loader as loader

    path, _ = model_factory("llama", num_hidden_layers=6)
    load = loader.load_checkpoint

    def patched(*args, **kwargs):
        ckpt = load(*args, **kwargs)
        ckpt.model_config = dataclasses.replace(ckpt.model_config, sliding_window=WINDOW, layer_windows=GEMMA3_SHAPE)
        return ckpt

    monkeypatch.setattr(loader, "load_checkpoint", patched)
    return path


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(2, 500) for _ in range(20)]
    return [
        [rng.randrange(2, 500) for _ in range(37)],
        shared + [rng.randrange(2, 500) for _ in range(9)],
        shared + [rng.randrange(2, 500) for _ in range(13)],  # a prefix hit past the window
        [rng.randrange(2, 500) for _ in range(5)],
    ]


def _generate(path: str, **opts) -> tuple[list[list[int]], int, LLM]:
    llm = LLM(path, max_model_len=128, block_size=BS, max_num_batched_tokens=16, **opts)
    engine = llm.engine
    most = 0
    ids = []
    done = {}
    for p in _prompts():
        ids.append(engine.add_request(None, p, GREEDY))
        while engine.has_unfinished_requests():  # one at a time: the second and third share a prefix
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            for rid in engine.kv_cache.tables:
                most = max(most, engine.kv_cache.num_held_blocks(rid))
    assert_no_leaks(engine)
    return [done[i] for i in ids], most, llm


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_gemma3_shaped_same_tokens_with_bounded_blocks(gemma3_shaped, backend):
    opts = dict(num_kv_blocks=300, attention_backend=backend)
    on, most_on, llm = _generate(gemma3_shaped, **opts)
    off, most_off, _ = _generate(gemma3_shaped, disable_hybrid_kv_cache_manager=True, **opts)
    assert llm.engine.kv_cache.num_groups == 6
    assert on == off
    layout = llm.engine.kv_layout
    assert layout.num_groups == 6 and layout.slots == 1
    longest = max(len(p) for p in _prompts()) + GREEDY.max_tokens
    # the full group holds the context; each of the five window groups at most its window plus a chunk
    bound = -(-longest // BS) + 5 * (-(-(WINDOW - 1 + 16) // BS) + 1)
    assert most_on <= bound
    # without the saving one block holds all six layers: count layer-blocks to compare
    assert most_on < most_off * 6 / 2
    assert llm.engine.kv_cache.prefix_stats.hits > 0  # the shared prefix was found


def test_gemma3_shaped_preempting_pool(gemma3_shaped):
    """A pool too small for the batch: preemption and recompute with window groups."""
    llm = LLM(gemma3_shaped, max_model_len=128, block_size=BS, max_num_batched_tokens=16, num_kv_blocks=90)
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    ref = LLM(
        gemma3_shaped,
        max_model_len=128,
        block_size=BS,
        max_num_batched_tokens=16,
        num_kv_blocks=300,
        disable_hybrid_kv_cache_manager=True,
    ).generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm.engine)


def test_connectors_refused_with_windows(gemma3_shaped):
    with pytest.raises(ValueError, match="disable-hybrid-kv-cache-manager"):
        LLM(gemma3_shaped, max_model_len=128, block_size=BS, num_kv_blocks=300, kv_offload_cpu_gb=0.01)


def test_mistral_window_frees_blocks_same_tokens(model_factory, monkeypatch):
    """Every layer windowed (Mistral): one group whose blocks are freed as they leave the window."""
    import kvflow.models.loader as loader

    path, _ = model_factory("llama", num_hidden_layers=2)
    load = loader.load_checkpoint

    def patched(*args, **kwargs):
        ckpt = load(*args, **kwargs)
        ckpt.model_config = dataclasses.replace(ckpt.model_config, sliding_window=WINDOW)
        return ckpt

    monkeypatch.setattr(loader, "load_checkpoint", patched)
    on, most_on, llm = _generate(path, num_kv_blocks=300)
    off, most_off, _ = _generate(path, num_kv_blocks=300, disable_hybrid_kv_cache_manager=True)
    assert on == off
    assert llm.engine.kv_cache.num_groups == 1 and llm.engine.kv_cache.null_block == NULL_BLOCK
    assert most_on <= -(-(WINDOW - 1 + 16) // BS) + 1 < most_off


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    """A real (tiny, random) Gemma 3 text model: five local layers to one global, window WINDOW."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from conftest import VOCAB_SIZE, make_tokenizer

    path = tmp_path_factory.mktemp("gemma3-hybrid")
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        initializer_range=0.1,
    )
    torch.manual_seed(1234)
    model = Gemma3ForCausalLM(cfg)
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path), model.eval()


def test_gemma3_same_tokens_with_bounded_blocks(tiny_gemma3):
    from conftest import hf_greedy

    path, hf = tiny_gemma3
    on, most_on, llm = _generate(path, num_kv_blocks=300)
    off, most_off, _ = _generate(path, num_kv_blocks=300, disable_hybrid_kv_cache_manager=True)
    layout = llm.engine.kv_layout
    assert [g.window for g in layout.groups] == [None] + [WINDOW] * 5
    assert on == off
    assert most_on < most_off * 6 / 2
    # and the windows are the model's own: HF transformers agrees (float32) on a prompt longer than the window
    prompt = _prompts()[0]
    assert on[0] == hf_greedy(hf, prompt, GREEDY.max_tokens)


def test_metrics_count_the_real_capacity(tiny_gemma3):
    """/metrics: the blocks by state and the tokens the pool holds, as the start-up log says."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvflow.metrics import EngineMetrics

    path, _ = tiny_gemma3
    llm = LLM(path, max_model_len=128, block_size=BS, num_kv_blocks=300, max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request(None, _prompts()[0], GREEDY)
    for _ in range(5):
        engine.step()
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry)
    stats = engine.get_stats()
    metrics.record_stats(stats)
    text = generate_latest(registry).decode()
    values = {
        line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith("kvflow:kv_")
    }
    held = engine.kv_cache.num_held_blocks(next(iter(engine.kv_cache.tables)))
    assert values['kvflow:kv_cache_blocks{state="in_use"}'] == held > 0
    assert sum(values[f'kvflow:kv_cache_blocks{{state="{s}"}}'] for s in ("in_use", "cached_free", "free")) == 299
    # capacity, recomputed here: 128-token requests decoding at once, each holding its 32 full
    # blocks plus, per window group, the blocks the last token's window reaches: positions 118..127
    per_request = 32 + 5 * (127 // BS - (127 - WINDOW + 1) // BS + 1)
    assert values["kvflow:kv_cache_capacity_tokens"] == (299 // per_request) * 128
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(engine)


def test_a_window_past_max_model_len_is_full_attention():
    """Nothing to free: one group, as without windows (no extra block tables per step)."""
    layout = kv_layout(_config(GEMMA3_SHAPE), max_model_len=WINDOW)
    assert layout.num_groups == 1 and layout.groups[0].window is None and not layout.frees_blocks
    assert kv_layout(_config(GEMMA3_SHAPE), max_model_len=WINDOW + 1).num_groups == 6


def test_refusals_name_the_flag():
    from types import SimpleNamespace

    from kvflow.core.kv_groups import refusal

    base = dict(kv_transfer_config=None, kv_offload_cpu_gb=0.0, kv_offload_disk_dir=None, tensor_parallel_size=1)
    g3 = kv_layout(_config(GEMMA3_SHAPE))
    assert refusal(g3, SimpleNamespace(**base)) is None
    for change in (dict(tensor_parallel_size=2), dict(kv_offload_disk_dir="/tmp/x"), dict(kv_transfer_config={})):
        why = refusal(g3, SimpleNamespace(**{**base, **change}))
        assert why is not None and "--disable-hybrid-kv-cache-manager" in why
    # Mistral (one group): tensor parallelism takes its one table; connectors still cannot
    mistral = kv_layout(_config((), sliding=WINDOW))
    assert refusal(mistral, SimpleNamespace(**{**base, "tensor_parallel_size": 2})) is None
    assert refusal(mistral, SimpleNamespace(**{**base, "kv_offload_cpu_gb": 1.0})) is not None
    assert (
        refusal(
            kv_layout(_config(GEMMA3_SHAPE), disable_hybrid=True), SimpleNamespace(**{**base, "kv_offload_cpu_gb": 1.0})
        )
        is None
    )


def test_gemma3_speculative_decoding_same_tokens(tiny_gemma3):
    """Drafts verified and rolled back across window boundaries: blocks are released only behind
    the step's first query, which verification never moves back."""
    path, _ = tiny_gemma3
    loop = [7, 8, 9, 10, 11, 12]
    prompts = [loop * 6 + [3], [5, 6] * 15]  # repetitive: prompt lookup proposes drafts
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    opts = dict(max_model_len=128, block_size=BS, num_kv_blocks=300, max_num_batched_tokens=16)
    llm = LLM(path, speculative_config={**spec, "adaptive": False}, **opts)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    ref = LLM(path, disable_hybrid_kv_cache_manager=True, **opts).generate(prompts, GREEDY, use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in ref]
    stats = llm.engine.speculator.stats
    # drafts accepted (their KV kept) and rejected (rolled back)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_no_leaks(llm.engine)


def test_gemma2_two_groups_share_the_pages(tmp_path):
    """Gemma 2 alternates local and global layers: two groups of two layers, one pool of pages whose
    two tensors each hold a local and a global layer."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from conftest import VOCAB_SIZE, hf_greedy, make_tokenizer

    cfg = Gemma2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        initializer_range=0.1,
    )
    torch.manual_seed(1234)
    hf = Gemma2ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    on, most_on, llm = _generate(str(tmp_path), num_kv_blocks=300)
    off, most_off, _ = _generate(str(tmp_path), num_kv_blocks=300, disable_hybrid_kv_cache_manager=True)
    layout = llm.engine.kv_layout
    assert layout.slots == 2 and [g.window for g in layout.groups] == [None, WINDOW]
    assert on == off
    assert most_on * 2 < most_off * 4 * 0.8  # layer-blocks: the local half holds only its window
    assert on[0] == hf_greedy(hf, _prompts()[0], GREEDY.max_tokens)
