"""Incremental detokenization that never emits half a UTF-8 character.

Byte-level BPE splits one character (a kanji, an emoji) over several tokens. Each new token is
decoded together with a short window of the tokens before it; text is released only when the
window no longer ends in U+FFFD, i.e. when the bytes form whole characters.
"""

from __future__ import annotations

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
        prefix = decode(self._ids[self._prefix_offset : self._read_offset],
                        skip_special_tokens=self.skip_special_tokens)
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
            return full[len(prefix):]
        return ""
