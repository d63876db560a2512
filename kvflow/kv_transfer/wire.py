"""The KV transfer wire format: declared data, never pickle.

A frame is a fixed prefix (magic, JSON header length), a UTF-8 JSON header, then `nbytes` raw
bytes of payload (the header says how many; 0 for control messages). A block payload is the
blocks' KV exactly as the pool stores it (`ModelRunner.read_blocks`): for the default KV dtype
[n, layers, block_size, 2, kv_heads, head_dim] in the model dtype; for quantized KV (int8,
fp8_e4m3, fp8_e5m2, int4) [n, layers, bytes], each layer's codes followed by its float32 scales. The manifest names all of that, the
blocks' chained content hashes, and a sha256 of the payload.
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
from dataclasses import asdict, dataclass
from typing import Any

MAGIC = b"KVF1"
_PREFIX = struct.Struct("<4sI")
MAX_HEADER_BYTES = 1 << 20


class WireError(Exception):
    """A malformed frame, or the peer went away mid-frame."""


@dataclass
class BlockManifest:
    identity: str  # sha256 of model + dtype + KV layout: blocks are only valid for the same one
    block_hashes: list[str]  # hex, one per block, in payload order
    first_block: int  # index of the first block in the request's block list
    layers: tuple[int, int]  # [start, end) of the layers in the payload
    dtype: str  # payload element type, e.g. "float32", "uint8" (quantized KV with its scales)
    block_shape: list[int]  # one block, all layers
    kv_cache_dtype: str  # "auto" | "int8" | "fp8_e4m3" | "fp8_e5m2" | "int4": both ends must agree
    nbytes: int
    sha256: str

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BlockManifest:
        try:
            m = cls(**d)
            m.layers = tuple(m.layers)
        except TypeError as e:
            raise WireError(f"bad manifest: {e}") from None
        return m


def digest(payload: bytes | memoryview) -> str:
    return hashlib.sha256(payload).hexdigest()


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    head = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_PREFIX.pack(MAGIC, len(head)) + head)
    if payload:
        sock.sendall(payload)


def recv_header(sock: socket.socket) -> dict[str, Any]:
    magic, size = _PREFIX.unpack(recv_exact(sock, _PREFIX.size))
    if magic != MAGIC:
        raise WireError("not a kvflow KV transfer frame")
    if size > MAX_HEADER_BYTES:
        raise WireError(f"frame header of {size} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = json.loads(recv_exact(sock, size))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"frame header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise WireError("frame header is not a JSON object")
    return header


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def manifest_header(manifest: BlockManifest, **extra: Any) -> dict[str, Any]:
    return {"ok": True, "manifest": asdict(manifest), **extra}
