"""Multi-LoRA serving against peft: three random adapters of different ranks and target modules
(made with `peft` on a tiny random Llama) in one batch beside base-model rows; each row's greedy
tokens equal HF transformers with that adapter merged by peft (`merge_and_unload`), float32.
Also: the prefix cache keys blocks by adapter, and bad adapters are refused at load, naming the
module."""

from __future__ import annotations

import json
import os

import pytest
import torch
from lora_utils import ADAPTERS, base_model, make_adapters

from kvflow import LLM, LoRARequest, SamplingParams

from conftest import assert_no_leaks, assert_same_completions, hf_greedy

peft = pytest.importorskip("peft")  # (in the test extras: CI has it)

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def merged_greedy(base_path: str, adapter: str | None, prompt: list[int], n: int) -> list[int]:
    model = base_model(base_path)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
    return hf_greedy(model, prompt, n)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    path, _ = tiny_llama
    root = tmp_path_factory.mktemp("adapters")
    return make_adapters(path, root)


def _llm(path: str, **kw) -> LLM:
    opts = dict(num_kv_blocks=64, max_model_len=256, enable_lora=True, max_loras=3, kernel_autotune="off")
    opts.update(kw)
    return LLM(path, **opts)


MIXED = [None, "qv4", "all8", None, "mlp16", "qv4"]  # the two qv4 rows are not adjacent


def _mixed_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(2, 200, (n,), generator=gen).tolist() for n in (5, 9, 3, 12, 7, 6)]


def _mixed_loras(adapters) -> list[LoRARequest | None]:
    ids = {name: i + 1 for i, name in enumerate(ADAPTERS)}
    return [None if n is None else LoRARequest(n, ids[n], adapters[n]) for n in MIXED]


def _assert_mixed_matches_peft(path: str, adapters, outs) -> None:
    differs = 0
    for prompt, name, out in zip(_mixed_prompts(), MIXED, outs):
        expected = merged_greedy(path, None if name is None else adapters[name], prompt, GREEDY.max_tokens)
        assert out.outputs[0].token_ids == expected, name
        if name is not None:
            differs += expected != merged_greedy(path, None, prompt, GREEDY.max_tokens)
    assert differs >= 3  # the adapters do change the model: the comparison tests something


def test_mixed_batch_matches_peft_merged(tiny_llama, adapters):
    path, _ = tiny_llama
    llm = _llm(path)
    outs = llm.generate(_mixed_prompts(), GREEDY, use_tqdm=False, lora_request=_mixed_loras(adapters))
    _assert_mixed_matches_peft(path, adapters, outs)
    assert_no_leaks(llm.engine)
    llm.shutdown()


def test_mixed_batch_through_decode_pass(tiny_llama, adapters, monkeypatch):
    """Decode steps of adapter rows and base rows together run in the fused native decode pass:
    tokens equal peft's, and the logprobs equal the per-layer path's bit for bit."""
    from kvflow.kernels.cpu.decode_pass import DecodePassKernel

    path, _ = tiny_llama
    # The native float kernels on both paths (the pass for every decode step, whatever its rows):
    # then a token's result is the same bits whichever path ran it.
    monkeypatch.setenv("KVFLOW_LINEAR_BACKEND", "native")
    llm = _llm(path)
    model = llm.engine.runner.model
    if model.native_decode is None:
        pytest.fail("the native decode pass is unavailable here (the native library could not be built)")
    calls: list[tuple[int, int]] = []  # per pass call: (rows, rows under adapters)
    real_call = DecodePassKernel.__call__

    def counting(self, x, *args):
        lora = args[-1] if len(args) == 7 else None
        calls.append((x.shape[0], 0 if lora is None else int(lora[1].seg_start[-1])))
        return real_call(self, x, *args)

    monkeypatch.setattr(DecodePassKernel, "__call__", counting)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    outs = llm.generate(_mixed_prompts(), params, use_tqdm=False, lora_request=_mixed_loras(adapters))
    _assert_mixed_matches_peft(path, adapters, outs)
    # decode steps with 4 adapter rows beside 2 base rows went through the pass
    assert (6, 4) in calls
    native, model.native_decode = model.native_decode, None  # the per-layer path, same engine
    n_calls = len(calls)
    per_layer = llm.generate(_mixed_prompts(), params, use_tqdm=False, lora_request=_mixed_loras(adapters))
    model.native_decode = native
    assert len(calls) == n_calls
    assert_same_completions([o.outputs[0] for o in outs], [o.outputs[0] for o in per_layer], abs_tol=0.0)
    assert_no_leaks(llm.engine)
    llm.shutdown()


def test_prefix_cache_keys_by_adapter(tiny_llama, adapters):
    path, _ = tiny_llama
    prompt = list(range(10, 60))  # 3 full blocks of 16
    a, b = LoRARequest("qv4", 1, adapters["qv4"]), LoRARequest("all8", 2, adapters["all8"])
    llm = _llm(path)

    def cached(lora):
        return llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(a) == 0
    assert cached(b) == 0  # the same prompt under another adapter: computed again
    assert cached(None) == 0  # and under the base model
    assert cached(a) == 48  # under the same adapter: a hit
    assert cached(None) == 48
    assert_no_leaks(llm.engine)
    llm.shutdown()


def test_adapter_churn_through_few_slots(tiny_llama, adapters):
    """max_loras=1, max_cpu_loras=2: every adapter change evicts; results stay exact."""
    path, _ = tiny_llama
    llm = _llm(path, max_loras=1, max_cpu_loras=2)
    prompt = [5, 17, 33, 2, 91]
    names = ["qv4", "all8", "mlp16", "qv4"]
    loras = [LoRARequest(n, i + 1, adapters[n]) for i, n in enumerate(["qv4", "all8", "mlp16"])]
    by_name = {lo.lora_name: lo for lo in loras}
    outs = llm.generate([prompt] * 4, GREEDY, use_tqdm=False, lora_request=[by_name[n] for n in names])
    for name, out in zip(names, outs):
        assert out.outputs[0].token_ids == merged_greedy(path, adapters[name], prompt, GREEDY.max_tokens)
    counters = llm.engine.runner.lora.counters
    assert counters.evictions >= 2 and counters.cpu_evictions >= 1
    assert_no_leaks(llm.engine)
    llm.shutdown()


def _corrupt(src: str, dst: str, edit) -> str:
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    with open(os.path.join(src, "adapter_config.json")) as f:
        cfg = json.load(f)
    tensors, cfg = edit(tensors, cfg)
    save_file(tensors, os.path.join(dst, "adapter_model.safetensors"))
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def test_bad_adapters_are_refused_at_load(tiny_llama, adapters, tmp_path):
    path, _ = tiny_llama
    llm = _llm(path, max_lora_rank=8)
    key = next(k for k in load_keys(adapters["qv4"]) if "layers.1.self_attn.q_proj.lora_A" in k)

    def wrong_shape(t, c):
        t[key] = torch.zeros(4, 48)
        return t, c

    def unknown(t, c):
        t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
        return t, c

    def twice(t, c):  # (q_proj adapted on its own and within a fused qkv_proj)
        a = t[key]
        t[key.replace("q_proj", "qkv_proj")] = a.clone()
        t[key.replace("q_proj", "qkv_proj").replace("lora_A", "lora_B")] = torch.zeros(64 + 2 * 32, a.shape[0])
        return t, c

    cases = {
        "wrong shape": (_corrupt(adapters["qv4"], str(tmp_path / "shape"), wrong_shape), "layers.1.self_attn.q_proj"),
        "adapted twice": (
            _corrupt(adapters["qv4"], str(tmp_path / "twice"), twice),
            "q_proj of layer 1 is adapted twice",
        ),
        "unknown module": (_corrupt(adapters["qv4"], str(tmp_path / "unknown"), unknown), "lm_head"),
        "rank too large": (adapters["mlp16"], "rank 16, above --max-lora-rank 8"),
        "not a folder": (str(tmp_path / "missing"), "not a folder"),
    }
    for i, (what, (adapter_path, expected)) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=expected.replace("-", r"\-").replace(".", r"\.")):
            llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False, lora_request=LoRARequest(what, i + 1, adapter_path))
    # The engine is fine afterwards, and without an adapter nothing changed.
    assert llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == merged_greedy(
        path, None, [3, 4, 5], GREEDY.max_tokens
    )
    assert_no_leaks(llm.engine)
    llm.shutdown()


def load_keys(adapter: str) -> list[str]:
    from safetensors.torch import load_file

    return list(load_file(os.path.join(adapter, "adapter_model.safetensors")))


def test_lora_options_are_checked(tiny_llama, adapters):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        LLM(path, enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="needs enable_lora"):
        LLM(path, lora_modules=[f"a={adapters['qv4']}"])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(path, enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="name=path"):
        LLM(path, enable_lora=True, lora_modules=["nopath"])
    llm = LLM(path, num_kv_blocks=16, max_model_len=64, kernel_autotune="off")
    with pytest.raises(ValueError, match="without --enable-lora"):
        llm.generate([[3, 4]], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, adapters["qv4"]))
    llm.shutdown()
