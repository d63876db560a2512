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
