"""Random PEFT LoRA adapters on a tiny model, for the LoRA tests (tests/lora, tests/server, and the
families that transform weights at load: tests/models)."""

from __future__ import annotations

import torch

# (rank, targets, extra LoraConfig arguments): ranks, targets, rsLoRA and per-module patterns differ.
ADAPTERS = {
    "qv4": (4, ["q_proj", "v_proj"], {"lora_alpha": 8}),
    "all8": (
        8,
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        {"lora_alpha": 16, "use_rslora": True, "rank_pattern": {"down_proj": 2}, "alpha_pattern": {"o_proj": 3}},
    ),
    "mlp16": (16, ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], {"lora_alpha": 32}),
}


def base_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_adapter(base_path: str, out: str, rank: int, targets: list[str], seed: int, **extra) -> str:
    """A PEFT adapter with random A and B (peft starts B at zero: it would change nothing)."""
    torch.manual_seed(seed)
    import peft

    model = peft.get_peft_model(
        base_model(base_path), peft.LoraConfig(r=rank, target_modules=targets, lora_dropout=0.0, **extra)
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.15)
    model.save_pretrained(out)
    return out


def make_adapters(base_path: str, root) -> dict[str, str]:
    """Every adapter of ADAPTERS, saved under the folder `root`: name -> folder."""
    return {
        name: make_adapter(base_path, str(root / name), r, targets, seed=i, **extra)
        for i, (name, (r, targets, extra)) in enumerate(ADAPTERS.items())
    }


def adapter_with_peft_greedy(
    base_path: str, out: str, targets: list[str], seed: int, prompts: list[list[int]], max_tokens: int
) -> tuple[str, list[list[int]]]:
    """A rank-4 adapter on `targets` of the model at `base_path`, saved to `out`, and HF's greedy
    tokens of `prompts` with it merged by peft (checked to differ from the base model's: the
    comparison then tests something)."""
    import peft

    from conftest import hf_greedy

    adapter = make_adapter(base_path, out, 4, targets, seed=seed, lora_alpha=8)
    merged = peft.PeftModel.from_pretrained(base_model(base_path), adapter).merge_and_unload().eval()
    expected = [hf_greedy(merged, p, max_tokens) for p in prompts]
    assert expected != [hf_greedy(base_model(base_path), p, max_tokens) for p in prompts]  # (it changes the model)
    return adapter, expected
