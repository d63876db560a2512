"""cache_aware's score (expected prefix hit against load) with fake replica states, and its view of
the replicas' caches from KV events with fake event batches: no HTTP, no engine.

The references are the documented rules: the score formula, the engine's own lookup (the longest
run in the pool, then in a tier, one token always left to compute), the engine's hash function."""

from __future__ import annotations

import random

import pytest

from kvflow.core.block_hash import hash_block, prompt_block_hashes
from kvflow.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvflow.router.config import RouterConfig
from kvflow.router.kv_view import PENDING_TTL_S, ReplicaKVView, tokenize_requests
from kvflow.router.policies import Backend, CacheAwarePolicy, RouteRequest, make_policy

URLS = ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BS = 16


def chat(question: str, system: str = "You are a helpful assistant.") -> RouteRequest:
    return RouteRequest(
        CHAT, {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    )


def completion(prompt) -> RouteRequest:
    return RouteRequest(COMPLETIONS, {"prompt": prompt, "max_tokens": 8})


def with_ids(ids: list[int]) -> RouteRequest:
    """A completion whose token ids the router knows (as after a replica's /tokenize)."""
    return RouteRequest(COMPLETIONS, {"prompt": "(text)", "max_tokens": 8}, [ids])


def send(policy, request: RouteRequest, *, finish: bool = False):
    route = policy.route(request)
    route.target.begin(route.work)
    if finish:
        route.target.end(route.work)
    return route


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 30000) for _ in range(n)]


def _stored(ids: list[int], medium: str = "GPU", first: int = 0, last: int | None = None) -> BlockStored:
    """The BlockStored an engine publishes for blocks [first, last) of `ids`."""
    hashes = prompt_block_hashes(ids, BS)
    last = len(hashes) if last is None else last
    parent = hashes[first - 1] if first else None
    if medium != "GPU":
        return BlockStored(hashes[first:last], None, [], BS, medium)
    return BlockStored(hashes[first:last], parent, ids[first * BS : last * BS], BS, medium)


def _apply(view: ReplicaKVView, *events) -> None:
    view.apply(0 if view.next_seq is None else view.next_seq, KVEventBatch(0.0, list(events)))


# ---- balance before affinity ----------------------------------------------------------------------------
def test_a_short_shared_prefix_never_outweighs_an_idle_replica():
    """The issue's case: 32 concurrent chats that share only a short system prompt, over two idle
    replicas: they spread (neither gets more than 60 %; here an even split)."""
    policy = CacheAwarePolicy(URLS)
    for i in range(32):
        send(policy, chat(f"Question {i}: what is {i} times {i + 3}?"))
    counts = sorted(b.inflight for b in policy.backends())
    assert counts == [16, 16], counts


def test_a_long_prefix_goes_to_its_holder_when_loads_are_equal():
    doc = "".join(f"word{i} " for i in range(300))[:2000]  # 2000 characters: 500 tokens
    policy = CacheAwarePolicy(URLS)
    holder = send(policy, completion(doc + " question 0?"), finish=True).target
    other = next(b for b in policy.backends() if b is not holder)
    for load in (0, 3, 10):
        holder.record_scrape(load, 0, 0.0)
        other.record_scrape(load, 0, 0.0)
        assert send(policy, completion(doc + f" question {load}?"), finish=True).target is holder
    # unequal loads: the 500 tokens it saves are worth up to 3 more requests (3 x 128 < 500 < 4 x 128)
    holder.record_scrape(13, 0, 0.0)
    assert send(policy, completion(doc + " q13?"), finish=True).target is holder
    holder.record_scrape(14, 0, 0.0)
    assert send(policy, completion(doc + " q14?"), finish=True).target is other


def test_the_score_is_the_documented_formula():
    rng = random.Random(3)
    for _ in range(50):
        policy = CacheAwarePolicy(URLS, load_cost_tokens=50.0, kv_usage_weight=2.0)
        a, b = policy.backends()
        policy.trees[a].insert("x" * 800)  # a holds 800 characters of the prompt below: 200 tokens
        for r in (a, b):
            r.record_scrape(rng.randrange(0, 8), rng.randrange(0, 3), rng.random())
            r.inflight = r.inflight_at_scrape = 0
        route = policy.route(completion("x" * 800 + "y" * 200))
        want = {}
        for r, saved in ((a, 200.0), (b, 0.0)):
            load = r.engine_load + 2.0 * r.kv_usage
            want[r.url] = (saved, saved - 50.0 * load)
            assert policy.last_scores[r.url] == pytest.approx(want[r.url])
        best = max(want.values(), key=lambda v: v[1])
        if want[a.url][1] != want[b.url][1]:
            assert want[route.target.url] == best
        assert route.cache_hit is (route.target is a)


def test_kv_usage_counts_as_load():
    policy = CacheAwarePolicy(URLS)  # a full pool = 4 requests
    a, b = policy.backends()
    a.record_scrape(2, 0, 0.0)
    b.record_scrape(1, 0, 0.5)  # 1 + 2 = 3 > 2
    assert policy.route(completion("z" * 10)).target is a
    b.record_scrape(1, 0, 0.2)  # 1 + 0.8 < 2
    assert policy.route(completion("z" * 10)).target is b


# ---- routing on KV events ----------------------------------------------------------------------------------
def _events_policy() -> CacheAwarePolicy:
    return CacheAwarePolicy(URLS, kv_events=True)


def test_no_events_yet_no_token_ids():
    policy = _events_policy()
    assert not policy.wants_token_ids(with_ids([1, 2, 3])) and policy.block_size() is None
    _apply(policy.views[policy.backends()[0]], _stored(_tokens(0, 40)))
    assert policy.wants_token_ids(with_ids([1, 2, 3])) and policy.block_size() == BS


def test_routes_to_the_replica_that_holds_the_prompt_after_an_eviction_the_router_never_saw():
    policy = _events_policy()
    a, b = policy.backends()
    prompt = _tokens(1, 10 * BS + 5)
    _apply(policy.views[a], _stored(prompt))
    first = policy.route(with_ids(prompt))
    assert first.target is a and first.cache_hit and first.match_ratio == pytest.approx(160 / 165)
    # a evicts it (other clients' requests did), b computes it (a request sent to it directly)
    _apply(policy.views[a], BlockRemoved(prompt_block_hashes(prompt, BS)[3:], "GPU"))
    _apply(policy.views[b], _stored(prompt))
    again = policy.route(with_ids(prompt))
    assert again.target is b and again.cache_hit  # a's prefix tree still says a: the events know better
    assert policy.last_scores[a.url][0] == 3 * BS and policy.last_scores[b.url][0] == 10 * BS


def test_a_burst_follows_blocks_routed_but_not_reported_yet():
    policy = _events_policy()
    _, b = policy.backends()
    _apply(policy.views[b], _stored(_tokens(9, 2 * BS)))  # events say only the block size so far
    doc = _tokens(2, 20 * BS)
    first = send(policy, with_ids(doc + [7, 8]))
    # no event yet, but the doc's blocks are pending where it went: the next ones follow it while
    # that saves more than their load costs
    for i in range(2):
        route = send(policy, with_ids(doc + [9, i]))
        assert route.target is first.target and route.cache_hit
    view = policy.views[first.target]
    hashes = prompt_block_hashes(doc, BS)
    assert view.matched_blocks(hashes) == 20
    assert view.matched_blocks(hashes, now=view.pending[hashes[0]] + 1) == 0  # pending expires
    assert PENDING_TTL_S > 0
    _apply(view, _stored(doc))  # reported: held, no longer pending
    assert hashes[0] not in view.pending and view.matched_blocks(hashes, now=1e12) == 20


def _sized_policy(**kw) -> tuple[CacheAwarePolicy, Backend, Backend]:
    """An events policy whose replicas both told the block size (so queues are sized)."""
    policy = CacheAwarePolicy(URLS, kv_events=True, **kw)
    a, b = policy.backends()
    for r, seed in ((a, 90), (b, 91)):
        _apply(policy.views[r], _stored(_tokens(seed, BS)))
    return policy, a, b


def test_with_events_a_queue_of_cache_hits_keeps_the_prefix_where_counting_would_spill():
    """12 requests in flight on the holder of a 1,024-token prefix, each computing its 20-token
    question and generating 32 tokens: 12 x 128 counted requests would outweigh the prefix (the
    count-based score sends the 13th elsewhere, to compute the prefix again); sized, the queue is
    12 x (one pending question block + 4 tail tokens + 32 output) = 12 x 52 tokens, and it stays."""
    policy, holder, other = _sized_policy()
    doc = _tokens(10, 64 * BS)
    _apply(policy.views[holder], _stored(doc))
    for i in range(13):
        question = _tokens(100 + i, 20)
        route = send(policy, RouteRequest(COMPLETIONS, {"prompt": "(text)", "max_tokens": 32}, [doc + question]))
        assert route.target is holder and route.cache_hit
        assert route.work == 4 + 32  # the tail after its 65 full blocks, and its output
    assert holder.inflight == 13 and holder.inflight_work == 13 * 36
    assert policy.views[holder].pending_blocks() == 13  # each question's one full block
    counted = CacheAwarePolicy(URLS)  # the same state without events: 12 requests x 128 > 1,024
    c_holder, c_other = counted.backends()
    c_holder.inflight = 12
    assert counted.queued(c_holder, None) - counted.queued(c_other, None) == 12 * 128 > len(doc)
    # a queue of uncached prompts is real work: two unrelated 600-token prompts pending on the holder
    # (2 x 37 blocks) outweigh what the prefix saves
    for seed in (200, 201):
        policy.views[holder].note_routed(prompt_block_hashes(_tokens(seed, 600), BS))
    route = send(policy, RouteRequest(COMPLETIONS, {"prompt": "(text)", "max_tokens": 32}, [doc + _tokens(99, 20)]))
    assert route.target is other and not route.cache_hit


def test_with_events_the_score_is_the_documented_formula():
    """Random replica states (held and pending blocks, in-flight work, scraped loads, KV use) against
    the class's formula, recomputed here from those states."""
    rng = random.Random(7)
    checked = 0
    for trial in range(40):
        policy, a, b = _sized_policy(load_cost_tokens=rng.choice([64.0, 128.0]), kv_usage_weight=rng.random() * 4)
        prompt = _tokens(trial, rng.randrange(1, 12) * BS + rng.randrange(BS))
        hashes = prompt_block_hashes(prompt, BS)
        pending: dict[Backend, set] = {}
        for r in (a, b):
            held = rng.randrange(len(hashes) + 1)
            if held:
                _apply(policy.views[r], _stored(prompt, last=held))
            others = [prompt_block_hashes(_tokens(1000 * trial + k, rng.randrange(BS, 8 * BS)), BS) for k in range(3)]
            mine = hashes[held : held + rng.randrange(3)]  # some of the request's own blocks pending too
            for h in [*others[: rng.randrange(4)], mine]:
                policy.views[r].note_routed(h)
            pending[r] = {h for o in others for h in o if h in policy.views[r].pending} | set(mine)
            r.record_scrape(rng.randrange(0, 6), rng.randrange(0, 3), rng.random())
            r.inflight = r.inflight_at_scrape = rng.randrange(0, 4)
            r.inflight_work = rng.random() * 500
        want = {}
        for r in (a, b):
            run = 0  # the engine's lookup: the run held or pending, the last token left to compute
            for h in hashes[: (len(prompt) - 1) // BS]:
                if h in policy.views[r].media["GPU"] or h in pending[r]:
                    run += 1
                else:
                    break
            other = max(r.inflight, r.engine_load) - r.inflight
            queued = (
                len(pending[r] - set(hashes)) * BS
                + r.inflight_work
                + policy.load_cost_tokens * (other + policy.kv_usage_weight * r.kv_usage)
            )
            want[r.url] = (run * BS, run * BS - queued)
        saved_any = any(v[0] for v in want.values())
        policy.route(RouteRequest(COMPLETIONS, {"prompt": "(text)", "max_tokens": 8}, [prompt]))
        checked += saved_any
        if saved_any:  # (nothing held anywhere: the text estimate decides saved, as documented)
            for url, (saved, score) in want.items():
                assert policy.last_scores[url] == pytest.approx((saved, score)), (trial, url)
    assert checked >= 20


def test_a_prefix_nobody_holds_stays_where_it_was_sent_before():
    policy = _events_policy()
    a, b = policy.backends()
    text = "You are a terse assistant who answers in French. " * 8  # ~100 tokens of text
    doc = _tokens(3, 12 * BS)
    # sent before any event told the block size: routed by its text (the first candidate wins the tie)
    first = send(policy, RouteRequest(COMPLETIONS, {"prompt": text + "Q1", "max_tokens": 8}), finish=True)
    other = b if first.target is a else a
    _apply(policy.views[other], _stored(_tokens(9, 2 * BS)))  # now the block size is known
    # the events show the prompt nowhere (still queued where it went): its text's home decides
    again = send(policy, RouteRequest(COMPLETIONS, {"prompt": text + "Q2", "max_tokens": 8}, [doc]), finish=True)
    assert again.target is first.target and again.cache_hit
    assert policy.last_scores[other.url][0] == 0
    # a prompt of the same text held by the other replica (as its events say): the events decide,
    # whatever the text says
    held = _tokens(4, 12 * BS)
    _apply(policy.views[other], _stored(held))
    third = send(policy, RouteRequest(COMPLETIONS, {"prompt": text + "Q3", "max_tokens": 8}, [held]), finish=True)
    assert third.target is other and policy.last_scores[first.target.url][0] == 0


def test_lookup_is_the_engines_pool_run_then_tier_run_leaving_one_token():
    view = ReplicaKVView()
    ids = _tokens(4, 8 * BS)
    hashes = prompt_block_hashes(ids, BS)
    _apply(view, _stored(ids, "GPU", 0, 3), _stored(ids, "CPU", 3, 5), _stored(ids, "DISK", 5, 6))
    assert view.matched_blocks(hashes) == 6
    # block 1 evicted to the CPU tier: the pool's run is block 0, the tier's run after it block 1;
    # block 2, in the pool only, is not looked up there (the engine's connector looks in its tiers)
    _apply(view, BlockRemoved([hashes[1]], "GPU"), _stored(ids, "CPU", 1, 2))
    assert view.matched_blocks(hashes) == 2
    _apply(view, _stored(ids, "DISK", 2, 3))
    assert view.matched_blocks(hashes) == 6
    policy = _events_policy()
    a, _ = policy.backends()
    _apply(policy.views[a], _stored(ids))
    policy.route(with_ids(ids))  # 128 tokens: the engine looks up 7 blocks, leaving the last token
    assert policy.last_scores[a.url][0] == 7 * BS
    policy.route(with_ids(ids + [5]))
    assert policy.last_scores[a.url][0] == 8 * BS


def test_all_blocks_cleared_and_unhealthy_reset_the_view():
    policy = _events_policy()
    a, _ = policy.backends()
    ids = _tokens(5, 4 * BS)
    _apply(policy.views[a], _stored(ids))
    _apply(policy.views[a], AllBlocksCleared())
    assert policy.views[a].num_blocks("GPU") == 0 and policy.views[a].next_seq == 2
    _apply(policy.views[a], _stored(ids))
    policy.set_healthy(a, False)
    assert policy.views[a].num_blocks("GPU") == 0 and policy.views[a].next_seq is None


def test_a_stream_hashed_otherwise_is_not_used():
    """vLLM's 64-bit integer hashes (or any hashing but the router's): routing falls back to text."""
    policy = _events_policy()
    a, _ = policy.backends()
    _apply(policy.views[a], BlockStored([123, 456], None, list(range(2 * BS)), BS, "GPU"))
    assert policy.views[a].compatible is False and not policy.wants_token_ids(with_ids([1]))
    view = ReplicaKVView()
    ids = _tokens(6, 3 * BS)
    _apply(view, _stored(ids, first=1))  # a chain that starts after its parent: checked from the parent
    assert view.compatible is True
    assert _stored(ids).block_hashes[0] == hash_block(None, ids[:BS])


# ---- the token ids of a request ------------------------------------------------------------------------
def test_tokenize_requests():
    msgs = [{"role": "user", "content": "hi"}]
    assert tokenize_requests(CHAT, {"model": "m", "messages": msgs}) == [
        {"model": "m", "messages": msgs, "add_generation_prompt": True}
    ]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tokenize_requests(CHAT, {"messages": msgs, "tools": tools}) is None  # the server renders them
    assert tokenize_requests(CHAT, {"messages": msgs, "tools": tools, "tool_choice": "none"}) is not None
    assert tokenize_requests(CHAT, {"messages": []}) is None
    assert tokenize_requests(COMPLETIONS, {"prompt": "abc", "add_special_tokens": False}) == [
        {"model": None, "prompt": "abc", "add_special_tokens": False}
    ]
    assert tokenize_requests(COMPLETIONS, {"prompt": [1, 2, 3]}) == [[1, 2, 3]]
    assert tokenize_requests(COMPLETIONS, {"prompt": ["a", [4, 5]]}) == [
        {"model": None, "prompt": "a", "add_special_tokens": True},
        [4, 5],
    ]
    for bad in (
        {"prompt": [True]},
        {"prompt": [[1], None]},
        {"prompt": None},
        {"prompt": "a", "add_special_tokens": 1},
    ):
        assert tokenize_requests(COMPLETIONS, bad) is None


def test_config_of_the_router_flags():
    c = RouterConfig(
        backends=URLS,
        policy="cache_aware",
        router_kv_events=["tcp://h1:5557,tcp://h1:5558", "ipc:///tmp/x"],
        load_cost_tokens=64,
        kv_usage_weight=0,
    )
    assert c.kv_event_endpoints() == [("tcp://h1:5557", "tcp://h1:5558"), ("ipc:///tmp/x", None)]
    p = make_policy(c.policy, c.policy_options())
    assert p.views is not None and (p.load_cost_tokens, p.kv_usage_weight, p.threshold) == (64, 0, 0.0)
    for kwargs, fragment in [
        ({"router_kv_events": ["tcp://h:1"]}, "one address per --backend"),
        ({"router_kv_events": ["h:1", "h:2"]}, "is not PUB or PUB,REPLAY"),
        ({"router_kv_events": ["tcp://a:1", "tcp://b:1"], "policy": "least_loaded"}, "is for --policy cache_aware"),
        ({"load_cost_tokens": -1}, "--load-cost-tokens"),
        ({"kv_usage_weight": float("nan")}, "--kv-usage-weight"),
    ]:
        with pytest.raises(ValueError, match=fragment.replace("+", r"\+")):
            RouterConfig(**{"backends": URLS, "policy": "cache_aware", **kwargs})


# ---- kvflow serve --data-parallel-size N --router-kv-events ---------------------------------------------------
def test_replicas_get_their_own_event_ports(tmp_path):
    import json

    from kvflow.config import EngineConfig, ServerConfig
    from kvflow.config.kv_events import KVEventsConfig
    from kvflow.router.data_parallel import replica_kv_events, replica_specs, subscriber_spec

    follow = ServerConfig(data_parallel_size=2, router_kv_events=True)
    made = replica_kv_events(2, EngineConfig(), follow)  # no --kv-events-config: free loopback ports
    assert all(c.enabled and c.endpoint.startswith("tcp://127.0.0.1:") and c.replay_endpoint for c in made)
    assert len({c.endpoint for c in made} | {c.replay_endpoint for c in made}) == 4
    assert subscriber_spec(made[0], "127.0.0.1") == f"{made[0].endpoint},{made[0].replay_endpoint}"
    given = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5657"}
    configs = replica_kv_events(2, EngineConfig(kv_events_config=given), follow)
    assert [(c.endpoint, c.replay_endpoint) for c in configs] == [
        ("tcp://*:5557", "tcp://*:5657"),
        ("tcp://*:5558", "tcp://*:5658"),
    ]
    assert subscriber_spec(configs[1], "127.0.0.1") == "tcp://127.0.0.1:5558,tcp://127.0.0.1:5658"
    # without --router-kv-events the replicas still publish, each on its own ports
    assert replica_kv_events(2, EngineConfig(kv_events_config=given), ServerConfig(data_parallel_size=2)) == configs
    assert replica_kv_events(2, EngineConfig(), ServerConfig(data_parallel_size=2)) == []
    specs = replica_specs(2, [], str(tmp_path), kv_events_configs=[c.to_dict() for c in configs], pin=False)
    for spec, c in zip(specs, configs):
        argv = spec.argv
        assert KVEventsConfig.parse(json.loads(argv[argv.index("--kv-events-config") + 1])) == c
    for engine, server, fragment in [
        ({**given, "replay_endpoint": "tcp://*:5558"}, follow, "space the two ports at least 2 apart"),
        ({"enable_kv_cache_events": False}, follow, "turns them off"),
        ({}, ServerConfig(data_parallel_size=2, router_kv_events=True, data_parallel_backend="ray"), "ray"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            replica_kv_events(2, EngineConfig(kv_events_config=engine or None), server)
    with pytest.raises(ValueError, match="data_parallel_size > 1"):
        ServerConfig(router_kv_events=True)
    with pytest.raises(ValueError, match="router_policy cache_aware"):
        ServerConfig(data_parallel_size=2, router_kv_events=True, router_policy="round_robin")


def test_router_cli_flags(capsys):
    from kvflow.cli.main import build_parser, main
    from kvflow.cli.router import config_from_args

    args = build_parser().parse_args(
        ["router", "--policy", "cache_aware", "--backend", *URLS, "--load-cost-tokens", "64"]
        + ["--kv-usage-weight", "1", "--router-kv-events", "tcp://a:1,tcp://a:2", "tcp://b:1"]
    )
    c = config_from_args(args)
    assert (c.load_cost_tokens, c.kv_usage_weight) == (64, 1)
    assert c.kv_event_endpoints() == [("tcp://a:1", "tcp://a:2"), ("tcp://b:1", None)]
    assert main(["router", "--policy", "cache_aware", "--backend", *URLS, "--router-kv-events", "tcp://a:1"]) == 2
    assert "one address per --backend" in capsys.readouterr().err
