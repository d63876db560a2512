"""What the router knows of a replica's prefix cache from its KV events (`--router-kv-events`), and
the token ids a request's prompts become there.

`ReplicaKVView` is the consumer of one replica's event stream (`kvflow.kv_events.subscriber`): the
block hashes it holds per medium (its pool, "GPU"; its CPU and disk tiers), learned from
`BlockStored` / `BlockRemoved` / `AllBlocksCleared`, so evictions the router never caused are seen.
Between routing a request and the replica reporting its blocks stored, those blocks are *pending*
(for `PENDING_TTL_S` at most, or until an event names them): a burst of requests that share a new
prefix then follows the first one instead of spreading before any event arrived.

The router hashes a prompt's blocks with the engine's own function
(`kvflow.core.block_hash.prompt_block_hashes`) over the token ids the replica's `/tokenize` gives
(`tokenize_requests` says which calls reproduce the prompt the engine will compute), and looks the
hashes up as the engine does: the longest run held by the pool, then the longest run after it held
by a tier. The first `BlockStored` of a replica is checked against that function; a stream whose
hashes differ (another engine, another hashing) is not used.
"""

from __future__ import annotations

import time
from typing import Any

from kvflow.core.block_hash import BlockHash, hash_block
from kvflow.kv_events.events import (
    MEDIA,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from kvflow.router.pd import CHAT_PATH, COMPLETIONS_PATH
from kvflow.utils.validation import is_int

# A block routed to a replica counts as held there for this long unless an event names it first.
# Long enough to outlast a queue: under a burst a request can wait tens of seconds for its prefill
# on a small replica, and its blocks must not look absent meanwhile (the next request sharing them
# would be computed on a second replica). A stale entry (a request refused or aborted before its
# prefill) costs little: the next request sharing the prefix goes there and computes it.
PENDING_TTL_S = 120.0


class ReplicaKVView:
    """One replica's prefix cache, as its KV events describe it (a `KVEventConsumer`)."""

    def __init__(self) -> None:
        self.next_seq: int | None = None
        self.block_size: int | None = None
        # None: not checked yet; False: its hashes are not the router's (the view is not used)
        self.compatible: bool | None = None
        self.media: dict[str, set[BlockHash]] = {m: set() for m in MEDIA}
        self.pending: dict[BlockHash, float] = {}  # hash -> until when (time.monotonic())
        self._pending_sweep = 0.0

    # ---- the event stream ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything (the replica restarted, or left the rotation)."""
        self.next_seq = None
        for held in self.media.values():
            held.clear()
        self.pending.clear()

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, BlockStored):
                held = self.media.setdefault(e.medium, set())
                held.update(e.block_hashes)
                if e.medium == MEDIUM_GPU:
                    self.block_size = e.block_size
                    for h in e.block_hashes:
                        self.pending.pop(h, None)
                    if self.compatible is None and len(e.token_ids) >= e.block_size:
                        self.compatible = _same_hash(e)
            elif isinstance(e, BlockRemoved):
                held = self.media.get(e.medium)
                if held is not None:
                    held.difference_update(e.block_hashes)
                if e.medium == MEDIUM_GPU:
                    for h in e.block_hashes:
                        self.pending.pop(h, None)
            elif isinstance(e, AllBlocksCleared):
                for held in self.media.values():
                    held.clear()
                self.pending.clear()
        self.next_seq = seq + 1

    # ---- routing ------------------------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        return self.block_size is not None and self.compatible is not False

    def note_routed(self, hashes: list[BlockHash], now: float | None = None) -> None:
        """A request whose full blocks have `hashes` was sent here: they will be computed."""
        now = time.monotonic() if now is None else now
        gpu = self.media[MEDIUM_GPU]
        until = now + PENDING_TTL_S
        for h in hashes:
            if h not in gpu:
                self.pending[h] = until
        if now >= self._pending_sweep:  # drop the expired ones, at most once per TTL
            self._pending_sweep = now + PENDING_TTL_S
            self.pending = {h: t for h, t in self.pending.items() if t > now}

    def matched_blocks(self, hashes: list[BlockHash], now: float | None = None) -> int:
        """How many of the leading `hashes` the replica would not compute: the run held by its pool
        (or pending there), then the run after it held by a tier (loaded, not computed)."""
        now = time.monotonic() if now is None else now
        gpu, pending = self.media[MEDIUM_GPU], self.pending
        n = 0
        for h in hashes:
            if h in gpu or pending.get(h, 0.0) > now:
                n += 1
            else:
                break
        tiers = [held for medium, held in self.media.items() if medium != MEDIUM_GPU and held]
        if tiers:
            for h in hashes[n:]:
                if any(h in held for held in tiers):
                    n += 1
                else:
                    break
        return n

    def pending_blocks(self, exclude: set[BlockHash] = frozenset(), now: float | None = None) -> int:
        """Blocks routed here and not reported yet (their prefill is queued here), less `exclude`."""
        now = time.monotonic() if now is None else now
        return sum(1 for h, until in self.pending.items() if until > now and h not in exclude)

    def num_blocks(self, medium: str) -> int:
        return len(self.media.get(medium, ()))


def _same_hash(e: BlockStored) -> bool:
    """Whether the router's hash function gives the first block's published hash."""
    parent = e.parent_block_hash
    if not isinstance(e.block_hashes[0], bytes) or not (parent is None or isinstance(parent, bytes)):
        return False
    return hash_block(parent, e.token_ids[: e.block_size]) == e.block_hashes[0]


# ---- the token ids of a request's prompts ------------------------------------------------------------
def tokenize_requests(path: str, body: dict[str, Any]) -> list[list[int] | dict[str, Any]] | None:
    """Per prompt the engine will compute: its token ids when the body gives them, else the body of
    a `POST /tokenize` that gives the same ids the engine's own tokenization will. None: the router
    cannot reproduce the prompt (chat with tools, a body it cannot read): route it by its text."""
    if path not in (CHAT_PATH, COMPLETIONS_PATH):
        return None  # responses, messages, embeddings: routed by their text
    model = body.get("model") if isinstance(body.get("model"), str) else None
    if path == CHAT_PATH:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        if body.get("tools") and body.get("tool_choice") != "none":
            return None  # the server renders the tools into the prompt (its --tool-call-parser decides how)
        add_generation_prompt = body.get("add_generation_prompt", True)
        if not isinstance(add_generation_prompt, bool):
            return None
        return [{"model": model, "messages": messages, "add_generation_prompt": add_generation_prompt}]
    prompt = body.get("prompt")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        return None
    prompts = [prompt] if isinstance(prompt, str) or (isinstance(prompt, list) and _ids(prompt)) else prompt
    if not isinstance(prompts, list) or not prompts:
        return None
    out: list[list[int] | dict[str, Any]] = []
    for p in prompts:
        if isinstance(p, str):
            out.append({"model": model, "prompt": p, "add_special_tokens": special})
        elif isinstance(p, list) and _ids(p):
            out.append([int(t) for t in p])
        else:
            return None
    return out


def _ids(x: list) -> bool:
    return bool(x) and all(is_int(t) for t in x)
