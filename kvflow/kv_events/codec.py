"""KV event batches on the wire: msgpack, in vLLM's layout, so that vLLM's consumers (llm-d's KV
cache indexer, Dynamo's router, vLLM's example subscriber) read kvflow's stream and kvflow's
router reads theirs.

A batch is a msgpack array `[ts, events]` (plus `data_parallel_rank` when set); each event is a
map with its type under "type" and its fields by name (vLLM's encoding since it dropped
msgspec's `array_like` for events):

    {"type": "BlockStored", "block_hashes": [bin32, ...], "parent_block_hash": bin32 | nil,
     "token_ids": [int, ...], "block_size": int, "lora_id": nil, "medium": "GPU" | "CPU" | "DISK",
     "lora_name": nil}
    {"type": "BlockRemoved", "block_hashes": [bin32, ...], "medium": "GPU" | "CPU" | "DISK"}
    {"type": "AllBlocksCleared"}

Block hashes are msgpack binaries (vLLM's `ExternalBlockHash` allows bytes or int). The decoder
also takes vLLM's older positional events (`["BlockStored", hashes, parent, token_ids,
block_size, lora_id, medium, ...]`) and a batch encoded as a map; unknown event types are
skipped, unknown fields ignored. Nothing is ever unpickled: msgpack decodes to plain values.
"""

from __future__ import annotations

from typing import Any

import msgpack

from kvflow.kv_events.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVEventBatch


class KVEventDecodeError(ValueError):
    """A payload that is not a KV event batch."""


def encode_batch(batch: KVEventBatch) -> bytes:
    out: list[Any] = [batch.ts, [_encode_event(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        out.append(batch.data_parallel_rank)
    return msgpack.packb(out, use_bin_type=True)


def _encode_event(e: KVCacheEvent) -> dict[str, Any]:
    if isinstance(e, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": e.block_hashes,
            "parent_block_hash": e.parent_block_hash,
            "token_ids": e.token_ids,
            "block_size": e.block_size,
            "lora_id": e.lora_id,
            "medium": e.medium,
            "lora_name": e.lora_name,
        }
    if isinstance(e, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": e.block_hashes, "medium": e.medium}
    if isinstance(e, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV cache event: {e!r}")


def decode_batch(payload: bytes) -> KVEventBatch:
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise KVEventDecodeError(f"not msgpack: {e}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise KVEventDecodeError("a KV event batch is [ts, events, (data_parallel_rank)]")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(events, list):
        raise KVEventDecodeError("a KV event batch is [ts, events, (data_parallel_rank)]")
    out = KVEventBatch(float(ts), [], rank if isinstance(rank, int) else None)
    for raw_event in events:
        event = _decode_event(raw_event)
        if event is not None:
            out.events.append(event)
    return out


# vLLM's positional field order (before it switched events to maps), after the tag.
_POSITIONAL = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _decode_event(raw: Any) -> KVCacheEvent | None:
    if isinstance(raw, dict):
        kind, f = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        f = dict(zip(_POSITIONAL.get(kind, ()), raw[1:]))
    else:
        raise KVEventDecodeError(f"not a KV cache event: {raw!r:.80}")
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if kind not in ("BlockStored", "BlockRemoved"):
        return None  # a newer event type: not ours to interpret
    hashes = f.get("block_hashes")
    if not isinstance(hashes, list) or not all(isinstance(h, (bytes, int)) for h in hashes):
        raise KVEventDecodeError(f"{kind}: block_hashes must be a list of hashes")
    medium = f.get("medium")
    medium = MEDIUM_GPU if medium is None else str(medium).upper()
    if kind == "BlockRemoved":
        return BlockRemoved(hashes, medium)
    token_ids, block_size = f.get("token_ids") or [], f.get("block_size")
    if not isinstance(token_ids, list) or not isinstance(block_size, int) or block_size < 1:
        raise KVEventDecodeError("BlockStored: token_ids must be a list and block_size a positive integer")
    parent = f.get("parent_block_hash")
    return BlockStored(
        hashes,
        parent if isinstance(parent, (bytes, int)) else None,
        token_ids,
        block_size,
        medium,
        f.get("lora_id"),
        f.get("lora_name"),
    )
