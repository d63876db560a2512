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

        O(L) numpy work for L tokens (one vectorised compare finds the earlier positions holding
        the last token; each of the c candidates is then extended backwards, at most max_n - 1
        steps each, vectorised over candidates). A list costs a conversion on every call that an
        array does not (keep an array per request to skip it); figures: docs/benchmarks/results/.
        """
        k = self.num_speculative_tokens if k is None else k
        tokens = np.asarray(token_ids, dtype=np.int64)
        n_tok = len(tokens)
        if k <= 0 or n_tok <= self.min_n:  # need the suffix plus at least one earlier occurrence
            return [], 0
        # Candidate ends e < L - 1 of an earlier occurrence: tokens[e] == the last token.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if len(ends) == 0:
            return [], 0
        # Match length of each candidate, growing backwards up to max_n.
        length = np.ones(len(ends), dtype=np.int64)
        alive = np.ones(len(ends), dtype=bool)
        for m in range(1, self.max_n):
            if m >= n_tok - 1:  # the suffix itself has only n_tok tokens; ends <= n_tok - 2
                break
            back = ends - m
            alive &= back >= 0
            alive[alive] = tokens[back[alive]] == tokens[n_tok - 1 - m]
            if not alive.any():
                break
            length += alive
        best = int(length.max())
        if best < self.min_n:
            return [], 0
        e = int(ends[np.flatnonzero(length == best)[-1]])  # the most recent of the longest matches
        return tokens[e + 1 : e + 1 + k].tolist(), best


class NgramBatchProposer:
    """The n-gram proposer behind the batch interface the speculator calls (`propose(requests,
    plan)`, `observe`, `release`), which the draft-model proposer shares."""

    cost = None  # looking up n-grams costs nothing the step-cost model would see

    def __init__(self, proposer: NgramProposer) -> None:
        self.proposer = proposer
        # Each request's tokens so far as an int64 array (room to grow) and how many are filled:
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
            buf, filled = np.empty(max(64, 2 * total), dtype=np.int64), n_prompt
            buf[:n_prompt] = r.prompt_token_ids
        elif total > len(buf):
            buf = np.concatenate([buf[:filled], np.empty(total, dtype=np.int64)])
        if total > filled:
            buf[filled:total] = r.output_token_ids[filled - n_prompt : total - n_prompt]
        self._tokens[r.request_id] = (buf, total)
        return buf[:total]

    def observe(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        pass

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self._tokens.pop(rid, None)
