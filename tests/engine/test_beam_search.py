"""Beam search (`LLM.beam_search`, kvflow.beam_search) against HF transformers'
`generate(num_beams=W)` on the same weights (float32): the same beams in the same order with the
same scores, with stop tokens (EOS and stop_token_ids), min_tokens and length penalties, several
prompts at once, chunked prefill and prefix caching on or off; then its limits."""

from __future__ import annotations

import random
import re

import pytest
import torch

from kvflow import LLM
from kvflow.beam_search import BeamSearch, BeamSearchParams

from conftest import assert_no_leaks, hf_beams, make_model

EOS, STOP = 1, 2
MAX_NEW = 10


@pytest.fixture(scope="module")
def stopping_model(tmp_path_factory):
    """A tiny Llama whose EOS and token 2 have their lm_head rows scaled up, so beams end on them
    now and then (a random model's near-uniform next token would almost never be one)."""
    path = tmp_path_factory.mktemp("beam-llama")
    hf = make_model(path, "llama")
    with torch.no_grad():
        hf.lm_head.weight[EOS] *= 4
        hf.lm_head.weight[STOP] *= 4
    hf.save_pretrained(path)
    return str(path), hf


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 17, 30)]


def _hf_beams(hf, prompt, width, stops, length_penalty, min_tokens):
    beams, scores = hf_beams(hf, prompt, width, MAX_NEW, stops, length_penalty, min_tokens)
    if scores is None:  # (HF's greedy search: no scores)
        scores = [_score(hf, prompt, beams[0], length_penalty)]
    return beams, scores


def _score(hf, prompt, tokens, length_penalty) -> float:
    """A beam's score recomputed from one float64 forward of HF's model over prompt + beam."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].double()
    lps = torch.log_softmax(logits, dim=-1)
    cum = sum(lps[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens))
    return cum / len(tokens) ** length_penalty


def _check_against_hf(out, hf, prompt, width, stops, length_penalty, min_tokens):
    beams, scores = _hf_beams(hf, prompt, width, stops, length_penalty, min_tokens)
    got = [s.tokens for s in out.sequences]
    ours = [s.score for s in out.sequences]
    assert len(got) == width
    # The same beams in the same order, unless two candidates' scores tie within float error (then
    # either choice is right, and the scores still agree).
    assert got == beams or ours == pytest.approx(scores, abs=1e-4), (got, beams)
    assert ours == pytest.approx(scores, abs=1e-4)
    assert ours == pytest.approx([_score(hf, prompt, t, length_penalty) for t in got], abs=1e-4)
    for s in out.sequences:
        assert s.cum_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(s.tokens, s.logprobs)), abs=1e-5)
        assert s.score == pytest.approx(s.cum_logprob / len(s.tokens) ** length_penalty)
        ended = s.tokens[-1] in stops and len(s.tokens) > min_tokens
        assert s.finish_reason == ("stop" if ended else "length")
        assert s.stop_reason == (s.tokens[-1] if ended else None)
        assert all(t not in stops for t in s.tokens[:-1])  # a stop token ends a beam
        assert len(s.tokens) >= min(min_tokens + 1, MAX_NEW) or s.finish_reason == "length"


@pytest.mark.parametrize(
    "width,length_penalty,stop_token_ids,min_tokens",
    [
        (1, 1.0, [], 0),
        (2, 1.0, [], 0),
        (2, 0.0, [STOP], 0),
        (3, 1.0, [STOP], 0),
        (3, 2.0, [STOP], 4),
        (3, -0.5, [], 0),
        (4, 0.0, [STOP], 4),
    ],
)
def test_beams_equal_hf_generate(stopping_model, width, length_penalty, stop_token_ids, min_tokens):
    path, hf = stopping_model
    # chunks of 8 tokens: the longer prompts' prefill crosses steps
    llm = LLM(path, num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=8)
    prompts = _prompts(width * 10 + min_tokens)
    params = BeamSearchParams(
        beam_width=width,
        max_tokens=MAX_NEW,
        length_penalty=length_penalty,
        stop_token_ids=stop_token_ids,
        min_tokens=min_tokens,
    )
    outs = llm.beam_search(prompts, params)  # the prompts' beams batched together
    assert [o.prompt_token_ids for o in outs] == prompts
    for prompt, out in zip(prompts, outs):
        _check_against_hf(out, hf, prompt, width, [EOS, *stop_token_ids], length_penalty, min_tokens)
    assert_no_leaks(llm.engine)


def test_ignore_eos_and_text(stopping_model):
    path, hf = stopping_model
    llm = LLM(path, num_kv_blocks=128, max_model_len=256)
    prompt = llm.tokenizer.encode("Once upon a time")
    out = llm.beam_search({"prompt": "Once upon a time"}, BeamSearchParams(beam_width=3, max_tokens=MAX_NEW))[0]
    _check_against_hf(out, hf, prompt, 3, [EOS], 1.0, 0)
    for s in out.sequences:  # the text is the tokens' (a stop token's left out, as in generate)
        kept = s.tokens[:-1] if s.finish_reason == "stop" else s.tokens
        assert s.text == llm.tokenizer.decode(kept, skip_special_tokens=True)
    free = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=MAX_NEW, ignore_eos=True))[0]
    beams, scores = _hf_beams(hf, prompt, 3, [STOP + 1000], 1.0, 0)  # (a stop token that never comes)
    assert [s.tokens for s in free.sequences] == beams
    assert all(s.finish_reason == "length" and len(s.tokens) == MAX_NEW for s in free.sequences)
    assert [s.score for s in free.sequences] == pytest.approx(scores, abs=1e-4)


def test_prefix_caching_off_gives_the_same_beams(stopping_model):
    path, _ = stopping_model
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_NEW, stop_token_ids=[STOP])
    prompts = _prompts(7)
    with LLM(path, num_kv_blocks=128, max_model_len=256) as cached:
        a = cached.beam_search(prompts, params)
        hits = cached.get_stats()
    with LLM(path, num_kv_blocks=128, max_model_len=256, enable_prefix_caching=False) as plain:
        b = plain.beam_search(prompts, params)
        assert_no_leaks(plain.engine)
    for x, y in zip(a, b):
        assert [s.tokens for s in x.sequences] == [s.tokens for s in y.sequences]
        assert [s.score for s in x.sequences] == pytest.approx([s.score for s in y.sequences], abs=1e-5)
    assert hits.prefix_cache_hits > 0  # the steps found the beams' earlier blocks


def test_limits_are_clear_errors(stopping_model):
    path, _ = stopping_model
    llm = LLM(path, num_kv_blocks=64, max_model_len=64)
    with pytest.raises(ValueError, match=r"beam_width 7 needs the top 21 log-probabilities.*at most 6"):
        llm.beam_search([[5, 6]], BeamSearchParams(beam_width=7, max_tokens=4, stop_token_ids=[STOP]))
    with pytest.raises(ValueError, match="exceeds max_model_len 64"):
        llm.beam_search([[5] * 60], BeamSearchParams(beam_width=2, max_tokens=8))
    with pytest.raises(ValueError, match="out of range"):
        llm.beam_search([[5, 6]], BeamSearchParams(beam_width=2, max_tokens=4, stop_token_ids=[10**6]))
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search([[5, 6]], {"beam_width": 2})
    for bad, fragment in (
        (dict(beam_width=0), "beam_width must be an integer >= 1"),
        (dict(beam_width=2, max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(beam_width=2, length_penalty=float("nan")), "length_penalty must be a finite number"),
        (dict(beam_width=2, max_tokens=3, min_tokens=5), "min_tokens (5) must not exceed max_tokens (3)"),
        (dict(beam_width=2, stop_token_ids=[-1]), "stop_token_ids must be a list of token ids"),
    ):
        with pytest.raises(ValueError, match=re.escape(fragment)):
            BeamSearchParams(**bad)
    # up to the context when max_tokens is None: the search stops at max_model_len
    out = llm.beam_search([[5] * 60], BeamSearchParams(beam_width=2, ignore_eos=True))[0]
    assert all(len(s.tokens) == 4 and s.finish_reason == "length" for s in out.sequences)
    assert_no_leaks(llm.engine)


def test_a_search_takes_results_in_order():
    search = BeamSearch([3, 4], BeamSearchParams(beam_width=2, max_tokens=3), (EOS,), 64, max_logprobs=20)
    assert search.pending() == [[3, 4]]
    with pytest.raises(ValueError, match="advance got 2 results for 1 beams"):
        search.advance([{}, {}])
    with pytest.raises(RuntimeError, match="has not finished"):
        search.result()
