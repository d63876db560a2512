"""The offline API as vLLM shapes it: prompt dicts, and an `LLM` that releases its workers and
process group once (shutdown, a `with` block, or being collected), so another engine can start."""

from __future__ import annotations

import gc

import pytest

from kvflow import LLM, SamplingParams

from conftest import assert_no_leaks

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_prompt_dicts_equal_plain_prompts(tiny_llama):
    path = tiny_llama[0]
    with LLM(path, num_kv_blocks=64, max_model_len=64) as llm:
        text = "The quick brown fox"
        ids = llm.tokenizer.encode(text)
        plain = _tokens(llm.generate([text, ids], GREEDY, use_tqdm=False))
        dicts = _tokens(llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False))
        single = _tokens(llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False))
        assert dicts == plain and single == plain[1:]
        assert_no_leaks(llm.engine)


@pytest.mark.parametrize(
    "prompt,fragment",
    [
        ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one of"),
        ({}, "exactly one of"),
        ({"prompt": "a", "multi_modal_data": {}}, "unsupported prompt key(s) ['multi_modal_data']"),
        ({"prompt": [1, 2]}, "'prompt' must be a string"),
        ({"prompt_token_ids": "12"}, "'prompt_token_ids' must be a list of integers"),
    ],
)
def test_bad_prompt_dicts_are_named(tiny_llama, prompt, fragment):
    with LLM(tiny_llama[0], num_kv_blocks=16, max_model_len=64) as llm:
        with pytest.raises(ValueError) as e:
            llm.generate([prompt], GREEDY, use_tqdm=False)
        assert fragment in str(e.value)
        assert not llm.engine.has_unfinished_requests()


def test_shutdown_is_idempotent_and_the_with_block_calls_it(tiny_llama):
    llm = LLM(tiny_llama[0], num_kv_blocks=16, max_model_len=64)
    calls = []
    real = llm.engine.executor.shutdown
    llm.engine.executor.shutdown = lambda: (calls.append(1), real())[1]
    with llm:
        llm.generate(["hello"], GREEDY, use_tqdm=False)
    llm.shutdown()
    del llm
    gc.collect()
    assert calls == [1]


@pytest.mark.server
def test_a_collected_tensor_parallel_llm_frees_its_workers_for_the_next(tiny_llama):
    """`del` of an LLM(tensor_parallel_size=2) ends its worker processes and leaves the process
    group, so a second one in the same process starts and gives the same tokens."""
    import torch.distributed

    path = tiny_llama[0]
    first = LLM(path, num_kv_blocks=64, max_model_len=64, tensor_parallel_size=2)
    procs = list(first.engine.executor.workers.procs)
    expected = _tokens(first.generate(["hello world"], GREEDY, use_tqdm=False))
    del first
    gc.collect()
    assert all(p.poll() is not None for p in procs) and not torch.distributed.is_initialized()
    with LLM(path, num_kv_blocks=64, max_model_len=64, tensor_parallel_size=2) as second:
        assert _tokens(second.generate(["hello world"], GREEDY, use_tqdm=False)) == expected
    assert not torch.distributed.is_initialized()


# Qwen3's switch, as its template writes it: with enable_thinking false an empty think block.
SWITCH_TEMPLATE = (
    "{% if tools %}Tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_chat_template_kwargs_reach_the_template(tiny_llama, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path / "switch"
    shutil.copytree(tiny_llama[0], path)
    hf = AutoTokenizer.from_pretrained(path)
    hf.chat_template = SWITCH_TEMPLATE
    hf.save_pretrained(path)
    messages = [{"role": "user", "content": "hi"}]
    with LLM(str(path), num_kv_blocks=64, max_model_len=128) as llm:
        for kwargs in (None, {"enable_thinking": False}, {"enable_thinking": True, "unused": [1, {"a": None}]}):
            theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **(kwargs or {}))
            assert llm.apply_chat_template(messages, True, kwargs) == theirs
        off = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        assert "</think>" in off
        out = llm.chat(messages, GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
        assert out[0].prompt_token_ids == hf(off, add_special_tokens=False).input_ids
        for key in ("tools", "add_generation_prompt", "continue_final_message"):
            with pytest.raises(ValueError, match=f"chat_template_kwargs cannot set '{key}'"):
                llm.chat(messages, GREEDY, use_tqdm=False, chat_template_kwargs={key: True})
        # vLLM's other chat arguments: tools rendered, the last message continued, params per conversation
        tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
        assert llm.apply_chat_template(messages, tools=tools) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, tools=tools
        )
        partial = [*messages, {"role": "assistant", "content": "Hello, I am"}]
        theirs = hf.apply_chat_template(partial, tokenize=False, continue_final_message=True)
        assert theirs.endswith("Hello, I am")
        assert llm.apply_chat_template(partial, False, continue_final_message=True) == theirs
        outs = llm.chat(
            [partial, messages],
            [GREEDY, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)],
            use_tqdm=False,
            add_generation_prompt=False,
            continue_final_message=False,
        )
        assert [len(o.outputs[0].token_ids) for o in outs] == [6, 3]
        out = llm.chat(partial, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
        assert out[0].prompt_token_ids == hf(theirs, add_special_tokens=False).input_ids
        for kwargs, fragment in (({}, "cannot both be true"), ({"add_generation_prompt": False}, "assistant's")):
            with pytest.raises(ValueError, match=fragment):
                llm.chat(messages, GREEDY, use_tqdm=False, continue_final_message=True, **kwargs)
        assert_no_leaks(llm.engine)


def test_cache_salt_keeps_prefix_cache_hits_within_a_salt(tiny_llama):
    # vLLM's cache_salt: the same prompt hits the prefix cache only under the same salt
    with LLM(tiny_llama[0], num_kv_blocks=64, max_model_len=128, block_size=16) as llm:
        ids = list(range(10, 58))  # three full blocks

        def cached(salt: str | None) -> int:
            prompt = {"prompt_token_ids": ids} if salt is None else {"prompt_token_ids": ids, "cache_salt": salt}
            return llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens

        assert cached("tenant-a") == 0
        assert cached("tenant-b") == 0
        assert cached(None) == 0
        assert cached("tenant-a") == 32  # its first two blocks (the last is recomputed for its logits)
        assert cached(None) == 32
        outs = llm.generate(
            [{"prompt_token_ids": ids, "cache_salt": "tenant-b"}, {"prompt_token_ids": ids, "cache_salt": "tenant-c"}],
            GREEDY,
            use_tqdm=False,
        )
        assert [o.num_cached_tokens for o in outs] == [32, 0]
        assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids  # the same answer either way
        for bad in ("", 5, "x" * 1025):
            with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
                llm.generate({"prompt": "hi", "cache_salt": bad}, GREEDY, use_tqdm=False)
        assert_no_leaks(llm.engine)
