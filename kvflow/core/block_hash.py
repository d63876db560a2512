"""The prefix cache's block hash, on its own: the engine hashes its requests' blocks with it, and
the router (`--router-kv-events`) hashes a prompt's blocks with it to look them up in the hashes
the engines publish. No torch, nothing else of kvflow."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_key: bytes = b"") -> BlockHash:
    """sha256(parent's hash (32 zero bytes for the first block), the token ids as int64, extra_key)."""
    h = hashlib.sha256(parent or b"\0" * 32)
    h.update(array("q", token_ids).tobytes())
    h.update(extra_key)
    return h.digest()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, extra_key: bytes = b"") -> list[BlockHash]:
    """The chained hashes of every full block of `token_ids`, as the engine computes them."""
    out: list[BlockHash] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_key)
        out.append(parent)
    return out
