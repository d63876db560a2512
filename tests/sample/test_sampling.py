"""The sampler and the output path: seeds, truncation, penalties, logprobs, stops, text."""

from __future__ import annotations

import math

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.engine.detokenizer import IncrementalDetokenizer
from kvflow.sample.sampler import Sampler, SamplingBatch

from conftest import assert_no_leaks, make_tokenizer


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama[0], num_kv_blocks=128, max_model_len=256)


def _batch(params, outputs=None, prompts=None):
    n = len(params)
    outputs = outputs or [None] * n
    return SamplingBatch(
        params=params,
        generators=[None] * n,
        prompt_ids=prompts or [None] * n,
        output_ids=outputs,
        num_output_tokens=[len(o or []) for o in outputs],
    )


def test_seed_gives_same_text_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([[3, 4, 5]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate([[9, 9], [3, 4, 5], [100, 7, 8, 9]], [other, seeded, other], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    again = llm.generate([[3, 4, 5], [1, 2]], [seeded, seeded], use_tqdm=False)
    assert again[0].outputs[0].token_ids == alone
    assert_no_leaks(llm.engine)


def test_truncation_never_emits_excluded_tokens():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    probs = torch.softmax(logits, -1)
    params = [
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.3),
        SamplingParams(temperature=0.7, top_k=3, top_p=0.9),
    ]
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    allowed = [
        set(logits[0].topk(5).indices.tolist()),
        _nucleus(probs[1], 0.5),
        set(torch.nonzero(probs[2] >= 0.3 * probs[2].max()).flatten().tolist()),
        set(logits[3].topk(3).indices.tolist()),
    ]
    seen = [set() for _ in range(4)]
    for _ in range(300):
        toks = sampler(logits, _batch(params)).token_ids.tolist()
        for i, t in enumerate(toks):
            assert t in allowed[i], (i, t)
            seen[i].add(t)
    assert sum(len(s) for s in seen) > len(seen)  # it did sample, not just argmax


def _nucleus(p: torch.Tensor, top_p: float) -> set[int]:
    vals, idx = p.sort(descending=True)
    keep, mass = [], 0.0
    for v, i in zip(vals.tolist(), idx.tolist()):
        if mass >= top_p:
            break
        keep.append(i)
        mass += v
    return set(keep)


def test_sampled_distribution_matches_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    sampler = Sampler(seed=1, device=torch.device("cpu"))
    params = [SamplingParams(temperature=0.5)]
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sampler(logits, _batch(params)).token_ids[0]] += 1
    expected = torch.softmax(logits[0] / 0.5, -1)
    assert torch.allclose(counts / 4000, expected, atol=0.03)


def test_penalties_change_logits_as_defined():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    p = SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    got = sampler._apply_penalties(logits, _batch([p], outputs=[[3, 3, 1]], prompts=[[0]]))
    # token 0 in prompt (positive logit -> /2); 1 seen (negative -> *2), then -0.25*1 -0.5;
    # 3 seen twice: 3/2 - 0.25*2 - 0.5; 2 and 4 untouched.
    want = torch.tensor([[1.0, -2.0 - 0.25 - 0.5, 0.5, 1.5 - 0.5 - 0.5, 1.0]])
    assert torch.allclose(got, want)


def test_min_tokens_blocks_eos():
    logits = torch.tensor([[0.0, 10.0, 1.0]])  # EOS (1) dominates
    p = SamplingParams(temperature=0, min_tokens=2)
    p._eos_token_ids = (1,)
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    assert sampler(logits, _batch([p], outputs=[[2]])).token_ids.item() == 2
    assert sampler(logits, _batch([p], outputs=[[2, 2]])).token_ids.item() == 1


def test_logprobs_equal_log_softmax(llm, tiny_llama):
    _, hf = tiny_llama
    prompt = [5, 17, 99, 3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=3), use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
    lp = out.outputs[0].logprobs[0]
    tok = out.outputs[0].token_ids[0]
    assert lp[tok].rank == 1 and math.isclose(lp[tok].logprob, ref[tok].item(), abs_tol=1e-4)
    top = ref.topk(3)
    assert sorted(lp) == sorted(top.indices.tolist())
    for i, v in zip(top.indices.tolist(), top.values.tolist()):
        assert math.isclose(lp[i].logprob, v, abs_tol=1e-4)


def test_sampled_token_logprob_and_rank_outside_top(llm):
    out = llm.generate(
        [[4, 5]], SamplingParams(temperature=5.0, seed=0, max_tokens=12, logprobs=0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert list(entry) == [tok] and entry[tok].rank >= 1 and entry[tok].logprob <= 0


def test_stop_string_cut_and_held_back(llm):
    base = llm.generate(["Paris is"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    text = base.text
    assert len(text) > 6
    stop = text[3:6]
    engine = llm.engine
    rid = engine.add_request(
        None, "Paris is", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    )
    seen = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen.append(o.outputs[0].text)
    final = seen[-1]
    assert final == text[: text.find(stop)]
    assert all(final.startswith(s) for s in seen)  # streamed text is always a prefix of the final text
    assert rid and engine.get_stats().num_running == 0
    assert_no_leaks(engine)


def test_stop_token_ids_and_eos(llm):
    base = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    stop_tok = base.token_ids[4]
    out = llm.generate(
        [[7, 8, 9]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok]), use_tqdm=False
    )[0].outputs[0]
    first = base.token_ids.index(stop_tok)
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    length = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 3


# Characters the test tokenizer never saw in training fall apart into single bytes.
@pytest.mark.parametrize("text", ["新しい猫が鳴いた。", "Emoji 🦄🎉🥳 🇫🇷 done", "mixed 寿司 こんにちは 🦄 world"])
def test_incremental_detokenization_never_breaks_characters(text):
    tok = make_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)  # the test really splits characters
    det = IncrementalDetokenizer(tok, [0])
    deltas = [det.add(i) for i in ids]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(n=0),
        dict(max_tokens=0),
        dict(top_k=-2),
        dict(min_p=2),
        dict(logprobs=-1),  # (the upper limit is the engine's --max-logprobs: tests/engine/test_max_logprobs.py)
        dict(min_tokens=5, max_tokens=2),
        dict(repetition_penalty=0),
        dict(allowed_token_ids=[]),
        dict(allowed_token_ids=[1, -1]),
        dict(allowed_token_ids=[0] * 262145),
        dict(truncate_prompt_tokens=0),
        dict(truncate_prompt_tokens=-2),
        dict(include_stop_str_in_output=1),
    ],
)
def test_invalid_sampling_values_name_the_field(bad):
    field = next(iter(bad)) if "min_tokens" not in bad else "min_tokens"
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_bad_prompts_are_refused_without_leaks(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match=r"300 tokens but max_model_len is 256"):
        llm.generate([[5] * 300], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt \(10 tokens\) \+ max_tokens \(250\) = 260 exceeds max_model_len 256"):
        llm.generate([[5] * 10], SamplingParams(max_tokens=250), use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[5, 100000]], use_tqdm=False)
    # a bad prompt in the middle of a batch leaves nothing behind
    with pytest.raises(ValueError):
        llm.generate([[5, 6], [], [7]], use_tqdm=False)
    assert_no_leaks(engine)


def test_metrics_timestamps_ordered(llm):
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[
        0
    ]
    tok = llm.tokenizer
    want = tok("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert out.prompt_token_ids == want


def test_greedy_tokens_is_argmax_with_ties_and_nan():
    """The sampler's greedy pick (numpy's argmax for float32 CPU logits, torch's max otherwise) is
    torch's argmax: the first index of the maximum on ties, a NaN counting as the maximum, an
    all -inf row its first index; on strided views and in every dtype."""
    from kvflow.sample.sampler import greedy_tokens

    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (64, 1000), generator=g).float()  # ties in every row
    logits[5, 17] = float("nan")
    logits[5, 900] = float("nan")
    logits[7] = 1.0
    logits[9] = float("-inf")
    logits[11, 600:] = float("inf")
    for view in (logits, logits[:, ::3], logits.t().contiguous().t(), logits[10:20]):
        got = greedy_tokens(view)
        assert got.dtype == torch.int64 and torch.equal(got, view.argmax(dim=-1))
    got = greedy_tokens(logits)
    assert got[5] == 17 and got[7] == 0 and got[9] == 0 and got[11] == 600
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        assert torch.equal(greedy_tokens(logits.to(dtype)), logits.to(dtype).argmax(dim=-1))
    assert greedy_tokens(torch.randn(0, 5)).shape == (0,)


def test_bf16_logits_sample_as_their_float32_copy():
    """A bf16 model's logits reach the sampler as they are: a greedy batch takes their argmax
    directly, any other batch (random rows, logprobs, penalties) their float32 copy; either way
    the result is the float32 copy's, ties included."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(16, 500, generator=g) * 4).bfloat16()
    logits[3, 10] = logits[3, 400] = logits[3].max() + 1  # a tie: the first index wins
    wide = logits.float()
    sampler = Sampler(0, torch.device("cpu"))
    greedy = [SamplingParams(temperature=0.0)] * 16
    assert torch.equal(sampler(logits, _batch(greedy)).token_ids, wide.argmax(dim=-1))
    assert sampler(logits, _batch(greedy)).token_ids[3] == 10
    with_logprobs = [SamplingParams(temperature=0.0, logprobs=2)] * 16
    out, ref = sampler(logits, _batch(with_logprobs)), sampler(wide, _batch(with_logprobs))
    assert torch.equal(out.token_ids, ref.token_ids) and out.logprobs == ref.logprobs
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5)] * 8
    a, b = Sampler(3, torch.device("cpu")), Sampler(3, torch.device("cpu"))
    assert torch.equal(a(logits, _batch(mixed)).token_ids, b(wide, _batch(mixed)).token_ids)


def test_bf16_engine_greedy_matches_float32_logits(tiny_llama):
    """Through the engine: a bf16 model's first greedy token is the argmax of the same prefill's
    float32 logits, recomputed here through the same runner."""
    from kvflow.attention.backend import SeqLayout

    llm = LLM(tiny_llama[0], num_kv_blocks=64, max_model_len=128, dtype="bfloat16")
    runner = llm.engine.executor.runner
    prompts = [[5, 9, 23, 7, 81], [300, 2, 2, 41], [17] * 20]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
    for prompt, out in zip(prompts, outs):
        meta = runner.attention.build_metadata([SeqLayout(0, len(prompt), list(range(-(-len(prompt) // 16))))])
        with torch.inference_mode():
            hidden = runner.model(torch.tensor(prompt), meta.positions, runner.kv_caches, meta)
            raw = runner.model.compute_logits(hidden[-1:], float32=False)
            logits = runner.model.compute_logits(hidden[-1:])
        assert raw.dtype == torch.bfloat16 and logits.dtype == torch.float32
        assert out.outputs[0].token_ids == logits.argmax(dim=-1).tolist()
