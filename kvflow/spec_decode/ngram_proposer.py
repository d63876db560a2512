"""Prompt lookup decoding: draft tokens copied from the sequence itself, no model.

If the sequence's last n tokens occurred earlier, guess that what followed them then follows
now. Longer n first (a longer match predicts better); among the occurrences of that n, the most
recent (nearest context). Strong on summarisation, code edits, quoting, and repetition loops.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvflow.spec_decode.proposer import Drafts

TOKEN_CODE = "i"  # the array module's code of a C int: the tokens' width in what NgramProposer searches
TOKEN_BYTES = array(TOKEN_CODE).itemsize

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

    def propose(self, token_ids: Sequence[int], k: int | None = None) -> list[int]:
        """Up to k (default num_speculative_tokens) draft tokens; [] when no n-gram matches."""
        return self.lookup(token_ids, k)[0]

    def lookup(self, token_ids: Sequence[int] | bytes | bytearray, k: int | None = None) -> tuple[list[int], int]:
        """`propose`'s drafts and the length of the n-gram they follow (0 when none matched).

        The tokens as bytes, TOKEN_BYTES each (`token_ids` may already be them, as
        NgramBatchProposer keeps each request's), searched from the end (`rfind`, in C) for the last
        n tokens, n from max_n down: the first n found gives the longest match, rfind its most recent
        occurrence (one found across token boundaries is skipped). O(L) per n for L tokens.
        """
        k = self.num_speculative_tokens if k is None else k
        if isinstance(token_ids, (bytes, bytearray)):
            data = token_ids
        else:
            data = array(TOKEN_CODE, token_ids).tobytes()
        width = TOKEN_BYTES
        n_tok = len(data) // width
        if k <= 0 or n_tok <= self.min_n:  # need the suffix plus at least one earlier occurrence
            return [], 0
        before_last = (n_tok - 1) * width  # an earlier occurrence ends before the last token
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            suffix = data[(n_tok - n) * width :]
            at = data.rfind(suffix, 0, before_last)
            while at > 0 and at % width:  # a byte match across token boundaries: look further back
                at = data.rfind(suffix, 0, at + len(suffix) - 1)
            if at >= 0:
                follow = at + n * width
                return array(TOKEN_CODE, data[follow : min(follow + k * width, len(data))]).tolist(), n
        return [], 0


class NgramBatchProposer:
    """The n-gram proposer behind the batch interface the speculator calls (`propose(requests,
    plan)`, `observe`, `release`), which the draft-model proposer shares."""

    cost = None  # looking up n-grams costs nothing the step-cost model would see

    def __init__(self, proposer: NgramProposer) -> None:
        self.proposer = proposer
        # Each request's tokens so far as the bytes lookup searches: converting prompt + output on
        # every lookup cost as much as the lookup; a step appends its new ones.
        self._tokens: dict[str, bytearray] = {}

    def propose(self, requests: list[Request], plan: dict[str, int]) -> dict[str, Drafts]:
        """Each planned request's drafts, with the matched n-gram's length as their evidence."""
        return {
            r.request_id: Drafts(*self.proposer.lookup(self._bytes(r), k))
            for r in requests
            if (k := plan.get(r.request_id, 0)) > 0
        }

    def _bytes(self, r: Request) -> bytearray:
        buf = self._tokens.get(r.request_id)
        prompt, output = r.prompt_token_ids, r.output_token_ids
        filled = 0 if buf is None else len(buf) // TOKEN_BYTES
        total = len(prompt) + len(output)
        # (tokens only ever append: a shorter sequence, or a different token where the last one
        # was, is a new sequence under the same id)
        if (
            buf is None
            or not len(prompt) <= filled <= total
            or (filled > len(prompt) and output[filled - 1 - len(prompt)] != array(TOKEN_CODE, buf[-TOKEN_BYTES:])[0])
        ):
            buf, filled = bytearray(array(TOKEN_CODE, prompt).tobytes()), len(prompt)
            self._tokens[r.request_id] = buf
        if total > filled:
            buf += array(TOKEN_CODE, output[filled - len(prompt) :]).tobytes()
        return buf

    def observe(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        pass

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self._tokens.pop(rid, None)
