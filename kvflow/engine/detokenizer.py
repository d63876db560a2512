"""Incremental detokenization that never emits half a UTF-8 character.

Byte-level BPE splits one character (a kanji, an emoji) over several tokens. Each new token is
decoded together with a short window of the tokens before it; text is released only when the
window no longer ends in U+FFFD, i.e. when the bytes form whole characters.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

_CONTEXT_TOKENS = 5  # prompt tokens used as left context (spacing of SentencePiece-style tokenizers)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Feed one token; returns the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        window = self._ids[self._prefix_offset :]
        decode = self.tokenizer.decode
        prefix = decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self.skip_special_tokens
        )
        full = decode(window, skip_special_tokens=self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            # Keep the id list short: only the window still matters.
            drop = self._prefix_offset
            if drop > 64:
                del self._ids[:drop]
                self._prefix_offset -= drop
                self._read_offset -= drop
            return full[len(prefix) :]
        return ""


class TokenBytes:
    """Each token's own bytes, and its text as OpenAI's logprobs show it.

    Decoding one token alone cannot show a piece of a multi-byte character (it comes out as
    U+FFFD), so logprobs read the token's raw bytes from the vocabulary instead: byte-level BPE
    pieces map back through GPT-2's byte alphabet, SentencePiece byte-fallback pieces are `<0xNN>`,
    other SentencePiece pieces use U+2581 for a space. A token whose bytes are not whole UTF-8
    characters is shown as `bytes:\\xe3\\x81` (OpenAI's form); its `bytes` are still exact.
    """

    _BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self._byte_level = _decoder_is_byte_level(tokenizer)
        self._unbyte = {c: b for b, c in _bytes_to_unicode().items()}
        self._cache: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        raw = self._cache.get(token_id)
        if raw is None:
            raw = self._cache[token_id] = self._raw(token_id)
        return raw

    def text(self, token_id: int) -> str:
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _raw(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in self._unbyte for c in piece):
            return bytes(self._unbyte[c] for c in piece)
        m = self._BYTE_PIECE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")


def _decoder_is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None:
        return False
    # The decoder's own JSON: serializing the whole tokenizer (vocabulary and merges) would cost a
    # warm start a noticeable share of its time (figures: docs/benchmarks/results/).
    decoder = json.loads(backend.decoder.__getstate__())
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
    return "ByteLevel" in kinds


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from the 256 byte values to printable characters (byte-level BPE vocabularies
    are written in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}
