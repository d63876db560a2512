"""Prompt lookup (n-gram) proposals, and SpeculativeConfig validation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvflow.core.request import Request
from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode import NgramProposer, SpeculativeConfig
from kvflow.spec_decode.ngram_proposer import NgramBatchProposer


def _reference(tokens: list[int], lo: int, hi: int, k: int) -> tuple[list[int], int]:
    """The definition, spelled out: longest n first, then the most recent earlier occurrence; the
    drafts and that n."""
    n_tok = len(tokens)
    for n in range(hi, lo - 1, -1):
        if n_tok <= n:
            continue
        suffix = tokens[-n:]
        for s in range(n_tok - n - 1, -1, -1):
            if tokens[s : s + n] == suffix:
                return tokens[s + n : s + n + k], n
    return [], 0


def test_match_and_k_limit():
    prop = NgramProposer(1, 3, num_speculative_tokens=3)
    seq = [1, 2, 3, 4, 1, 2]
    assert prop.propose(seq, 3) == [3, 4, 1]
    assert prop.propose(seq) == [3, 4, 1]  # k defaults to num_speculative_tokens
    assert prop.propose(seq, 1) == [3]
    assert prop.propose(seq, 10) == [3, 4, 1, 2]  # no more than what followed
    assert prop.propose(seq, 0) == []


def test_no_match():
    prop = NgramProposer(1, 3, 4)
    assert prop.propose([1, 2, 3, 4], 4) == []
    assert prop.propose([], 4) == [] and prop.propose([7], 4) == []
    assert NgramProposer(2, 3, 4).propose([7, 8, 9, 8], 4) == []  # only a 1-gram matches: below min


def test_prefers_longer_n():
    # [6] last occurred at index 4 (-> 8), but [5, 6] occurred at 0 (-> 7): the longer match wins.
    seq = [5, 6, 7, 9, 6, 8, 5, 6]
    assert NgramProposer(1, 3, 3).propose(seq, 3) == [7, 9, 6]
    assert NgramProposer(1, 1, 3).propose(seq, 3) == [8, 5, 6]  # max_n = 1: only the 1-gram


def test_most_recent_occurrence():
    seq = [1, 2, 3, 1, 2, 4, 1, 2]
    assert NgramProposer(1, 2, 2).propose(seq, 2) == [4, 1]
    # Capped at max_n = 2 the 3-gram [1, 2, 3] does not count; [2, 3] at 5 is more recent than 1.
    seq = [1, 2, 3, 10, 9, 2, 3, 11, 1, 2, 3]
    assert NgramProposer(1, 2, 2).propose(seq, 2) == [11, 1]
    assert NgramProposer(1, 3, 2).propose(seq, 2) == [10, 9]
    # An occurrence may overlap the suffix (a repetition loop).
    assert NgramProposer(1, 2, 3).propose([4, 1, 1, 1], 3) == [1]


# Small ids, and ids whose int32 bytes repeat each other shifted by a byte or two (the lookup
# searches bytes: a match across token boundaries must not count).
@pytest.mark.parametrize("alphabet", [[0, 1, 2, 3], [0, 1, 256, 257, 65536, 65792, 16777216, 16777217]])
def test_matches_the_definition_on_random_sequences(alphabet):
    rng = random.Random(0)
    for _ in range(300):
        seq = [rng.choice(alphabet) for _ in range(rng.randrange(0, 40))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(1, 6)
        got = NgramProposer(lo, hi, 6).lookup(seq, k)
        assert got == _reference(seq, lo, hi, k), (seq, lo, hi, k)  # the drafts and the matched n
        assert NgramProposer(lo, hi, 6).propose(np.array(seq, dtype=np.int32), k) == got[0]


def test_long_sequence():
    rng = random.Random(1)
    seq = [rng.randrange(30000) for _ in range(4000)]
    seq += seq[1000:1010]  # the last 10 tokens occurred at 1000..1009
    assert NgramProposer(2, 5, 4).propose(seq, 4) == seq[1010:1014]


def test_proposer_arguments():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2, 4)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(0, 2, 4)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(1, 2, 0)


# ---- SpeculativeConfig -----------------------------------------------------------------------
def test_config_defaults():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.adaptive) == (2, 4, True)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 3, "quantization": "int8"})
    assert c.model is None and c.quantization == "int8"
    c = SpeculativeConfig.from_dict(
        {"method": "draft_model", "num_speculative_tokens": 3, "model": "/m", "adaptive": False}
    )
    assert c.model == "/m" and c.quantization is None and not c.adaptive


@pytest.mark.parametrize(
    "d, match",
    [
        (
            {"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3},
            r"unknown.*'lookahead'.*valid keys.*'method'",
        ),
        ({"method": "eagle", "num_speculative_tokens": 2}, r"method must be one of \('ngram', 'draft_model'\)"),
        ({"num_speculative_tokens": 2}, r"needs 'method'.*ngram"),
        ({"method": "ngram"}, r"needs 'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, r"num_speculative_tokens must be an integer"),
        ({"method": "ngram", "num_speculative_tokens": True}, r"num_speculative_tokens must be an integer"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, r"prompt_lookup_min must be"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/m"}, r"model applies to method 'draft_model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"}, r"quantization applies to"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, r"needs a model.*quantization='int8'"),
        (
            {"method": "draft_model", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
            r"prompt_lookup_max applies to method 'ngram'",
        ),
        (
            {"method": "draft_model", "num_speculative_tokens": 2, "quantization": "fp8"},
            r"quantization must be one of \(None, 'int8'\)",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": ""}, r"model must be a path"),
        ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, r"adaptive must be true or false"),
    ],
)
def test_config_errors(d, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(d)


def test_batch_proposer_keeps_each_request_as_an_array():
    """The batch proposer keeps each request's tokens as a growing array between steps: its drafts
    and match lengths stay the definition's as tokens are appended, past the array's first size,
    and after a request's tokens are replaced (a new request under the same id once released)."""
    rng = random.Random(2)
    batch = NgramBatchProposer(NgramProposer(2, 4, 5))
    prompt = [rng.randrange(6) for _ in range(30)]
    r = Request("a", "a", 0, prompt, SamplingParams(max_tokens=1000), 1000, 0.0)
    for _ in range(200):
        r.output_token_ids.append(rng.randrange(6))
        got = batch.propose([r], {"a": 5})["a"]
        assert (got.tokens, got.evidence) == _reference(prompt + r.output_token_ids, 2, 4, 5)
    batch.release(["a"])
    r2 = Request("a", "a", 0, [9, 8, 7, 9, 8], SamplingParams(max_tokens=10), 10, 0.0)
    r2.output_token_ids = [7]
    assert batch.propose([r2], {"a": 5})["a"].tokens == _reference([9, 8, 7, 9, 8, 7], 2, 4, 5)[0] == [9, 8, 7]
    # tokens that changed under the same id without a release: noticed, not read stale
    r2.output_token_ids = [5]
    assert batch.propose([r2], {"a": 5})["a"].tokens == _reference([9, 8, 7, 9, 8, 5], 2, 4, 5)[0]
