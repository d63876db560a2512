"""`kvflow roofline` with sliding windows: a windowed layer's KV is min(context, window) tokens."""

from __future__ import annotations

from kvflow.bench import roofline as rf

GEMMA3_4B = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "num_hidden_layers": 34,
    "hidden_size": 2560,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "intermediate_size": 10240,
    "vocab_size": 262208,
    "sliding_window": 1024,
}


def test_gemma3_windows_from_the_config():
    model = rf.model_from_hf_config(GEMMA3_4B, "g3")
    assert model.layer_windows == tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(34))
    typed = rf.model_from_hf_config(
        {**GEMMA3_4B, "layer_types": ["full_attention"] + ["sliding_attention"] * 33}, "typed"
    )
    assert typed.layer_windows == (None,) + (1024,) * 33
    mistral = rf.model_from_hf_config({**GEMMA3_4B, "model_type": "mistral", "sliding_window": 4096}, "m")
    assert mistral.layer_windows == (4096,) * 34
    assert rf.model_from_hf_config({**GEMMA3_4B, "sliding_window": None}, "none").layer_windows == ()
    qwen = rf.model_from_hf_config({**GEMMA3_4B, "model_type": "qwen2", "use_sliding_window": False}, "q")
    assert qwen.layer_windows == ()


def test_kv_bytes_follow_the_windows():
    model = rf.model_from_hf_config(GEMMA3_4B, "g3")
    per_layer_token = 2 * 4 * 256 * 2  # K and V, kv heads, head_dim, bf16
    for context in (100, 1024, 8192):
        # brute force: every token of every layer that still holds it
        held = sum(min(context, 1024) if (i + 1) % 6 else context for i in range(34))
        assert rf.kv_bytes_per_token(model, "bf16", context) * context == held * per_layer_token
    assert rf.kv_bytes_per_token(model, "bf16") == 34 * per_layer_token  # no context: every layer
    full = rf.ModelSpec(**{**model.__dict__, "layer_windows": ()})
    hw = rf.Hardware("x", 80e9, 3e12, 1e15)
    assert rf.max_sequences(model, hw, 8192) > 3 * rf.max_sequences(full, hw, 8192)
