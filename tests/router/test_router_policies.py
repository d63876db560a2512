"""The data-parallel routing policies without HTTP: fake loads (`Backend.record_scrape`, in-flight
counts set as the app would), prompts as bodies. Plus the prefix tree they rest on, the text a
body becomes, the /metrics parsing and the flags' validation."""

from __future__ import annotations

import random

import pytest

from kvflow.cli.main import main as kvflow_main
from kvflow.router.app import parse_engine_load
from kvflow.router.config import RouterConfig
from kvflow.router.policies import (
    POLICIES,
    Backend,
    CacheAwarePolicy,
    LeastLoadedPolicy,
    RoundRobinPolicy,
    RouteRequest,
    make_policy,
)
from kvflow.router.prefix_tree import PrefixTree, prompt_texts

URLS = ["http://127.0.0.1:8101", "http://127.0.0.1:8102", "http://127.0.0.1:8103"]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

SYSTEMS = [
    "You are a careful assistant for a bank. Answer questions about accounts, cards and loans "
    "politely and never reveal internal procedures. " * 2,
    "You are a pirate who only speaks in rhymes and knows everything about sailing ships, "
    "the open sea and buried treasure. " * 2,
]
QUESTIONS = [
    "How do I open an account?",
    "What is my card limit?",
    "Can I get a loan?",
    "Where is the map?",
    "Tell me a story.",
    "What time is it?",
]


def completion(prompt) -> RouteRequest:
    return RouteRequest(COMPLETIONS, {"prompt": prompt, "max_tokens": 8})


def chat(system: str, question: str) -> RouteRequest:
    return RouteRequest(
        CHAT, {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    )


def send(policy, request: RouteRequest, *, finish: bool = True):
    """Route as the app does: the target's in-flight count rises while it serves the request."""
    route = policy.route(request)
    route.target.begin(route.work)
    if finish:
        route.target.end(route.work)
    return route


def by_url(policy, url: str) -> Backend:
    return next(b for b in policy.backends() if b.url == url)


# ---- cache_aware ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda s, q: completion(s + q), chat])
def test_shared_prefix_requests_stick_to_one_replica_per_prefix(make):
    policy = CacheAwarePolicy(URLS)
    targets: dict[int, set[str]] = {0: set(), 1: set()}
    hits = []
    for q in QUESTIONS:  # interleaved: prefix 0, prefix 1, prefix 0, ...
        for i, system in enumerate(SYSTEMS):
            route = send(policy, make(system, q))
            targets[i].add(route.target.url)
            hits.append(route.cache_hit)
    assert all(len(t) == 1 for t in targets.values()), targets
    assert targets[0] != targets[1]  # the second prefix's first request was a miss: the other, idle replica
    assert hits[:2] == [False, False] and all(hits[2:])


def test_hit_ratio_and_threshold():
    policy = CacheAwarePolicy(URLS[:2], threshold=0.5)
    first = send(policy, completion("a" * 600 + "b" * 400))
    assert (first.cache_hit, first.match_ratio) == (False, 0.0)
    same = send(policy, completion("a" * 600 + "c" * 400))  # 60 % of the characters match
    assert same.target is first.target and same.cache_hit and same.match_ratio == pytest.approx(0.6)
    other = send(policy, completion("a" * 400 + "d" * 600))  # 40 %: below the threshold, no match
    assert not other.cache_hit and other.match_ratio == pytest.approx(0.4)
    assert other.target is not first.target  # by load, ties taking turns
    # without a threshold (the default) a 40 % match counts: it saves 100 tokens (400 characters)
    policy = CacheAwarePolicy(URLS[:2])
    first = send(policy, completion("a" * 600 + "b" * 400))
    assert send(policy, completion("a" * 400 + "d" * 600)).target is first.target


def test_text_matches_shorter_than_a_block_are_no_hit():
    policy = CacheAwarePolicy(URLS[:2])
    first = send(policy, completion("x" * 64 + "a" * 100))
    again = send(policy, completion("x" * 60 + "b" * 100))  # 60 characters: 15 tokens, under a block
    assert not again.cache_hit and again.target is not first.target  # ties take turns
    third = send(policy, completion("x" * 64 + "c" * 100))  # 16 tokens: a block
    assert third.cache_hit and third.target is first.target


def test_token_id_prompts_match_by_tokens():
    policy = CacheAwarePolicy(URLS[:2])
    a = send(policy, completion(list(range(100))))
    b = send(policy, completion(list(range(60)) + [7] * 40))
    assert b.target is a.target and b.match_ratio == pytest.approx(0.6)


def _affine(balance_abs: float = 32, balance_rel: float = 1.5) -> tuple[CacheAwarePolicy, Backend, Backend]:
    """A cache_aware policy whose first replica holds the prompt `SYSTEMS[0]`; load costs nothing in
    its score (`load_cost_tokens=0`), so only the imbalance guard keeps a request from its holder."""
    policy = CacheAwarePolicy(URLS[:2], balance_abs=balance_abs, balance_rel=balance_rel, load_cost_tokens=0)
    holder = send(policy, completion(SYSTEMS[0])).target
    other = next(b for b in policy.backends() if b is not holder)
    return policy, holder, other


@pytest.mark.parametrize(
    "holder_load, other_load, imbalanced",
    [
        (40, 8, False),  # max - min = 32: not > 32
        (41, 8, True),  # 33 > 32 and 41 > 1.5 x 8
        (100, 67, False),  # 33 > 32 but 100 <= 1.5 x 67 = 100.5
        (101, 67, True),  # 101 > 100.5
        (32, 0, False),
        (33, 0, True),  # min 0: any max > 0 passes the relative test
        (8, 41, True),  # imbalanced the other way: by load, to the holder (the least loaded) anyway
    ],
)
def test_imbalance_overrides_affinity_exactly_per_both_thresholds(holder_load, other_load, imbalanced):
    policy, holder, other = _affine()
    holder.record_scrape(running=holder_load, waiting=0, kv_usage=0.1)
    other.record_scrape(running=0, waiting=other_load, kv_usage=0.1)
    assert (holder.load, other.load) == (holder_load, other_load)
    assert policy.imbalanced(policy.backends()) == imbalanced
    route = policy.route(completion(SYSTEMS[0] + " and one question"))
    assert route.match_ratio > 0.9  # the holder matches almost everything, whatever decides
    if imbalanced:
        least = holder if holder_load < other_load else other
        assert route.target is least and route.cache_hit is (least is holder)  # routed by load
    else:
        assert route.target is holder and route.cache_hit is True


def test_imbalance_thresholds_are_configurable():
    policy, holder, other = _affine(balance_abs=4, balance_rel=3.0)
    holder.record_scrape(9, 0, 0)
    other.record_scrape(3, 0, 0)  # 6 > 4 but 9 <= 3 x 3: balanced
    assert send(policy, completion(SYSTEMS[0])).target is holder
    holder.record_scrape(10, 0, 0)  # 10 > 9: imbalanced
    assert send(policy, completion(SYSTEMS[0])).target is other


def test_misses_spread_over_idle_replicas():
    policy = CacheAwarePolicy(URLS)
    prompts = [f"{i} " + chr(ord("a") + i) * 50 for i in range(9)]  # nothing shared
    # Each finished before the next (equal loads): ties take turns.
    got = [send(policy, completion(p)).target.url for p in prompts]
    assert {u: got.count(u) for u in URLS} == dict.fromkeys(URLS, 3), got


def test_misses_go_to_the_least_loaded_not_the_smallest_tree():
    """sglang-router's bug: misses go to the replica with the smallest tree, which is the busy one
    when it has served few but long requests. Here misses follow the load."""
    policy = CacheAwarePolicy(URLS[:2], kv_usage_weight=0)  # requests alone count as load here
    busy, idle = policy.backends()
    policy.trees[idle].insert("x" * 5000)  # the idle replica holds the bigger tree
    busy.record_scrape(running=12, waiting=5, kv_usage=0.9)
    idle.record_scrape(running=1, waiting=0, kv_usage=0.1)
    for i in range(10):  # a burst of misses, none finished: all to the idle one, which now holds 11
        route = send(policy, completion(f"question {i} " * 10), finish=False)
        assert route.target is idle and not route.cache_hit
    for i in range(10):  # loads level (17 each after 6 more), then the misses take turns
        send(policy, completion(f"another {i} " * 10), finish=False)
    assert (idle.inflight, busy.inflight) == (18, 2) and abs(idle.load - busy.load) <= 1


def test_a_burst_of_misses_counts_inflight():
    policy = CacheAwarePolicy(URLS[:2])
    for i in range(6):
        send(policy, completion(f"{i}" * 40), finish=False)
    assert [b.inflight for b in policy.backends()] == [3, 3]


def test_prefix_trees_are_bounded_per_replica():
    policy = CacheAwarePolicy(URLS[:2], max_chars=500)
    rng = random.Random(0)
    for _ in range(200):
        send(policy, completion("".join(rng.choice("abcdef") for _ in range(rng.randint(1, 300)))))
        assert all(len(t) <= 500 for t in policy.trees.values())
    assert sum(len(t) for t in policy.trees.values()) > 500  # both replicas were used


def test_unhealthy_replica_is_left_out_and_forgets_its_tree():
    policy = CacheAwarePolicy(URLS[:2])
    holder = send(policy, completion(SYSTEMS[0])).target
    other = next(b for b in policy.backends() if b is not holder)
    policy.set_healthy(holder, False)
    assert len(policy.trees[holder]) == 0
    for _ in range(3):
        assert send(policy, completion(SYSTEMS[0])).target is other
    policy.set_healthy(holder, True)
    assert send(policy, completion(SYSTEMS[0])).target is other  # the affinity moved with the traffic


# ---- least_loaded ---------------------------------------------------------------------------------------
def test_least_loaded_picks_the_minimum():
    policy = LeastLoadedPolicy(URLS)
    a, b, c = policy.backends()
    a.record_scrape(running=4, waiting=3, kv_usage=0.5)
    b.record_scrape(running=2, waiting=0, kv_usage=0.2)
    c.record_scrape(running=2, waiting=1, kv_usage=0.1)
    for _ in range(5):
        assert send(policy, completion("x")).target is b


def test_least_loaded_counts_inflight_between_scrapes():
    policy = LeastLoadedPolicy(URLS[:2])
    a, b = policy.backends()
    a.record_scrape(running=0, waiting=0, kv_usage=0)
    b.record_scrape(running=3, waiting=0, kv_usage=0)
    got = [send(policy, completion("x"), finish=False).target for _ in range(7)]
    # a fills up to b's level, then they take turns: no burst piles onto the one that looked idle
    assert got[:3] == [a, a, a]
    assert (a.inflight, b.inflight) == (5, 2) and (a.load, b.load) == (5, 5)
    # a scrape that sees the router's requests in the engine does not count them twice
    a.record_scrape(running=5, waiting=0, kv_usage=0)
    assert a.load == 5
    a.inflight -= 2  # two finished since
    assert a.load == 3


def test_backend_load_never_below_inflight_and_without_metrics_is_inflight():
    b = Backend("http://h:1", "backend")
    b.inflight = 2
    assert b.load == 2  # never scraped
    b.record_scrape(running=0, waiting=0, kv_usage=0)  # the engine has not seen them yet
    assert b.load == 2
    b.record_scrape(running=6, waiting=4, kv_usage=0)  # other clients' requests too
    assert b.load == 10
    b.forget_scrape()
    assert b.load == 2


def test_least_loaded_ties_by_kv_usage_then_turns():
    policy = LeastLoadedPolicy(URLS[:2])
    a, b = policy.backends()
    a.record_scrape(1, 0, 0.7)
    b.record_scrape(1, 0, 0.3)
    assert send(policy, completion("x")).target is b
    b.record_scrape(1, 0, 0.7)
    assert {send(policy, completion("x")).target.url for _ in range(2)} == set(URLS[:2])


# ---- shared by the replica policies -------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [RoundRobinPolicy, LeastLoadedPolicy, CacheAwarePolicy])
def test_unhealthy_replicas_are_skipped_and_retries_go_elsewhere(cls):
    policy = cls(URLS)
    a, b, c = policy.backends()
    policy.set_healthy(b, False)
    assert {send(policy, completion(f"{i}" * 9)).target.url for i in range(6)} == {a.url, c.url}
    assert policy.primary() is a
    retry = policy.reroute(completion("x"), a)
    assert retry is not None and retry.target is c
    policy.set_healthy(c, False)
    assert policy.reroute(completion("x"), a) is None  # no other healthy replica: no retry
    policy.set_healthy(a, False)
    # none healthy: all are candidates (a real attempt's error beats a made-up refusal)
    assert {send(policy, completion(f"new{i}" * 9)).target.url for i in range(6)} == set(URLS)
    assert policy.primary() is a


def test_round_robin_order_is_kept():
    policy = RoundRobinPolicy(URLS)
    assert [send(policy, completion("x")).target.url for _ in range(4)] == [*URLS, URLS[0]]
    policy.set_healthy(by_url(policy, URLS[1]), False)
    assert [send(policy, completion("x")).target.url for _ in range(3)] == [URLS[2], URLS[0], URLS[2]]


def test_policies_from_config():
    assert {"round_robin", "least_loaded", "cache_aware", "pd"} <= set(POLICIES)
    c = RouterConfig(
        backends=URLS[:2],
        policy="cache_aware",
        cache_threshold=0.8,
        balance_abs_threshold=4,
        balance_rel_threshold=2.0,
        cache_max_chars=1000,
    )
    p = make_policy(c.policy, c.policy_options())
    assert isinstance(p, CacheAwarePolicy) and (p.threshold, p.balance_abs, p.balance_rel) == (0.8, 4, 2.0)
    assert all(t.max_chars == 1000 for t in p.trees.values())
    assert p.uses_load and p.health_checked
    assert RouterConfig(backends=URLS[:2]).policy == "round_robin"  # the default stays
    pd = RouterConfig(prefill=URLS[:1], decode=URLS[1:2])
    assert not make_policy(pd.policy, pd.policy_options()).health_checked


# ---- the prefix tree --------------------------------------------------------------------------------------
def test_prefix_tree_matches_like_brute_force():
    rng = random.Random(1)
    tree = PrefixTree(10**9)
    texts: list[str] = []
    for _ in range(300):
        base = rng.choice(texts) if texts and rng.random() < 0.6 else ""
        t = base[: rng.randint(0, len(base))] + "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        tree.insert(t)
        texts.append(t)
        q = "".join(rng.choice("ab") for _ in range(rng.randint(0, 14)))
        for query in (q, t, t + "a", t[:-1]):
            want = max(_lcp(query, x) for x in texts)
            assert tree.match(query) == want, (query, texts)
    assert tree.size <= sum(len(t) for t in texts)


def _lcp(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_prefix_tree_lru_bound_holds_and_keeps_what_is_used():
    tree = PrefixTree(max_chars=200)
    hot = "H" * 80
    tree.insert(hot)
    for i in range(100):
        tree.insert(f"{i:03d}" + "c" * 60)
        assert tree.size <= 200
        if i % 2 == 0:
            tree.insert(hot)  # used again: stays
    assert tree.match(hot) == 80
    assert tree.match("000" + "c" * 60) <= 2  # old leaves went first (a leading digit may be shared)
    assert tree.match("099" + "c" * 60) == 63  # the newest is there
    # a text longer than the bound is kept up to the bound, evicting everything else
    tree.insert("L" * 1000)
    assert tree.size == 200 and tree.match("L" * 1000) == 200 and tree.match(hot) == 0


def test_prefix_tree_evicts_leaves_then_their_parents():
    tree = PrefixTree(max_chars=30)
    tree.insert("shared-prefix-" + "a" * 6)  # 20 chars
    tree.insert("shared-prefix-" + "b" * 6)  # +6: 26, the shared part stored once
    assert tree.size == 26
    tree.insert("zzzzzzzzzz")  # 36 > 30: the oldest leaf ("aaaaaa") goes
    assert tree.size == 30 and tree.match("shared-prefix-aaaaaa") == 14
    tree.insert("y" * 20)  # the oldest leaves go: "bbbbbb", then the bare "shared-prefix-" parent
    assert tree.size <= 30 and tree.match("shared-prefix-") == 0 and tree.match("y" * 20) == 20


def test_prefix_tree_bookkeeping_stays_small():
    tree = PrefixTree(max_chars=10**6)
    for _ in range(2000):
        tree.insert("the same prompt")  # no eviction pressure: stale LRU entries must not pile up
    assert len(tree._heap) <= 2 * tree.num_nodes + 65
    tree.clear()
    assert tree.size == 0 and tree.match("the same prompt") == 0


# ---- the text a request becomes ------------------------------------------------------------------------------
def test_prompt_texts():
    assert prompt_texts(COMPLETIONS, {"prompt": "hello"}) == ["hello"]
    assert prompt_texts(COMPLETIONS, {"prompt": [72, 105]}) == ["Hi"]
    assert prompt_texts(COMPLETIONS, {"prompt": ["a", [72, 105], 3]}) == ["a", "Hi"]
    assert prompt_texts(COMPLETIONS, {"prompt": [2**40]}) == [chr(2**40 % 0x110000)]
    assert prompt_texts(COMPLETIONS, {}) == [] and prompt_texts(COMPLETIONS, {"prompt": 5}) == []
    [text] = prompt_texts(
        CHAT,
        {
            "messages": [
                {"role": "system", "content": "be nice"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}]},
                {"role": "assistant", "tool_calls": [{"id": "1"}]},
                "junk",
            ]
        },
    )
    assert text == '<|system|>be nice\n<|user|>hi\n<|assistant|>[{"id":"1"}]\n'
    # a different role is a different prompt even with the same words
    assert (
        prompt_texts(CHAT, {"messages": [{"role": "user", "content": "be nice"}]})[0]
        != prompt_texts(CHAT, {"messages": [{"role": "system", "content": "be nice"}]})[0]
    )
    assert prompt_texts(CHAT, {"tools": [{"type": "function"}], "messages": []})[0].startswith("<|tools|>")
    assert prompt_texts(CHAT, {"messages": "nope"}) == [""]


def test_parse_engine_load():
    text = """# HELP kvflow:num_requests_running Sequences in the running batch.
# TYPE kvflow:num_requests_running gauge
kvflow:num_requests_running 3.0
kvflow:num_requests_waiting 2.0
kvflow:kv_cache_usage_perc 0.25
kvflow:num_requests_running_other 100.0
kvflow:request_success_total{finished_reason="stop"} 7.0
"""
    assert parse_engine_load(text) == (3.0, 2.0, 0.25)
    assert parse_engine_load("kvflow:num_requests_running 1\n") is None  # not a kvflow server's
    assert parse_engine_load("<html>hello</html>") is None


# ---- the flags --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"health_interval_s": 0}, "--health-interval-s"),
        ({"health_interval_s": float("inf")}, "--health-interval-s"),
        ({"load_poll_s": -1}, "--load-poll-s"),
        ({"cache_threshold": 1.5}, "--cache-threshold"),
        ({"cache_threshold": float("nan")}, "--cache-threshold"),
        ({"balance_abs_threshold": -1}, "--balance-abs-threshold"),
        ({"balance_abs_threshold": 2.5}, "--balance-abs-threshold"),
        ({"balance_rel_threshold": 0.5}, "--balance-rel-threshold"),
        ({"cache_max_chars": 0}, "--cache-max-chars"),
    ],
)
def test_config_errors_name_the_flag(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        RouterConfig(backends=URLS[:2], policy="cache_aware", **kwargs)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--cache-threshold", "2"], "--cache-threshold"),
        (["--load-poll-s", "0"], "--load-poll-s"),
        (["--balance-rel-threshold", "0.9"], "--balance-rel-threshold"),
    ],
)
def test_cli_flag_errors(argv, fragment, capsys):
    assert kvflow_main(["router", "--policy", "cache_aware", "--backend", *URLS[:2], *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvflow: error: ") and fragment in err, err


def test_expected_output_tokens():
    from kvflow.router.policies import COMPLETIONS_DEFAULT_MAX_TOKENS, DEFAULT_OUTPUT_TOKENS, OUTPUT_TOKENS_CAP
    from kvflow.router.policies import expected_output_tokens as out

    assert out(COMPLETIONS, {"prompt": "a"}) == COMPLETIONS_DEFAULT_MAX_TOKENS == 16  # OpenAI's default
    assert out(COMPLETIONS, {"prompt": "a", "max_tokens": None}) == DEFAULT_OUTPUT_TOKENS  # up to the context
    assert out(COMPLETIONS, {"prompt": ["a", "b"], "max_tokens": 10, "n": 3}, prompts=2) == 60
    assert out(CHAT, {"max_tokens": 50, "max_completion_tokens": 20}) == 20  # the one the server reads
    assert out(CHAT, {"max_tokens": 10**6}) == OUTPUT_TOKENS_CAP
    assert out(CHAT, {"max_tokens": "many", "n": 0}) == DEFAULT_OUTPUT_TOKENS  # bad values: the defaults
    assert out("/v1/responses", {"max_output_tokens": 7}) == 7
    assert out("/v1/messages", {"max_tokens": 9}) == 9
    assert out("/v1/embeddings", {"input": "a"}) == 0
    assert out("/v1/rerank", {"query": "a", "documents": ["b"]}) == out("/score", {"max_tokens": 9}) == 0
