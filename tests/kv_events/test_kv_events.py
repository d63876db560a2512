"""KV cache events: the wire form (vLLM's msgpack layout), the ZMQ publisher and its replay socket,
the subscriber that follows it, and the engine's stream against the engine's real prefix cache.

The reference for the engine's stream is the engine's own state after the run (its block pool's
cached hashes, its offload tiers' contents), read directly: the events replayed into a plain model
of the cache (hash -> media) must say exactly that, after a random workload that evicts."""

from __future__ import annotations

import asyncio
import random
import re
import time

import msgpack
import pytest

from kvflow import LLM, SamplingParams
from kvflow.config.kv_events import KVEventsConfig, offset_endpoint
from kvflow.core.block_hash import hash_block
from kvflow.kv_events.codec import KVEventDecodeError, decode_batch, encode_batch
from kvflow.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventSink,
)
from kvflow.kv_events.publisher import END_SEQ, ZmqEventPublisher, make_publisher
from kvflow.kv_events.subscriber import KVEventSubscriber, fetch_replay

from conftest import assert_no_leaks


class CacheModel:
    """A model of a publisher's cache built from its events alone: hash -> the media holding it.
    A `KVEventConsumer`; `seqs` records the batches in the order they were applied."""

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict  # a removal of what was never stored fails (a complete stream)
        self.next_seq: int | None = None
        self.held: dict[bytes, set[str]] = {}
        self.seqs: list[int] = []

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                self.held.clear()
            elif isinstance(e, BlockStored):
                for h in e.block_hashes:
                    self.held.setdefault(h, set()).add(e.medium)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    media = self.held.get(h, set())
                    assert e.medium in media or not self.strict, "a block removed from a medium it was never in"
                    media.discard(e.medium)
                    if not media:
                        self.held.pop(h, None)
        self.seqs.append(seq)
        self.next_seq = seq + 1

    def reset(self) -> None:
        self.held.clear()
        self.next_seq = None


def _h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _batches(n: int, start: int = 0) -> list[KVEventBatch]:
    """n batches: batch k stores block k (chained to k - 1) and removes block k - 3."""
    out = []
    for k in range(start, start + n):
        events = [BlockStored([_h(k)], _h(k - 1) if k else None, list(range(k, k + 4)), 4)]
        if k >= 3:
            events.append(BlockRemoved([_h(k - 3)], "GPU"))
        out.append(KVEventBatch(1000.0 + k, events))
    return out


def _model_of(batches: list[KVEventBatch]) -> dict[bytes, set[str]]:
    m = CacheModel()
    for i, b in enumerate(batches):
        m.apply(i, b)
    return m.held


# ---- the wire form ----------------------------------------------------------------------------------------
def test_codec_round_trip_and_vllm_layout():
    batch = KVEventBatch(
        12.5,
        [
            AllBlocksCleared(),
            BlockStored([_h(1), _h(2)], None, list(range(8)), 4, "GPU"),
            BlockStored([_h(3)], None, [], 4, "CPU"),
            BlockRemoved([_h(1)], "GPU"),
        ],
    )
    payload = encode_batch(batch)
    assert decode_batch(payload) == batch
    raw = msgpack.unpackb(payload, raw=False)
    # vLLM's layout: [ts, events]; each event a map tagged by "type", hashes as binaries
    assert raw[0] == 12.5 and len(raw) == 2
    assert raw[1][0] == {"type": "AllBlocksCleared"}
    assert raw[1][1] == {
        "type": "BlockStored",
        "block_hashes": [_h(1), _h(2)],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert raw[1][3] == {"type": "BlockRemoved", "block_hashes": [_h(1)], "medium": "GPU"}
    batch.data_parallel_rank = 1
    assert msgpack.unpackb(encode_batch(batch), raw=False)[2] == 1


def test_codec_reads_vllm_positional_events_and_skips_unknown_types():
    legacy = msgpack.packb(
        [
            3.0,
            [
                ["BlockStored", [7, 8], 6, [1, 2, 3, 4], 2, None, "gpu"],
                ["BlockRemoved", [7]],  # before vLLM had media
                ["SomethingNew", 1, 2],
                {"type": "AllBlocksCleared"},
            ],
        ]
    )
    got = decode_batch(legacy)
    assert got.events == [BlockStored([7, 8], 6, [1, 2, 3, 4], 2, "GPU"), BlockRemoved([7], "GPU"), AllBlocksCleared()]
    as_map = msgpack.packb({"ts": 1.0, "events": [{"type": "BlockRemoved", "block_hashes": [b"x"], "medium": "CPU"}]})
    assert decode_batch(as_map).events == [BlockRemoved([b"x"], "CPU")]
    for bad in (b"\xc1", msgpack.packb({"ts": "now"}), msgpack.packb([1.0, [{"type": "BlockStored"}]])):
        with pytest.raises(KVEventDecodeError):
            decode_batch(bad)


def test_sink_merges_what_carries_no_chain():
    sink = KVEventSink()
    sink.removed([_h(1)], "GPU")
    sink.removed([_h(2)], "GPU")
    sink.stored_in_tier(_h(1), 4, "CPU")
    sink.stored_in_tier(_h(2), 4, "CPU")
    sink.stored([_h(3)], None, [1, 2, 3, 4], 4)
    sink.stored([_h(4)], _h(3), [5, 6, 7, 8], 4)  # chains stay one event per run
    assert sink.take() == [
        BlockRemoved([_h(1), _h(2)], "GPU"),
        BlockStored([_h(1), _h(2)], None, [], 4, "CPU"),
        BlockStored([_h(3)], None, [1, 2, 3, 4], 4, "GPU"),
        BlockStored([_h(4)], _h(3), [5, 6, 7, 8], 4, "GPU"),
    ]
    assert len(sink) == 0


def test_config_checks_and_offsets():
    c = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert c.enabled and c.publisher == "zmq" and c.endpoint == "tcp://127.0.0.1:5557"
    assert not KVEventsConfig.parse({}).enabled and KVEventsConfig.parse({}).publisher == "null"
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").enabled
    for bad, fragment in [
        ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher must be one of"),
        ({"endpoint": "localhost:5557"}, "endpoint must be a ZMQ address"),
        ({"buffer_steps": 0}, "buffer_steps must be a positive integer"),
        ({"replay": "tcp://*:1"}, "unknown key(s) ['replay']"),
        ({"endpoint": "tcp://*:1", "replay_endpoint": "tcp://*:1"}, "must differ"),
    ]:
        with pytest.raises(ValueError, match=re.escape(fragment)):
            KVEventsConfig.parse(bad)
    assert (
        offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
        and offset_endpoint("ipc:///tmp/e", 1) == "ipc:///tmp/e_dp1"
    )
    c = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:5557", replay_endpoint="tcp://*:6557")
    assert (c.for_replica(1).endpoint, c.for_replica(1).replay_endpoint) == ("tcp://*:5558", "tcp://*:6558")
    assert not isinstance(make_publisher(KVEventsConfig()), ZmqEventPublisher)


# ---- publisher and subscriber -------------------------------------------------------------------------------
def _publisher(tmp_path, **kw) -> ZmqEventPublisher:
    return ZmqEventPublisher(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", **kw)


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_replay_returns_buffered_batches_from_a_sequence_number(tmp_path):
    pub = _publisher(tmp_path, buffer_steps=5)
    try:
        batches = _batches(8)
        for b in batches:
            pub.publish(b)
        got = fetch_replay(f"ipc://{tmp_path}/replay", 0)  # asked after publish(): includes them all
        assert [s for s, _ in got] == [3, 4, 5, 6, 7]  # only the last buffer_steps are kept
        assert [decode_batch(p) for _, p in got] == batches[3:]
        assert [s for s, _ in fetch_replay(f"ipc://{tmp_path}/replay", 6)] == [6, 7]
        assert fetch_replay(f"ipc://{tmp_path}/replay", 100) == []
    finally:
        pub.shutdown()
    assert END_SEQ == b"\xff" * 8


def test_a_late_subscriber_replays_then_follows_in_order(tmp_path):
    """Batches 0-9 go out before the subscriber exists; it catches up from the replay socket, then
    follows 10-29 live, in order, and ends with the same state as the publisher's whole stream."""
    batches = _batches(30)
    pub = _publisher(tmp_path)
    model = CacheModel()
    stats: dict[str, int] = {}

    async def main() -> None:
        sub = KVEventSubscriber(
            f"ipc://{tmp_path}/pub",
            model,
            f"ipc://{tmp_path}/replay",
            on_stat=lambda k, n: stats.__setitem__(k, stats.get(k, 0) + n),
        )
        task = asyncio.create_task(sub.run())
        try:
            while model.seqs[-1:] != [9]:
                await asyncio.sleep(0.01)
            for b in batches[10:]:
                pub.publish(b)
                await asyncio.sleep(0.005)
            deadline = time.monotonic() + 10
            while model.next_seq != 30:
                assert time.monotonic() < deadline, f"stuck at {model.next_seq}"
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    try:
        for b in batches[:10]:
            pub.publish(b)
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        pub.shutdown()
    # a live batch that raced the catch-up may come by either path, but each is applied once, in order
    assert model.seqs == list(range(30))
    assert model.held == _model_of(batches)
    assert stats["batches"] == 30 and stats.get("lost", 0) == 0 and stats["replays"] >= 1


def test_gaps_are_replayed_restarts_reset_and_lost_batches_counted(tmp_path):
    batches = _batches(12)
    pub = _publisher(tmp_path, buffer_steps=8)
    model = CacheModel(strict=False)  # batches are lost here: removals of blocks it never saw
    stats: dict[str, int] = {}

    async def main() -> None:
        sub = KVEventSubscriber(
            f"ipc://{tmp_path}/pub",
            model,
            f"ipc://{tmp_path}/replay",
            on_stat=lambda k, n: stats.__setitem__(k, stats.get(k, 0) + n),
        )
        try:
            # seen 0..5 live, then batch 9 arrives: 6..8 were missed and come from the replay socket
            for seq in range(6):
                await sub.receive(seq, encode_batch(batches[seq]))
            await sub.receive(9, encode_batch(batches[9]))
            # the replay runs ahead (to 11); 10 and 11 arriving live next are duplicates, skipped
            assert model.seqs == list(range(12)) and stats.get("lost", 0) == 0
            for seq in (9, 10, 11):
                await sub.receive(seq, encode_batch(batches[seq]))
            assert model.seqs == list(range(12)) and "restarts" not in stats
            # the publisher restarted: its numbers go back (another batch 2); the view is reset and
            # rebuilt from what its replay socket keeps (here the old buffer: 4..11; 0..3 are lost)
            model.seqs.clear()
            await sub.receive(2, encode_batch(KVEventBatch(0.5, [AllBlocksCleared()])))
            assert stats["restarts"] == 1 and stats["lost"] == 4
            assert model.seqs == list(range(4, 12)) and model.held == {_h(k): {"GPU"} for k in (9, 10, 11)}
        finally:
            sub.close()

    try:
        for b in batches:
            pub.publish(b)
        _wait(lambda: len(fetch_replay(f"ipc://{tmp_path}/replay", 11)) == 1)
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        pub.shutdown()


def test_a_silent_replay_endpoint_is_given_up_and_counted(tmp_path):
    model = CacheModel(strict=False)
    stats: dict[str, int] = {}

    async def main() -> None:
        sub = KVEventSubscriber(
            f"ipc://{tmp_path}/nobody",
            model,
            f"ipc://{tmp_path}/nobody-replay",
            replay_timeout_s=0.2,
            on_stat=lambda k, n: stats.__setitem__(k, stats.get(k, 0) + n),
        )
        try:
            await sub.receive(5, encode_batch(_batches(1, 5)[0]))  # no replay answers: 0..4 are lost
        finally:
            sub.close()

    asyncio.run(asyncio.wait_for(main(), 10))
    assert model.seqs == [5] and stats["lost"] == 5


def test_a_taken_endpoint_is_a_clear_error():
    from kvflow.utils.processes import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = ZmqEventPublisher(endpoint)
    try:
        with pytest.raises(ValueError, match="cannot bind endpoint tcp://127.0.0.1:"):
            ZmqEventPublisher(endpoint)
    finally:
        pub.shutdown()


# ---- the engine's stream against the engine's cache -------------------------------------------------------------
BS = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def _workload(seed: int, n: int = 40) -> list[list[list[int]]]:
    """Rounds of prompts sharing a few prefixes (hits, first-writer-wins collisions) among fresh
    ones (evictions in a 24-block pool), some rounds several prompts at once (preemptions)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, 500) for _ in range(rng.choice((8, 12, 20)))] for _ in range(4)]
    rounds = []
    for _ in range(n):
        prompts = []
        for _ in range(rng.choice((1, 1, 2, 3))):
            head = rng.choice(prefixes) if rng.random() < 0.6 else []
            prompts.append(head + [rng.randrange(2, 500) for _ in range(rng.randint(1, 18))])
        rounds.append(prompts)
    return rounds


def _engine_cache(llm) -> dict[bytes, set[str]]:
    engine = llm.engine
    held: dict[bytes, set[str]] = {h: {"GPU"} for h in engine.kv_cache.pool.cached}
    worker = engine.executor.kv_connector
    store = getattr(worker, "store", None)
    if store is not None:
        for h in store.cpu:
            held.setdefault(h, set()).add("CPU")
        for h in store.disk:
            held.setdefault(h, set()).add("DISK")
    return held


@pytest.mark.parametrize(
    "tiers",
    [
        {},
        {"kv_offload_cpu_gb": 0.0002},  # a CPU tier smaller than what is evicted: it evicts too
        {"kv_offload_cpu_gb": 0.0001, "kv_offload_disk_gb": 0.0003},  # CPU, then disk
    ],
    ids=["pool", "cpu-tier", "cpu-and-disk-tiers"],
)
def test_event_stream_equals_the_engine_prefix_cache(tiny_llama, tmp_path, tiers):
    opts = dict(tiers)
    if "kv_offload_disk_gb" in opts:
        opts["kv_offload_disk_dir"] = str(tmp_path / "disk")
    llm = LLM(
        tiny_llama[0],
        max_model_len=64,
        block_size=BS,
        num_kv_blocks=24,
        kv_events_config={
            "enable_kv_cache_events": True,
            "endpoint": f"ipc://{tmp_path}/pub",
            "replay_endpoint": f"ipc://{tmp_path}/replay",
        },
        **opts,
    )
    try:
        removed = stored_gpu = 0
        for i, prompts in enumerate(_workload(len(tiers))):
            llm.generate(prompts, PARAMS, use_tqdm=False)
            if i % 10 == 9 or i == 39:  # the stream, replayed from the start, says what the cache holds
                model = CacheModel()
                for seq, payload in fetch_replay(f"ipc://{tmp_path}/replay", 0):
                    model.apply(seq, decode_batch(payload))
                assert model.seqs == list(range(len(model.seqs)))
                assert model.held == _engine_cache(llm)
        for _, payload in fetch_replay(f"ipc://{tmp_path}/replay", 0):
            for e in decode_batch(payload).events:
                removed += isinstance(e, BlockRemoved) and e.medium == "GPU"
                if isinstance(e, BlockStored) and e.medium == "GPU":
                    stored_gpu += 1
                    # a chain: its tokens hash to its hashes, as the engine's own lookup computes them
                    parent = e.parent_block_hash
                    for k, h in enumerate(e.block_hashes):
                        parent = hash_block(parent, e.token_ids[k * BS : (k + 1) * BS])
                        assert parent == h
        assert removed > 0 and stored_gpu > 0  # the pool evicted: the workload tested removals
        if tiers:
            stats = llm.get_stats().kv_offload
            assert stats.cpu.stored > 0 and stats.cpu.evicted > 0
            if "kv_offload_disk_gb" in tiers:
                assert stats.disk.stored > 0
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


def test_events_off_cost_nothing(tiny_llama):
    llm = LLM(tiny_llama[0], max_model_len=64, block_size=BS, num_kv_blocks=24)
    try:
        assert llm.engine.kv_events is None and llm.engine.kv_event_publisher is None
        assert llm.engine.kv_cache.pool.events is None
        llm.generate([list(range(2, 30))], PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
