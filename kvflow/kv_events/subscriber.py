"""The subscriber's side of the KV event stream: follow one publisher into a `KVEventConsumer`
(a model of its cache), in sequence-number order, replaying what was missed.

- At start, and whenever the consumer knows nothing (`next_seq` None), it asks the replay socket
  for everything from 0 (a fresh publisher's first batch starts with `AllBlocksCleared`).
- A batch whose number is past the one expected (messages lost: a late subscriber, the PUB
  socket's high-water mark, a batch dropped by the engine) makes it ask for the batches from the
  expected number; those the publisher no longer keeps are lost (counted, logged): the consumer's
  view is then approximate until the blocks it missed are stored or removed again.
- A number below the expected one is either a batch already applied (a replay ran ahead of the
  live stream: the same payload, skipped) or a publisher that restarted (its numbers start at 0
  again): the consumer is reset, then caught up from 0.

ZMQ frames as `publisher` describes them; the replay socket is a DEALER (vLLM's ROUTER answers it as
it answers a REQ). Without a replay endpoint, gaps are only counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from kvflow.kv_events.codec import KVEventDecodeError, decode_batch
from kvflow.kv_events.events import KVEventBatch

logger = logging.getLogger("kvflow.kv_events")

REPLAY_TIMEOUT_S = 2.0  # a replay whose end marker has not come by then is given up (and retried later)
_RECENT = 4096  # batches remembered (number -> digest) to tell a duplicate from a restart


class KVEventConsumer(Protocol):
    next_seq: int | None  # the sequence number expected next; None: knows nothing yet

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        """Apply batch `seq` (the next one, or the first known) and expect seq + 1."""

    def reset(self) -> None:
        """Forget everything (the publisher restarted); `next_seq` becomes None."""


class KVEventSubscriber:
    """Follows `endpoint` (and asks `replay_endpoint`) into `consumer`; `run()` until cancelled.
    `on_stat(kind, n)` hears of "batches", "replays", "lost" (batches missed for good) and
    "restarts"."""

    def __init__(
        self,
        endpoint: str,
        consumer: KVEventConsumer,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        name: str = "",
        on_stat: Callable[[str, int], None] | None = None,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
    ) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.consumer = consumer
        self.topic = topic.encode()
        self.name = name or endpoint
        self.on_stat = on_stat or (lambda kind, n: None)
        self.replay_timeout_s = replay_timeout_s
        self._ctx = None
        self._dealer = None
        self._recent: OrderedDict[int, bytes] = OrderedDict()

    def _context(self):
        if self._ctx is None:
            import zmq.asyncio

            self._ctx = zmq.asyncio.Context()
        return self._ctx

    def close(self) -> None:
        """Close the replay socket and the context (`run` does it when it ends)."""
        self._close_dealer()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def run(self) -> None:
        import zmq

        sub = self._context().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        try:
            sub.connect(self.endpoint)
            if self.consumer.next_seq is None:
                await self.replay(0)  # what was published before we connected
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    logger.warning("KV events from %s: ignoring a message of %d frames", self.name, len(frames))
                    continue
                await self.receive(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close(linger=0)
            self.close()

    async def receive(self, seq: int, payload: bytes) -> None:
        """One published batch."""
        c = self.consumer
        if c.next_seq is not None and seq < c.next_seq:
            if self._recent.get(seq) == _digest(payload):
                return  # applied already (from a replay that ran ahead of the live stream)
            logger.info(
                "KV events from %s: sequence went back (%d < %d): the publisher restarted", self.name, seq, c.next_seq
            )
            self.on_stat("restarts", 1)
            c.reset()
            self._recent.clear()
        expected = 0 if c.next_seq is None else c.next_seq
        if seq > expected:
            await self.replay(expected)
            if c.next_seq is not None and seq < c.next_seq:
                return  # the replay brought it
            expected = 0 if c.next_seq is None else c.next_seq
            if seq > expected:
                self._lost(expected, seq)
        self._apply(seq, payload)

    async def replay(self, start: int) -> bool:
        """Ask for the batches from `start`; apply those the consumer has not seen. False when
        there is no replay endpoint or it did not answer in time."""
        if self.replay_endpoint is None:
            return False
        import zmq

        if self._dealer is None:
            self._dealer = self._context().socket(zmq.DEALER)
            self._dealer.connect(self.replay_endpoint)
        self.on_stat("replays", 1)
        try:
            await self._dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(self._dealer.recv_multipart(), self.replay_timeout_s)
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq < 0:
                    return True
                nxt = self.consumer.next_seq
                if nxt is not None and seq < nxt:
                    continue  # seen already
                if seq > (start if nxt is None else nxt):
                    self._lost(start if nxt is None else nxt, seq)  # older than the publisher keeps
                self._apply(seq, frames[2])
        except TimeoutError:
            logger.warning("KV events from %s: the replay endpoint %s did not answer", self.name, self.replay_endpoint)
            self._close_dealer()  # a late answer must not be taken for the next request's
            return False

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except KVEventDecodeError as e:
            logger.warning("KV events from %s: batch %d is not readable (%s): skipped", self.name, seq, e)
            batch = KVEventBatch(0.0)
        if self.consumer.next_seq is None:
            self._recent.clear()  # the consumer was reset from outside (its replica left the rotation)
        self.consumer.apply(seq, batch)
        self._recent[seq] = _digest(payload)
        if len(self._recent) > _RECENT:
            self._recent.popitem(last=False)
        self.on_stat("batches", 1)

    def _lost(self, expected: int, got: int) -> None:
        logger.warning(
            "KV events from %s: batches %d..%d are lost (not replayable): the view of its cache is "
            "approximate until those blocks change again",
            self.name,
            expected,
            got - 1,
        )
        self.on_stat("lost", got - expected)

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            with contextlib.suppress(Exception):
                self._dealer.close(linger=0)
            self._dealer = None


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def fetch_replay(replay_endpoint: str, start_seq: int = 0, timeout_s: float = 5.0) -> list[tuple[int, bytes]]:
    """Blocking: every batch a publisher still keeps from `start_seq`, as (seq, payload), in order
    (tools and tests; a subscriber uses `KVEventSubscriber`)."""
    import zmq

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(replay_endpoint)
        dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
        out = []
        while True:
            if not dealer.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"no answer from {replay_endpoint} within {timeout_s} s")
            _, seq_bytes, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq < 0:
                return out
            out.append((seq, payload))
    finally:
        dealer.close(linger=0)
        ctx.term()
