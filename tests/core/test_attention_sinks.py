"""Attention sinks (StreamingLLM): generation to 4x max_model_len with a bounded number of KV blocks
per request, token-identical to a plain-torch streaming reference (keys kept unrotated, rotated at
their cache positions every step, as the StreamingLLM paper's implementation does) on the same
weights; the policy's arithmetic; the key re-rotation against a float64 rotation; the refusals."""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.core.attention_sinks import StreamingKV

# ---- the policy ---------------------------------------------------------------------------------


def test_policy_drops_whole_blocks_after_the_sinks():
    p = StreamingKV.create(attention_sinks=4, attention_window=32, block_size=8, max_model_len=64)
    assert (p.sink_blocks, p.max_cache_tokens, p.max_blocks) == (1, 40, 5)
    assert p.plan(cache_len=39, num_new=1) == (0, 1)  # fits
    assert p.plan(cache_len=40, num_new=1) == (1, 1)  # full: one block goes
    # A prefill chunk: as many blocks as make room, and the chunk is cut to what fits then.
    assert p.plan(cache_len=12, num_new=100) == (0, 28)  # no full non-sink block to drop yet
    assert p.plan(cache_len=40, num_new=100) == (4, 32)
    # Nothing droppable while the sinks themselves are being computed.
    assert p.plan(cache_len=0, num_new=100) == (0, 40)


def test_policy_default_window_and_limits():
    assert StreamingKV.create(4, None, 16, 256).max_cache_tokens == 256
    assert StreamingKV.create(0, 64, 16, 256).sink_blocks == 0
    with pytest.raises(ValueError, match="exceeds max_model_len 64"):
        StreamingKV.create(4, 64, 8, 64)
    with pytest.raises(ValueError, match="window of 0"):
        StreamingKV.create(64, None, 16, 64)


# ---- the re-rotation --------------------------------------------------------------------------


def _rope64(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """HF's rotate-half rotary in float64: x [T, heads, d] at positions pos [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]
    x = x.double()
    rot = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1)
    return x * cos + rot * sin


@pytest.mark.parametrize("scale", [1.0, 1.3])  # 1.3: a table with an attention factor folded in (YaRN)
def test_rerotation_moves_keys_down(scale):
    from kvflow.attention.backends.torch import TorchPagedAttention
    from kvflow.config import RopeConfig
    from kvflow.layers.rotary import RotaryEmbedding
    from kvflow.worker.kv_rerotate import KeyRerotation

    bs, heads, d, theta = 4, 2, 16, 10000.0
    rotary = RotaryEmbedding(d, 64, RopeConfig(theta=theta), torch.float32, torch.device("cpu"))
    attn = TorchPagedAttention(block_size=bs, sliding_window=None, device=torch.device("cpu"))
    caches = attn.allocate_kv_cache(2, 6, heads, d, torch.float32)
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(2, 6, bs, heads, d, generator=gen, dtype=torch.float64)
    pos = torch.arange(6 * bs) + 10
    for layer, c in enumerate(caches):
        c.data[:, :, 0] = _rope64(raw[layer].reshape(-1, heads, d), pos, theta).reshape(6, bs, heads, d).float()
        c.data[:, :, 1] = raw[layer].float()
    KeyRerotation(rotary.cos * scale, rotary.sin_signed * scale, d).apply_(caches, [2, 3, 5], 7)
    for layer, c in enumerate(caches):
        for b in range(6):
            p = pos[b * bs : (b + 1) * bs] - (7 if b in (2, 3, 5) else 0)
            want = _rope64(raw[layer, b], p, theta)
            torch.testing.assert_close(c.data[b, :, 0].double(), want, atol=1e-5, rtol=0)
        torch.testing.assert_close(c.data[:, :, 1].double(), raw[layer])  # values stay


# ---- end to end: 4x max_model_len vs a plain-torch streaming reference -------------------------------


@torch.no_grad()
def streaming_reference(hf, prompt: list[int], max_new: int, sink_tokens: int, max_cache: int, bs: int) -> list[int]:
    """Greedy generation with sinks + a rolling window, in float64 on the HF model's weights: every
    layer keeps its keys unrotated and values per cached token; a token entering a full cache first
    evicts the block_size oldest tokens after the sink tokens; queries and keys are rotated at
    their positions inside the cache."""
    cfg = hf.config
    m = hf.model
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // heads
    rope = getattr(cfg, "rope_parameters", None)  # (transformers 5; rope_theta before)
    theta = rope["rope_theta"] if rope else cfg.rope_theta
    keys: list[list[torch.Tensor]] = [[] for _ in m.layers]  # unrotated [kv_heads, d] per cached token
    vals: list[list[torch.Tensor]] = [[] for _ in m.layers]

    def forward(ids: list[int]) -> torch.Tensor:
        start = len(keys[0])
        x = m.embed_tokens(torch.tensor(ids)).double()
        pos = torch.arange(start, start + len(ids))
        for li, layer in enumerate(m.layers):
            h = layer.input_layernorm(x)
            a = layer.self_attn
            q = a.q_proj(h).view(-1, heads, d)
            keys[li].extend(a.k_proj(h).view(-1, kv_heads, d))
            vals[li].extend(a.v_proj(h).view(-1, kv_heads, d))
            n = len(keys[li])
            k = _rope64(torch.stack(keys[li]), torch.arange(n), theta)
            v = torch.stack(vals[li])
            qr = _rope64(q, pos, theta)
            k = k.repeat_interleave(heads // kv_heads, 1)
            v = v.repeat_interleave(heads // kv_heads, 1)
            scores = torch.einsum("qhd,khd->hqk", qr, k) / math.sqrt(d)
            mask = torch.arange(n)[None, :] > pos[:, None]
            att = scores.masked_fill(mask, float("-inf")).softmax(-1)
            o = torch.einsum("hqk,khd->qhd", att, v).reshape(len(ids), -1)
            x = x + a.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return hf.lm_head(m.norm(x))[-1]

    def feed(ids: list[int]) -> torch.Tensor:
        """Stream ids in: evict the oldest full block after the sinks while they do not fit, and
        compute as many as fit at once (a prompt longer than the cache comes in pieces)."""
        while ids:
            while len(keys[0]) + len(ids) > max_cache and len(keys[0]) - sink_tokens >= bs:
                for layer_keys, layer_vals in zip(keys, vals):
                    del layer_keys[sink_tokens : sink_tokens + bs]
                    del layer_vals[sink_tokens : sink_tokens + bs]
            n = min(len(ids), max_cache - len(keys[0]))
            logits, ids = forward(ids[:n]), ids[n:]
        return logits

    out: list[int] = []
    logits = feed(prompt)
    while True:
        out.append(int(logits.argmax()))
        if len(out) == max_new:
            return out
        logits = feed([out[-1]])


LONG_PROMPT = [(7 * i + 3) % 500 + 2 for i in range(40)]  # longer than the 24-token cache below


@pytest.mark.parametrize(
    "sinks, window, prompt",
    [
        (4, 32, [5, 17, 99, 3, 250, 41, 77, 8, 12, 300]),
        (0, 40, [5, 17, 99, 3, 250, 41, 77, 8, 12, 300]),  # the window alone, positions rolling
        (4, 16, LONG_PROMPT),  # the prompt itself streams through the cache
    ],
)
def test_generates_4x_context_with_bounded_kv_as_the_reference(model_factory, sinks, window, prompt):
    import copy

    from kvflow import LLM, SamplingParams

    max_model_len, bs = 48, 8
    path, hf = model_factory("llama", max_position_embeddings=max_model_len)
    llm = LLM(
        model=path,
        max_model_len=max_model_len,
        block_size=bs,
        attention_sinks=sinks,
        attention_window=window,
        enable_prefix_caching=False,
        num_kv_blocks=16,
        kernel_autotune="off",
    )
    engine = llm.engine
    policy = engine.streaming
    max_new = 4 * max_model_len
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True))
    most_blocks, tokens = 0, []
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens = o.outputs[0].token_ids
        table = engine.kv_cache.block_tables.get("r")
        if table is not None:
            most_blocks = max(most_blocks, len(table))
    assert len(tokens) == max_new
    assert engine.scheduler.num_preemptions == 0
    # Bounded: never more than the sink blocks + the window's blocks (+1 for the block being filled).
    assert most_blocks <= policy.max_blocks
    assert most_blocks == -(-(policy.sink_blocks * bs + window) // bs)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.pool.num_blocks

    ref = streaming_reference(
        copy.deepcopy(hf).double(), prompt, max_new, policy.sink_blocks * bs, policy.max_cache_tokens, bs
    )
    assert tokens == ref


def test_max_tokens_past_max_model_len_refused_without_sinks(tiny_llama):
    from kvflow import LLM, SamplingParams

    path, _ = tiny_llama
    llm = LLM(model=path, max_model_len=64, block_size=8, enable_prefix_caching=False, kernel_autotune="off")
    with pytest.raises(ValueError, match="exceeds max_model_len 64"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=100))


# ---- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, message",
    [
        ({}, "enable_prefix_caching"),
        ({"enable_prefix_caching": False, "kv_cache_dtype": "int8"}, "int8"),
        (
            {"enable_prefix_caching": False, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            "speculative_config",
        ),
        ({"enable_prefix_caching": False, "attention_window": 4, "block_size": 8}, "at least one KV block"),
    ],
)
def test_config_refusals(extra, message):
    from kvflow.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(attention_sinks=4, **extra)


def test_refuses_a_sliding_window_model(model_factory):
    from kvflow import LLM

    path, _ = model_factory("mistral", sliding_window=16)
    with pytest.raises(ValueError, match="without a sliding window"):
        LLM(model=path, max_model_len=64, attention_sinks=4, enable_prefix_caching=False, kernel_autotune="off")
