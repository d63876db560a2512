"""The engine's side of the KV event stream: a ZMQ PUB socket and, optionally, a ROUTER socket
that replays recent batches, as vLLM's `ZmqEventPublisher` does (same frames, so vLLM's
subscribers work unchanged).

- Every batch goes out as three frames `[topic, seq, payload]`: the configured topic, the batch's
  sequence number (8 bytes, big-endian, from 0, +1 per batch), the msgpack payload (`codec`).
- The last `buffer_steps` batches are kept. A replay request on the ROUTER socket is a DEALER's
  (or REQ's) `[b"", start_seq]` (8 bytes, big-endian); the answer is one `[b"", seq, payload]`
  message per kept batch with seq >= start_seq, in order, then `[b"", -1 (8 bytes, signed), b""]`.

The engine thread only queues the batch (`publish`, never blocking; a full queue drops the batch,
which subscribers see as a gap in the sequence numbers); a daemon thread encodes, sends and answers
replays, and owns both sockets. Sequence numbers are given in `publish`, so a dropped batch is a
visible gap, never a silent one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Protocol

from kvflow.config.kv_events import KVEventsConfig
from kvflow.kv_events.events import KVEventBatch

logger = logging.getLogger("kvflow")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last message
_POLL_S = 0.02  # idle wait of the publisher thread: how long a replay request may wait for it


class KVEventPublisher(Protocol):
    def publish(self, batch: KVEventBatch) -> None:
        """Send `batch` (in order, after every batch published before it); never blocks."""

    def shutdown(self) -> None:
        """Send what is queued (bounded wait), then close. Idempotent."""


class NullEventPublisher:
    def publish(self, batch: KVEventBatch) -> None:
        pass

    def shutdown(self) -> None:
        pass


class ZmqEventPublisher:
    """PUB (+ ROUTER replay) sockets bound at `endpoint` (and `replay_endpoint`); see the module."""

    SHUTDOWN_TIMEOUT_S = 2.0

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
    ) -> None:
        import zmq

        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._topic = topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            self._bind(self._pub, endpoint, "endpoint")
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._bind(self._replay, replay_endpoint, "replay_endpoint")
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._dropped = 0
        self._closed = False
        # The sockets were made on this thread; from here on only the publisher thread uses them
        # (Thread.start is the memory barrier ZMQ asks for when a socket changes threads).
        self._thread = threading.Thread(target=self._run, name="kvflow-kv-events", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: KVEventsConfig) -> ZmqEventPublisher:
        return cls(
            config.endpoint,
            config.replay_endpoint,
            config.buffer_steps,
            config.hwm,
            config.max_queue_size,
            config.topic,
        )

    @staticmethod
    def _bind(sock, endpoint: str, name: str) -> None:
        import zmq

        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            raise ValueError(f"kv_events_config: cannot bind {name} {endpoint} ({e})") from None

    # ---- the engine thread ----------------------------------------------------------------------
    def publish(self, batch: KVEventBatch) -> None:
        if self._closed:
            raise RuntimeError("the KV event publisher is shut down")
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 1000 == 0:
                logger.warning(
                    "KV events: the publisher queue is full (%d batches): dropped batch %d (%d so far); "
                    "subscribers see a gap",
                    self._queue.maxsize,
                    seq,
                    self._dropped,
                )

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT_S)
        except queue.Full:
            pass
        self._thread.join(self.SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("KV events: the publisher thread did not stop within %g s", self.SHUTDOWN_TIMEOUT_S)
            return  # its sockets are its own: left to the process's exit
        self._ctx.destroy(linger=200)  # what is sent reaches connected subscribers

    # ---- the publisher thread -------------------------------------------------------------------
    def _run(self) -> None:
        from kvflow.kv_events.codec import encode_batch

        stopping = False
        while not stopping:
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                item = ...
            # Everything queued goes out before a replay is answered: a replay asked for after a
            # publish() returned includes that batch.
            while item is not ...:
                if item is None:
                    stopping = True
                else:
                    try:
                        seq, batch = item
                        payload = encode_batch(batch)
                        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                        self._buffer.append((seq, payload))
                    except Exception:
                        logger.exception("KV events: could not publish a batch")
                        time.sleep(0.1)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = ...
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception:
                    logger.exception("KV events: a replay request failed")

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: ignoring a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def make_publisher(config: KVEventsConfig) -> KVEventPublisher:
    """The publisher `config` names (its `publisher`: one of KV_EVENT_PUBLISHERS)."""
    if not config.enabled:
        return NullEventPublisher()
    if config.publisher == "zmq":
        return ZmqEventPublisher.from_config(config)
    raise ValueError(f"kv_events_config: unknown publisher {config.publisher!r}")
