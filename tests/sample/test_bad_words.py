"""vLLM's bad_words: the ban against a brute-force reading of its definition, and in the engine
against plain greedy decoding (the same tokens up to where plain decoding would write a banned
sequence, then another token), with and without speculative decoding."""

from __future__ import annotations

import random

import pytest

from kvflow import LLM, SamplingParams
from kvflow.sample.bad_words import bad_word_sequences, banned_next

from conftest import assert_no_leaks


def test_banned_next_is_every_token_that_would_complete_a_sequence():
    rng = random.Random(0)
    for _ in range(300):
        seqs = [tuple(rng.randrange(6) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 4))]
        output = [rng.randrange(6) for _ in range(rng.randint(0, 6))]
        expected = {
            t for t in range(6) for s in seqs if len(output) + 1 >= len(s) and (output + [t])[-len(s) :] == list(s)
        }
        assert set(banned_next(output, seqs)) == expected, (output, seqs)


def test_ban_bad_words_reads_only_the_tail_and_gets_the_same_bans():
    # each row's bans against banned_next over the row's whole history (output + drafts before it)
    import torch

    from kvflow.sample.bad_words import ban_bad_words

    rng = random.Random(1)
    for _ in range(3000):  # (outputs shorter and longer than the longest sequence, 2 tokens: matches are common)
        seqs = [tuple(rng.randrange(2) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        output = [rng.randrange(2) for _ in range(rng.randint(0, 7))]
        drafts = [rng.randrange(2) for _ in range(rng.randint(0, 3))]
        rows = torch.zeros(len(drafts) + 1, 5)
        ban_bad_words(rows, output, drafts, seqs)
        for j in range(len(drafts) + 1):
            got = {t for t in range(5) if rows[j, t] == float("-inf")}
            assert got == set(banned_next(output + drafts[:j], seqs)), (seqs, output, drafts, j)


def test_bad_word_sequences_bare_and_after_a_space():
    vocab = {"cat": [5], " cat": [9], "big dog": [7, 8], " big dog": [3, 8]}
    assert bad_word_sequences(["cat", "  big dog"], lambda text: vocab[text]) == ((5,), (9,), (7, 8), (3, 8))
    assert bad_word_sequences(["cat", "cat"], lambda text: vocab[text]) == ((5,), (9,))


def _first_completion(output: list[int], seqs) -> int | None:
    """The first output index whose token completes a banned sequence within the output."""
    for i in range(len(output)):
        if any(i + 1 >= len(s) and tuple(output[i + 1 - len(s) : i + 1]) == s for s in seqs):
            return i
    return None


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}])
def test_bad_words_in_the_engine(tiny_llama, speculative):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(tiny_llama[0], num_kv_blocks=64, max_model_len=128, speculative_config=speculative) as llm:
        tok = llm.tokenizer
        plain = llm.generate("The story begins", greedy, use_tqdm=False)[0].outputs[0].token_ids
        tried = 0
        for pos in range(2, len(plain)):
            word = tok.decode([plain[pos]]).strip()
            if not word or not word.isprintable():
                continue
            seqs = bad_word_sequences([word], lambda text: tok(text, add_special_tokens=False)["input_ids"])
            cut = _first_completion(plain, seqs)
            if cut is None:
                continue
            tried += 1
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, bad_words=[word])
            out = llm.generate("The story begins", params, use_tqdm=False)[0].outputs[0].token_ids
            assert _first_completion(out, seqs) is None, (word, seqs, out)
            assert out[:cut] == plain[:cut] and out[cut] != plain[cut], (word, cut, plain, out)
            if tried == 3:
                break
        assert tried >= 1, plain
        if speculative is not None:  # drafts were verified under the ban (the tiny model repeats itself)
            assert llm.engine.speculator.stats.num_draft_tokens > 0
        with pytest.raises(ValueError, match="bad_words"):
            llm.generate("hi", SamplingParams(bad_words=["  "]), use_tqdm=False)
        assert_no_leaks(llm.engine)
