"""Attention sinks with a recent window (StreamingLLM, Xiao et al. 2023): which KV blocks a sequence
drops, and when, so that it generates past max_model_len with a constant number of KV blocks.

A sequence keeps its first `sink_blocks` blocks (the attention sinks: its first N tokens, rounded
up to whole blocks) and its most recent blocks; the cache never holds more than
`max_cache_tokens` = sink blocks + window tokens. When the next step's tokens would pass that, the
oldest non-sink blocks are dropped, whole, from the block table. Positions roll inside the cache
as in StreamingLLM: a token's position is its index in the cache, not in the text, so the keys of
every kept block after the dropped ones move down by the dropped tokens (`KVShift`: the model
runner re-rotates them, kvflow.worker.kv_rerotate) and the next token's position is the cache
length.

Block granularity keeps the block table and the slot arithmetic of every attention backend as
they are: the runner sees an ordinary sequence of `cache length` tokens. The price is that the
window, seen from a new token, holds between window - block_size + 1 and window tokens besides
the sinks.

Pure bookkeeping: no tensors (the scheduler calls it; the runner does the rotation).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVShift:
    """Rotate the keys in `blocks` back by `delta` positions (every layer), before the step's
    forward pass: they moved `delta` places down the cache when the blocks before them were dropped."""

    blocks: list[int]
    delta: int


@dataclass(frozen=True)
class StreamingKV:
    """The eviction policy of one engine: sinks + a recent window, in tokens, over blocks."""

    num_sink_tokens: int
    window: int
    block_size: int

    @property
    def sink_blocks(self) -> int:
        return -(-self.num_sink_tokens // self.block_size)

    @property
    def max_cache_tokens(self) -> int:
        """The most tokens a sequence's cache ever holds (and the highest position + 1)."""
        return self.sink_blocks * self.block_size + self.window

    @property
    def max_blocks(self) -> int:
        """The most blocks a sequence ever holds."""
        return -(-self.max_cache_tokens // self.block_size)

    @classmethod
    def create(
        cls, attention_sinks: int, attention_window: int | None, block_size: int, max_model_len: int
    ) -> StreamingKV:
        """The policy for these options, checked against max_model_len (the rotary tables and the
        engine's sizing stop there, so the cache must fit in it)."""
        sink_tokens = -(-attention_sinks // block_size) * block_size
        window = attention_window if attention_window is not None else max_model_len - sink_tokens
        if window < block_size:
            raise ValueError(
                f"attention sinks: {attention_sinks} sink tokens take {sink_tokens} tokens of whole blocks "
                f"(block_size {block_size}), leaving a window of {window} < one block within max_model_len "
                f"{max_model_len}; use fewer sinks or a longer max_model_len"
            )
        if sink_tokens + window > max_model_len:
            raise ValueError(
                f"attention sinks ({sink_tokens} tokens in whole blocks) + attention_window ({window}) = "
                f"{sink_tokens + window} exceeds max_model_len {max_model_len}: the cache must fit in the "
                f"model's context; lower attention_window to at most {max_model_len - sink_tokens}"
            )
        return cls(attention_sinks, window, block_size)

    def plan(self, cache_len: int, num_new: int) -> tuple[int, int]:
        """Before computing `num_new` more tokens of a sequence whose cache holds `cache_len`:
        (blocks to drop after the sink blocks, tokens to compute). Drops the fewest whole blocks that
        make room; a prefill chunk longer than the room left even then is cut to it (the rest comes
        in later steps, after further drops)."""
        bs = self.block_size
        over = cache_len + num_new - self.max_cache_tokens
        if over <= 0:
            return 0, num_new
        droppable = max(0, cache_len // bs - self.sink_blocks)  # full, computed, non-sink blocks
        drop = min(-(-over // bs), droppable)
        return drop, min(num_new, self.max_cache_tokens - (cache_len - drop * bs))
