"""Prompt logprobs (vLLM's `prompt_logprobs`): for each prompt position a request computes in a step,
the log-probability of the prompt's next token there, its rank and the top N, from the forward pass
the prefill runs anyway: the chunk's hidden rows go through the logits projection in slices (a
vocabulary-wide float32 row per position is the cost, so never the whole chunk at once).

A request that asks for them computes its whole prompt (the scheduler skips its prefix-cache hit:
cached positions have no hidden states), and the position after the prompt's last token is the
first generated token's, sampled as usual.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# A logprob entry as the sampler makes them: (logprob of the token, its rank, top ids, top logprobs).
LogprobEntry = tuple[float, int, list[int], list[float]]
ROWS_PER_SLICE = 256  # logits rows projected at a time (vocab x 256 float32 values)


def prompt_logprobs(
    seqs: list, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, tuple[int, list[LogprobEntry]]]:
    """request id -> (position of the first prompt token scored, one entry per scored token), for
    the step's sequences (`ScheduledSeq`s, in row order of `hidden`) that asked for prompt logprobs.
    Row i of a chunk starting at position p scores prompt token p + i + 1."""
    out: dict[str, tuple[int, list[LogprobEntry]]] = {}
    row = 0
    for s in seqs:
        n, top_n = len(s.token_ids), s.params.prompt_logprobs
        scored = min(n, s.num_prompt_tokens - 1 - s.start_pos)  # rows whose next token is a prompt token
        if top_n is not None and scored > 0 and s.prompt_token_ids is not None:
            targets = s.prompt_token_ids[s.start_pos + 1 : s.start_pos + 1 + scored]
            entries: list[LogprobEntry] = []
            for a in range(0, scored, ROWS_PER_SLICE):
                b = min(scored, a + ROWS_PER_SLICE)
                entries += _entries(compute_logits(hidden[row + a : row + b]).float(), targets[a:b], top_n)
            out[s.request_id] = (s.start_pos + 1, entries)
        row += n
    return out


def _entries(logits: torch.Tensor, targets: list[int], top_n: int) -> list[LogprobEntry]:
    lp = torch.log_softmax(logits, dim=-1)
    tgt = torch.tensor(targets, device=lp.device)
    chosen = lp.gather(1, tgt[:, None]).squeeze(1)
    ranks = (lp > chosen[:, None]).sum(dim=-1) + 1
    top_vals, top_ids = lp.topk(top_n, dim=-1) if top_n > 0 else (lp[:, :0], lp[:, :0].long())
    return list(zip(chosen.tolist(), ranks.tolist(), top_ids.tolist(), top_vals.tolist()))
