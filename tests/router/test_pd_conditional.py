"""Conditional prefill/decode disaggregation (`kvflow router --max-local-prefill-length`): which
requests the pd policy sends straight to a decode engine, and the flag's checks. The policy alone,
no server; the HTTP flow is in test_router.py, real engines in tests/server/test_pd_server.py."""

from __future__ import annotations

import pytest

from kvflow.cli.main import main as kvflow_main
from kvflow.router import RouterConfig
from kvflow.router.policies import TEXT_MIN_HIT_TOKENS, PrefillDecodePolicy, RouteRequest, make_policy
from kvflow.router.prefix_tree import CHARS_PER_TOKEN

P = ["http://p:1"]
D = ["http://d1:1", "http://d2:1"]
COMPLETIONS = "/v1/completions"


def _policy(threshold: int, decode=D) -> PrefillDecodePolicy:
    c = RouterConfig(prefill=P, decode=list(decode), max_local_prefill_length=threshold)
    return make_policy(c.policy, c.policy_options())


def _ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def _route(policy, prompt, path=COMPLETIONS, **body):
    key = "messages" if path == "/v1/chat/completions" else "prompt"
    return policy.route(RouteRequest(path, {key: prompt, **body}))


def test_threshold_zero_is_todays_path():
    policy = _policy(0)
    assert policy.trees is None  # nothing kept when nothing is decided
    for prompt in ("hi", _ids(0, 3), "a long document " * 500):
        route = _route(policy, prompt)
        assert route.prefill is not None and route.pd_decision == "remote_prefill"
        assert route.local_prefill_tokens is None


def test_token_id_prompts_count_exactly_at_the_threshold():
    policy = _policy(10, decode=D[:1])
    short = _route(policy, _ids(1000, 10))  # 10 tokens to compute: at most 10
    assert (short.prefill, short.pd_decision, short.local_prefill_tokens) == (None, "local_prefill", 10)
    assert short.target.url == D[0] and short.target.role == "decode"
    long = _route(policy, _ids(2000, 11))
    assert long.prefill is not None and long.prefill.url == P[0]
    assert (long.pd_decision, long.local_prefill_tokens) == ("remote_prefill", 11)


def test_text_prompts_are_estimated_from_their_characters():
    policy = _policy(64, decode=D[:1])
    chat = "x" * int(60 * CHARS_PER_TOKEN)  # about 60 tokens
    doc = "y" * int(2000 * CHARS_PER_TOKEN)
    assert _route(policy, chat).pd_decision == "local_prefill"
    route = _route(policy, doc)
    assert route.pd_decision == "remote_prefill" and route.local_prefill_tokens == pytest.approx(2000)
    messages = [{"role": "user", "content": "z" * 100}]
    assert _route(policy, messages, path="/v1/chat/completions").pd_decision == "local_prefill"


def test_the_decode_engines_expected_prefix_hit_is_subtracted():
    """A long prompt's KV lands in its decode engine's prefix cache (fetched or computed): the same
    prefix with a short new tail is then cheap there, and only there."""
    policy = _policy(32)
    system = _ids(0, 500)
    first = _route(policy, system + _ids(5000, 8))
    assert first.pd_decision == "remote_prefill" and first.target.url == D[0]
    # the next request's decode engine (round robin: d2) has never seen the prefix
    other = _route(policy, system + _ids(6000, 8))
    assert other.pd_decision == "remote_prefill" and other.target.url == D[1]
    again = _route(policy, system + _ids(7000, 8))  # d1 again: 500 of 508 tokens cached
    assert again.target.url == D[0] and again.pd_decision == "local_prefill"
    assert again.local_prefill_tokens == pytest.approx(8)
    # a hit under one block counts as none (the engine reuses whole blocks only)
    tiny = _policy(TEXT_MIN_HIT_TOKENS, decode=D[:1])
    _route(tiny, _ids(0, 2 * TEXT_MIN_HIT_TOKENS))
    route = _route(tiny, _ids(0, TEXT_MIN_HIT_TOKENS - 1) + _ids(9000, TEXT_MIN_HIT_TOKENS + 1))
    assert route.pd_decision == "remote_prefill" and route.local_prefill_tokens == 2 * TEXT_MIN_HIT_TOKENS
    # a fully cached prompt still computes its last token
    assert _route(tiny, _ids(0, 2 * TEXT_MIN_HIT_TOKENS)).local_prefill_tokens == 1


def test_requests_without_a_prefill_step_are_no_decision():
    policy = _policy(1000)
    for path, body in (
        (COMPLETIONS, {"prompt": "x", "n": 2}),
        (COMPLETIONS, {"prompt": ["a", "b"]}),
        ("/v1/responses", {"input": "x"}),
        ("/v1/embeddings", {"input": "x"}),
    ):
        route = policy.route(RouteRequest(path, body))
        assert route.prefill is None and route.pd_decision is None


def test_unreadable_prompt_goes_through_the_prefill_engine():
    """Nothing the router can measure (the engine will answer its 400): today's path."""
    route = _route(_policy(1000), {"not": "a prompt"})
    assert route.prefill is not None and route.pd_decision == "remote_prefill"


def test_decode_trees_are_bounded_by_cache_max_chars():
    c = RouterConfig(prefill=P, decode=D[:1], max_local_prefill_length=8, cache_max_chars=100)
    policy = make_policy(c.policy, c.policy_options())
    for i in range(20):
        _route(policy, f"{i:03d}" + "w" * 60)
    assert len(policy.trees[policy.backends()[1]]) <= 100


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_config_refuses_a_bad_threshold(bad):
    with pytest.raises(ValueError, match="--max-local-prefill-length must be an integer >= 0"):
        RouterConfig(prefill=P, decode=D, max_local_prefill_length=bad)


def test_config_threshold_is_for_pd_only():
    with pytest.raises(ValueError, match="--max-local-prefill-length is for --policy pd"):
        RouterConfig(backends=D, max_local_prefill_length=64)
    assert RouterConfig(backends=D).max_local_prefill_length == 0  # the default everywhere
    assert RouterConfig(prefill=P, decode=D).policy_options().max_local_prefill_length == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["--prefill", "http://p:1", "--decode", "http://d:1", "--max-local-prefill-length", "-5"],
        ["--backend", "http://d:1", "--max-local-prefill-length", "64"],
    ],
)
def test_cli_errors_name_the_flag(argv, capsys):
    assert kvflow_main(["router", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvflow: error: ") and "--max-local-prefill-length" in err, err
