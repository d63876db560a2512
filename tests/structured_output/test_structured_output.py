"""Structured outputs in the engine, on a tiny random model: its unconstrained output is noise, so
every valid output below is valid because of the grammar's mask alone. JSON schemas validate with
the `jsonschema` package (strict `json.loads`), regex and choice outputs match, greedy is
reproducible, unconstrained neighbours in the batch are untouched, speculative decoding verifies
under the same masks, and bad constraints are errors that name the problem."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvflow import LLM, SamplingParams, StructuredOutputsParams
from kvflow.structured_output.grammar import GrammarError

from conftest import assert_no_leaks
from structured_schemas import SCHEMAS

PROMPTS = ["Hello", "The quick brown fox", "Paris is the capital of", "def hello(name):", "東京は"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = LLM(model=tiny_llama[0], num_kv_blocks=2048, max_model_len=512)
    yield engine
    assert_no_leaks(engine.engine)


def constrained(max_tokens: int = 400, temperature: float = 1.0, seed: int | None = None, **constraint):
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**constraint),
    )


def texts(llm, prompts, params) -> list[tuple[str, str]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(c.text, c.finish_reason) for o in outs for c in o.outputs]


def test_fifty_json_schemas_all_valid(llm):
    """Every schema, sampled (two seeds) and greedy, in one batch: 150 outputs, all valid."""
    prompts, params, schemas = [], [], []
    for i, (name, schema) in enumerate(SCHEMAS):
        for seed in (i, 1000 + i):
            prompts.append(PROMPTS[i % len(PROMPTS)])
            params.append(constrained(seed=seed, json=schema))
            schemas.append((name, schema))
        # greedy on a random model takes whitespace at every gap, up to the bound: compact here
        prompts.append(PROMPTS[(i + 1) % len(PROMPTS)])
        params.append(constrained(temperature=0.0, json=schema, disable_any_whitespace=True))
        schemas.append((name, schema))
    assert len(SCHEMAS) == 50
    before = llm.get_stats().structured_output
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, (name, schema) in zip(outs, schemas):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (name, c.finish_reason, c.text[-80:])
        try:
            value = json.loads(c.text)  # strict: raw control characters in strings are refused
        except ValueError as e:
            raise AssertionError(f"{name}: not JSON ({e}): {c.text!r}") from None
        jsonschema.validate(value, schema, cls=jsonschema.Draft202012Validator)
    after = llm.get_stats().structured_output
    # two seeds share one compiled grammar; the compact greedy one is another grammar
    assert after.compiles_total - before.compiles_total == 100
    assert after.cache_hits_total - before.cache_hits_total == 50


def test_regex_choice_grammar_and_json_object(llm):
    pattern = r"[a-z]{2,6}-\d{3}(\.[A-Z]{1,3})?"
    choices = ["yes", "no", 'maybe "so"', "line\nbreak", "日本"]
    gbnf = 'root ::= item ("," item){0,3}\nitem ::= [a-z]{1,4} | [0-9]{1,3}'
    for seed in range(6):
        ((text, reason),) = texts(llm, ["Hello"], constrained(seed=seed, regex=pattern))
        assert reason == "stop" and re.fullmatch(pattern, text), text
        ((text, reason),) = texts(llm, ["Hello"], constrained(seed=seed, choice=choices))
        assert reason == "stop" and text in choices, text
        ((text, reason),) = texts(llm, ["Hello"], constrained(seed=seed, grammar=gbnf))
        assert reason == "stop" and re.fullmatch(r"([a-z]{1,4}|[0-9]{1,3})(,([a-z]{1,4}|[0-9]{1,3})){0,3}", text), text
        ((text, reason),) = texts(
            llm, ["Hello"], constrained(seed=seed, max_tokens=500, json_object=True, disable_any_whitespace=True)
        )
        if reason == "stop":  # an unbounded object may run out of tokens; a finished one is valid
            assert isinstance(json.loads(text), dict), text


def test_greedy_reproducible_and_free_neighbours_unchanged(llm):
    schema = dict(SCHEMAS[0][1])
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone_free = texts(llm, PROMPTS, free)
    alone_constrained = texts(llm, PROMPTS[:2], constrained(temperature=0.0, json=schema))
    # mixed: constrained and free requests interleaved in one batch
    outs = llm.generate(
        PROMPTS + PROMPTS[:2], [free] * len(PROMPTS) + [constrained(temperature=0.0, json=schema)] * 2, use_tqdm=False
    )
    mixed = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
    assert mixed[: len(PROMPTS)] == alone_free
    assert mixed[len(PROMPTS) :] == alone_constrained
    assert texts(llm, PROMPTS[:2], constrained(temperature=0.0, json=schema)) == alone_constrained
    # seeded sampling too
    a = texts(llm, PROMPTS, constrained(seed=7, json=schema))
    assert a == texts(llm, PROMPTS, constrained(seed=7, json=schema))


def test_n_completions_each_follow_the_grammar(llm):
    params = SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=200, structured_outputs=StructuredOutputsParams(regex=r"(ab|cd){1,5}!")
    )
    (out,) = llm.generate(["Hello"], params, use_tqdm=False)
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert c.finish_reason == "stop" and re.fullmatch(r"(ab|cd){1,5}!", c.text), c.text


def test_grammar_end_stops_even_with_ignore_eos(llm):
    params = SamplingParams(
        temperature=0.0,
        max_tokens=100,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]),
    )
    ((text, reason),) = texts(llm, ["Hello"], params)
    assert reason == "stop" and text in ("alpha", "beta")


def test_logit_bias(llm, tiny_llama):
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    base = llm.generate(["Hello"], free, use_tqdm=False)[0].outputs[0].token_ids
    # +100 on one token: greedy takes it every time
    forced = (
        llm.generate(
            ["Hello"],
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={77: 100.0}),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert forced == [77] * 8
    # -100 on the greedy tokens: none of them comes out
    banned = set(base)
    out = llm.generate(
        ["Hello"],
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias=dict.fromkeys(banned, -100.0)),
        use_tqdm=False,
    )
    assert not banned & set(out[0].outputs[0].token_ids)
    # a bias reaches sampled rows too (the same distribution shift as greedy)
    out = llm.generate(
        ["Hello"],
        SamplingParams(temperature=1.0, seed=0, max_tokens=16, ignore_eos=True, logit_bias={77: 100.0}),
        use_tqdm=False,
    )
    assert out[0].outputs[0].token_ids == [77] * 16
    with pytest.raises(ValueError, match=r"logit_bias: token id 100000 is out of range"):
        llm.generate(["Hello"], SamplingParams(logit_bias={100000: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match=r"in \[-100, 100\]"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="at most 1024"):
        SamplingParams(logit_bias=dict.fromkeys(range(1025), 1.0))


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_speculative_decoding_verifies_under_the_mask(model_factory, arch):
    """Prompt lookup proposes drafts copied from the prompt; some break the grammar (their
    probability under the mask is 0, so they are rejected). Greedy output equals plain decoding
    under the same grammar, and sampled output is valid; on a dense model and on a routed one."""
    path, _ = model_factory(arch)
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "age"],
    }
    prompt = 'Example: {"name": "fox", "age": 3} and {"name": "dog", "age": 7} and {"name": "'
    params = constrained(temperature=0.0, json=schema, disable_any_whitespace=True)
    plain = LLM(model=path, num_kv_blocks=256)
    want = texts(plain, [prompt, "Hello"], params)
    spec = LLM(
        model=path,
        num_kv_blocks=256,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
            "adaptive": False,
        },
    )
    assert texts(spec, [prompt, "Hello"], params) == want
    stats = spec.get_stats().spec_decode
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    for text, reason in texts(spec, [prompt] * 4, constrained(seed=5, json=schema)):
        assert reason == "stop"
        jsonschema.validate(json.loads(text), schema)
    assert_no_leaks(spec.engine)


@pytest.mark.parametrize(
    "constraint,fragment",
    [
        ({"json": {"type": "strin"}}, "the JSON schema is invalid"),
        ({"json": {"type": "object", "properties": {"a": {"minimum": "zero"}}}}, "the JSON schema is invalid"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"regex": "a(b"}, "structured_outputs.regex cannot be compiled"),
        ({"grammar": "root ::= "}, "structured_outputs.grammar cannot be compiled"),
        ({"grammar": 'start ::= "a"'}, "structured_outputs.grammar cannot be compiled"),
        ({"choice": []}, "non-empty list"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({}, "exactly one"),
    ],
)
def test_bad_constraints_are_clear_errors(llm, constraint, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        llm.generate(
            ["Hello"], SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)), use_tqdm=False
        )
    ((text, reason),) = texts(llm, ["Hello"], constrained(seed=0, choice=["ok"]))  # still serving
    assert (text, reason) == ("ok", "stop")


_STR = {"type": "string", "maxLength": 4}
# What xgrammar 0.2.8 would accept and not enforce (an audit with random walks: each of these let
# invalid outputs through), refused with the path and the reason.
UNENFORCEABLE = [
    *[
        ({"type": "object", "properties": {"a": {"type": "array", "items": _STR, k: v}}}, f"#/properties/a uses {k}")
        for k, v in (("contains", _STR), ("minContains", 1), ("maxContains", 2), ("unevaluatedItems", False))
    ],
    *[
        ({"type": "object", "properties": {"a": _STR}, k: v}, f"# uses {k}")
        for k, v in (
            ("dependentRequired", {"a": ["b"]}),
            ("dependentSchemas", {"a": {}}),
            ("unevaluatedProperties", False),
            ("if", {}),
            ("then", {}),
            ("else", {}),
            ("not", {}),
        )
    ],
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uses uniqueItems"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf without a discriminator"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf with several schemas"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf on a non-integer"),
    ({"type": "string", "pattern": "[a-z]+", "maxLength": 3}, "uses pattern with maxLength"),
    ({"type": "string", "format": "email", "minLength": 3}, "uses format with minLength"),
    ({"type": "string", "pattern": "(?!x)[a-z]"}, "lookaround"),
    ({"type": "object", "properties": {"a": _STR}, "required": ["b"]}, "requires 'b'"),
    ({"$ref": "http://example.com/s.json"}, "remote $ref"),
    (
        {"$defs": {"s": _STR}, "type": "object", "properties": {"a": {"$ref": "#/$defs/s", "minLength": 2}}},
        "#/properties/a uses minLength next to $ref",
    ),
]


@pytest.mark.parametrize("schema,fragment", UNENFORCEABLE)
def test_schemas_xgrammar_would_not_enforce_are_refused(llm, schema, fragment):
    with pytest.raises(GrammarError, match=re.escape(fragment)):
        llm.generate(["Hello"], SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)


def test_what_xgrammar_does_enforce_is_accepted(llm):
    """The neighbours of the refusals above: annotations next to $ref, oneOf with a
    discriminator, allOf of one, multipleOf on integers, uniqueItems false."""
    for schema in (
        {
            "$defs": {"s": _STR},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/s", "description": "x"}},
            "required": ["a"],
        },
        {
            "oneOf": [
                {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]},
            ],
            "discriminator": {"propertyName": "k"},
        },
        {"allOf": [{"type": "integer", "minimum": 0, "maximum": 9}]},
        {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 99},
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "maxItems": 3,
            "uniqueItems": False,
        },
    ):
        ((text, reason),) = texts(llm, ["Hello"], constrained(seed=0, json=schema))
        assert reason == "stop"
        jsonschema.validate(json.loads(text), schema)


def test_compile_timeout_is_an_error_not_free_text(tiny_llama):
    llm = LLM(model=tiny_llama[0], num_kv_blocks=64, structured_outputs_compile_timeout_s=1e-4)
    big = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "enum": [f"v{j}" for j in range(50)]} for i in range(200)},
    }
    with pytest.raises(GrammarError, match="did not compile within"):
        llm.generate(["Hello"], SamplingParams(structured_outputs=StructuredOutputsParams(json=big)), use_tqdm=False)
    assert_no_leaks(llm.engine)


def test_apply_bitmask_matches_xgrammar_kernel():
    """kvflow's bitmask application against xgrammar's own kernel on random masks and rows."""
    import torch
    import xgrammar as xgr

    from kvflow.structured_output.manager import GrammarBitmask, apply_bitmask

    g = torch.Generator().manual_seed(0)
    for vocab in (512, 1000, 49152):
        words = xgr.get_bitmask_shape(1, vocab)[1]
        bitmask = torch.randint(-(2**31), 2**31 - 1, (6, words), generator=g, dtype=torch.int64).to(torch.int32)
        bitmask[1] = 0
        bitmask[2] = -1
        logits = torch.randn(6, vocab, generator=g)
        rows = [0, 1, 2, 4]
        want = logits.clone()
        xgr.apply_token_bitmask_inplace(want, bitmask, indices=rows, vocab_size=vocab)
        got = apply_bitmask(logits.clone(), GrammarBitmask(bitmask, rows))
        assert torch.equal(got, want)
