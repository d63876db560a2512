"""Prefill/decode disaggregation: a producer engine's prompt KV, fetched by a consumer engine over
loopback, gives the same greedy tokens (and logprobs) as one engine; faults end in recompute (or a
clean error), and neither engine leaks a block."""

from __future__ import annotations

import random
import socket
import time

import pytest

from kvflow import LLM, SamplingParams
from kvflow.config import KVTransferConfig
from kvflow.kv_transfer import pd

from conftest import assert_no_leaks, assert_same_completions

BS = 4
PARAMS = dict(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(n)]


SHARED = _ids(1, 13)
PROMPTS = [SHARED + _ids(10, 9), SHARED + _ids(11, 3), _ids(12, 8), _ids(13, 2)]  # the last: under one block


def _engine(path, role=None, kv_cache_dtype="auto", connector="tcp", **kv):
    cfg = None if role is None else {"kv_connector": connector, "kv_role": role, **kv}
    return LLM(
        path, max_model_len=64, block_size=BS, num_kv_blocks=48, kv_cache_dtype=kv_cache_dtype, kv_transfer_config=cfg
    )


def _prefill(producer: LLM, prompt: list[int]) -> dict | None:
    out = producer.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
        use_tqdm=False,
    )[0]
    return out.kv_transfer_params


def _decode(consumer: LLM, prompt: list[int], params: dict | None):
    return consumer.generate([prompt], SamplingParams(**PARAMS, kv_transfer_params=params), use_tqdm=False)[0]


def _drain(llm: LLM, timeout: float = 10.0) -> None:
    """Step an idle engine until its KV transfers are settled (releases arrive on another thread)."""
    deadline = time.monotonic() + timeout
    while llm.engine.has_pending_kv_transfers():
        assert time.monotonic() < deadline, "KV transfers never settled"
        llm.engine.step()
        time.sleep(0.005)


def _assert_same(out, ref) -> None:
    assert_same_completions(out.outputs, ref.outputs)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    refs = {}
    for dtype in ("auto", "int8"):
        llm = _engine(tiny_llama[0], kv_cache_dtype=dtype)
        refs[dtype] = [_decode(llm, p, None) for p in PROMPTS]
    return refs


@pytest.mark.parametrize("connector,kv_cache_dtype", [("tcp", "auto"), ("shm", "auto"), ("tcp", "int8")])
def test_outputs_identical_to_one_engine(tiny_llama, reference, connector, kv_cache_dtype):
    producer = _engine(tiny_llama[0], "kv_producer", kv_cache_dtype, connector)
    consumer = _engine(tiny_llama[0], "kv_consumer", kv_cache_dtype, connector)
    for prompt, ref in zip(PROMPTS, reference[kv_cache_dtype]):
        params = _prefill(producer, prompt)
        if len(prompt) < BS:
            assert params is None  # nothing whole to hand over: the decode engine computes it
        else:
            assert params["remote_num_blocks"] == len(prompt) // BS
        out = _decode(consumer, prompt, params)
        _assert_same(out, ref)
        # Everything but the tail came from the producer or the consumer's own prefix cache.
        assert out.num_cached_tokens == (len(prompt) - 1) // BS * BS
    _drain(producer)
    sent, got = producer.get_stats().kv_transfer, consumer.get_stats().kv_transfer
    # The second prompt's blocks were all on the consumer already (shared with the first): not
    # fetched, released at once; each fetch leaves the last token to the consumer.
    assert got.blocks_received == sent.blocks_sent == 5 + 0 + 1
    assert got.transfers_received == sent.transfers_sent == 2 and not got.failures and sent.leases_expired == 0
    assert got.bytes_received == sent.bytes_sent > 0
    for llm in (producer, consumer):
        assert_no_leaks(llm.engine)
        llm.shutdown()


def test_a_routed_model_hands_over_its_kv(model_factory):
    """A Mixture-of-Experts model (Qwen2-MoE, shared expert included): its attention KV moves as a
    dense model's does, and the decode engine's tokens and logprobs are one engine's."""
    path, _ = model_factory("qwen2_moe")
    one = _engine(path)
    reference = [_decode(one, p, None) for p in PROMPTS]
    producer, consumer = _engine(path, "kv_producer"), _engine(path, "kv_consumer")
    for prompt, ref in zip(PROMPTS, reference):
        out = _decode(consumer, prompt, _prefill(producer, prompt))
        _assert_same(out, ref)
        assert out.num_cached_tokens == (len(prompt) - 1) // BS * BS
    _drain(producer)
    assert consumer.get_stats().kv_transfer.blocks_received == 6
    for llm in (producer, consumer):
        assert_no_leaks(llm.engine)
        llm.shutdown()


@pytest.mark.server
@pytest.mark.parametrize("producer_tp,consumer_tp", [(2, 1), (1, 2)])
def test_tensor_parallel_producer_or_consumer(tiny_llama, reference, producer_tp, consumer_tp):
    """A TP = 2 engine on either side: the producer's held blocks are gathered from both ranks when
    the hold begins (its block server never starts a collective), the consumer scatters fetched
    blocks to both; a block travels in one rank's layout, so TP sizes may differ."""

    def engine(role, tp):
        return LLM(
            tiny_llama[0],
            max_model_len=64,
            block_size=BS,
            num_kv_blocks=48,
            tensor_parallel_size=tp,
            kv_transfer_config={"kv_connector": "tcp", "kv_role": role},
        )

    producer, consumer = engine("kv_producer", producer_tp), engine("kv_consumer", consumer_tp)
    try:
        for prompt, ref in list(zip(PROMPTS, reference["auto"]))[:3]:
            out = _decode(consumer, prompt, _prefill(producer, prompt))
            _assert_same(out, ref)
            assert out.num_cached_tokens == (len(prompt) - 1) // BS * BS
        _drain(producer)
        sent, got = producer.get_stats().kv_transfer, consumer.get_stats().kv_transfer
        assert got.blocks_received == sent.blocks_sent > 0 and not got.failures
        for llm in (producer, consumer):
            assert_no_leaks(llm.engine)
    finally:
        producer.shutdown()
        consumer.shutdown()


def _faulty_send(monkeypatch, fault: str, **kw):
    """Replace the producer's frame sender: the payload is cut short (the producer dies
    mid-transfer), corrupted after its checksum was taken, or delayed."""
    real = pd.send_frame

    def send(sock, header, payload=b""):
        if not payload:
            return real(sock, header, payload)
        if fault == "die":
            real(sock, header, bytes(payload)[: len(payload) // 2])
            sock.close()
            raise OSError("producer killed")
        if fault == "corrupt":
            data = bytearray(payload)
            data[len(data) // 3] ^= 0x40
            return real(sock, header, data)
        time.sleep(kw["delay"])
        return real(sock, header, payload)

    monkeypatch.setattr(pd, "send_frame", send)


@pytest.mark.parametrize("fault,reason", [("die", "connection"), ("corrupt", "checksum")])
def test_faults_are_recomputed(tiny_llama, reference, monkeypatch, fault, reason):
    producer = _engine(tiny_llama[0], "kv_producer", kv_lease_s=0.5)
    consumer = _engine(tiny_llama[0], "kv_consumer")
    params = _prefill(producer, PROMPTS[0])
    _faulty_send(monkeypatch, fault)
    out = _decode(consumer, PROMPTS[0], params)
    _assert_same(out, reference["auto"][0])
    assert out.num_cached_tokens == 0  # recomputed
    assert consumer.get_stats().kv_transfer.failures == {reason: 1}
    _drain(producer)  # the release never came: the lease frees the blocks
    assert producer.get_stats().kv_transfer.leases_expired == (1 if fault == "die" else 0)
    for llm in (producer, consumer):
        assert_no_leaks(llm.engine)
        llm.shutdown()


def test_lease_expiry_then_late_consumer(tiny_llama, reference):
    producer = _engine(tiny_llama[0], "kv_producer", kv_lease_s=0.2)
    consumer = _engine(tiny_llama[0], "kv_consumer")
    params = _prefill(producer, PROMPTS[0])
    assert producer.engine.kv_cache.pool.num_free_blocks < 48  # held for the consumer
    time.sleep(0.3)
    _drain(producer)
    assert producer.get_stats().kv_transfer.leases_expired == 1
    assert_no_leaks(producer.engine)
    out = _decode(consumer, PROMPTS[0], params)  # the producer no longer knows the transfer
    _assert_same(out, reference["auto"][0])
    assert consumer.get_stats().kv_transfer.failures == {"refused": 1}
    for llm in (producer, consumer):
        assert_no_leaks(llm.engine)
        llm.shutdown()


def test_dead_producer_under_fail_policy(tiny_llama):
    producer = _engine(tiny_llama[0], "kv_producer")
    consumer = _engine(tiny_llama[0], "kv_consumer", kv_load_failure_policy="fail", kv_transfer_timeout_s=2.0)
    params = _prefill(producer, PROMPTS[0])
    producer.shutdown()  # its listener is gone: connection refused
    out = _decode(consumer, PROMPTS[0], params)
    assert out.outputs[0].finish_reason == "error"
    assert "KV transfer failed (connection)" in out.error
    assert_no_leaks(consumer.engine)
    consumer.shutdown()


def test_other_prompt_is_not_loaded(tiny_llama, reference):
    """Params from another prompt: the chained hashes differ, nothing is loaded, all recomputed."""
    producer = _engine(tiny_llama[0], "kv_producer")
    consumer = _engine(tiny_llama[0], "kv_consumer")
    params = _prefill(producer, PROMPTS[2])
    out = _decode(consumer, PROMPTS[0], params)
    _assert_same(out, reference["auto"][0])
    assert consumer.get_stats().kv_transfer.failures == {"prefix_mismatch": 1}
    _drain(producer)  # released (the consumer read the manifest and said so) or by lease
    for llm in (producer, consumer):
        assert_no_leaks(llm.engine)
        llm.shutdown()


def test_abort_while_fetching(tiny_llama, monkeypatch):
    producer = _engine(tiny_llama[0], "kv_producer")
    consumer = _engine(tiny_llama[0], "kv_consumer")
    params = _prefill(producer, PROMPTS[0])
    _faulty_send(monkeypatch, "delay", delay=0.3)
    engine = consumer.engine
    engine.add_request("r", PROMPTS[0], SamplingParams(**PARAMS, kv_transfer_params=params))
    engine.step()
    assert engine.scheduler.waiting_for_kv  # admitted to the fetch, holding its blocks
    engine.abort("r")
    time.sleep(0.5)  # the fetch lands after the abort: its bytes must go nowhere
    _drain(consumer)
    _drain(producer)
    for llm in (producer, consumer):
        assert_no_leaks(llm.engine)
        llm.shutdown()


def test_bad_requests_and_config(tiny_llama):
    consumer = _engine(tiny_llama[0], "kv_consumer")
    plain = _engine(tiny_llama[0])
    good = {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "remote_transfer_id": "x",
        "remote_num_blocks": 2,
        "remote_block_size": BS,
    }
    with pytest.raises(ValueError, match="remote_port must be in"):
        consumer.engine.add_request("a", PROMPTS[0], SamplingParams(kv_transfer_params={**good, "remote_port": 0}))
    with pytest.raises(ValueError, match="remote_host must be a str"):
        consumer.engine.add_request("a", PROMPTS[0], SamplingParams(kv_transfer_params={**good, "remote_host": 5}))
    with pytest.raises(ValueError, match="not a KV producer"):
        consumer.engine.add_request("a", PROMPTS[0], SamplingParams(kv_transfer_params={"do_remote_decode": True}))
    with pytest.raises(ValueError, match="no --kv-transfer-config"):
        plain.engine.add_request("a", PROMPTS[0], SamplingParams(kv_transfer_params=good))
    with pytest.raises(ValueError, match="needs n=1"):
        SamplingParams(n=2, kv_transfer_params={"do_remote_decode": True})
    with pytest.raises(ValueError, match="unknown key"):
        KVTransferConfig.parse({"kv_connector": "tcp", "kv_role": "kv_producer", "kv_buffer": 1})
    with pytest.raises(ValueError, match="kv_role must be one of"):
        KVTransferConfig.parse('{"kv_connector": "tcp", "kv_role": "producer"}')
    with pytest.raises(ValueError, match="kv_connector must be one of"):
        KVTransferConfig.parse({"kv_connector": "nixl", "kv_role": "kv_producer"})
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        LLM(
            tiny_llama[0],
            max_model_len=64,
            enable_prefix_caching=False,
            kv_transfer_config={"kv_connector": "tcp", "kv_role": "kv_both"},
        )
    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(ValueError, match="cannot listen on 127.0.0.1"):
            _engine(tiny_llama[0], "kv_producer", kv_port=taken.getsockname()[1])
    for llm in (consumer, plain):
        assert_no_leaks(llm.engine)
        llm.shutdown()
