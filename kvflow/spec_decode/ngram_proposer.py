"""Prompt lookup decoding: draft tokens copied from the sequence itself, no model.

If the sequence's last n tokens occurred earlier, guess that what followed them then follows
now. Longer n first (a longer match predicts better); among the occurrences of that n, the most
recent (nearest context). Strong on summarisation, code edits, quoting, and repetition loops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvflow.spec_decode.proposer import Drafts

if TYPE_CHECKING:
    from kvflow.core.request import Request
    from kvflow.core.scheduler import SchedulerOutput


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min} and {prompt_lookup_max}"
            )
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, token_ids: Sequence[int] | np.ndarray, k: int | None = None) -> list[int]:
        """Up to k (default num_speculative_tokens) draft tokens; [] when no n-gram matches."""
        return self.lookup(token_ids, k)[0]

    def lookup(self, token_ids: Sequence[int] | np.ndarray, k: int | None = None) -> tuple[list[int], int]:
        """`propose`'s drafts and the length of the n-gram they follow (0 when none matched).

        The tokens as int32 bytes, searched from the end (bytes.rfind, in C) for the last n tokens,
        n from max_n down: the first n found gives the longest match, rfind its most recent
        occurrence (one found across token boundaries is skipped). O(L) per n for L tokens; a list
        costs a conversion on every call that an int32 array does not (NgramBatchProposer keeps
        one per request).
        """
        k = self.num_speculative_tokens if k is None else k
        tokens = np.ascontiguousarray(token_ids, dtype=np.int32)
        n_tok = len(tokens)
        if k <= 0 or n_tok <= self.min_n:  # need the suffix plus at least one earlier occurrence
            return [], 0
        data, width = tokens.tobytes(), tokens.itemsize
        before_last = (n_tok - 1) * width  # an earlier occurrence ends before the last token
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            suffix = data[(n_tok - n) * width :]
            at = data.rfind(suffix, 0, before_last)
            while at > 0 and at % width:  # a byte match across token boundaries: look further back
                at = data.rfind(suffix, 0, at + len(suffix) - 1)
            if at >= 0:
                start = at // width
                return tokens[start + n : start + n + k].tolist(), n
        return [], 0


class NgramBatchProposer:
    """The n-gram proposer behind the batch interface the speculator calls (`propose(requests,
    plan)`, `observe`, `release`), which the draft-model proposer shares."""

    cost = None  # looking up n-grams costs nothing the step-cost model would see

    def __init__(self, proposer: NgramProposer) -> None:
        self.proposer = proposer
        # Each request's tokens so far as an int32 array (room to grow) and how many are filled:
        # converting prompt + output from lists on every lookup cost as much as the lookup.
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}

    def propose(self, requests: list[Request], plan: dict[str, int]) -> dict[str, Drafts]:
        """Each planned request's drafts, with the matched n-gram's length as their evidence."""
        return {
            r.request_id: Drafts(*self.proposer.lookup(self._array(r), k))
            for r in requests
            if (k := plan.get(r.request_id, 0)) > 0
        }

    def _array(self, r: Request) -> np.ndarray:
        buf, filled = self._tokens.get(r.request_id, (None, 0))
        total, n_prompt = r.num_tokens, len(r.prompt_token_ids)
        stale = buf is None or filled > total or filled < n_prompt
        if not stale and filled > n_prompt:  # (tokens only ever append; a changed last one would say otherwise)
            stale = buf[filled - 1] != r.output_token_ids[filled - 1 - n_prompt]
        if stale:
            buf, filled = np.empty(max(64, 2 * total), dtype=np.int32), n_prompt
            buf[:n_prompt] = r.prompt_token_ids
        elif total > len(buf):
            buf = np.concatenate([buf[:filled], np.empty(total, dtype=np.int32)])
        if total > filled:
            buf[filled:total] = r.output_token_ids[filled - n_prompt : total - n_prompt]
        self._tokens[r.request_id] = (buf, total)
        return buf[:total]

    def observe(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        pass

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self._tokens.pop(rid, None)
