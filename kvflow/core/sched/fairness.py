"""Fair share across clients: the Virtual Token Counter (Sheng et al., "Fairness in Serving Large
Language Models", OSDI'24).

Each client (OpenAI's `user`, else the API key) has a counter of the service it received:
`input_weight` per prompt token computed plus `output_weight` per generated token. Waiting
requests are admitted client by client, least counter first (the policy's order within a client).
A client that was idle rejoins at the least counter among the backlogged clients, so it cannot
bank idle time and then crowd the others out. Two backlogged clients' counters then differ by at
most about one request's worth of service (the paper's bound: 2 x (w_in x max prompt + w_out x
max output), tested in tests/core/test_scheduling_policies.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.core.request import Request


class VirtualTokenCounter:
    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0) -> None:
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.counters: dict[str, float] = {}

    def on_arrival(self, req: Request, queued: Sequence[Request]) -> None:
        """Lift a client that has nothing queued to the least counter of the backlogged ones."""
        client = req.client or ""
        backlogged = {r.client or "" for r in queued}
        if client in backlogged:
            return
        others = [self.counters.get(c, 0.0) for c in backlogged]
        self.counters[client] = max(self.counters.get(client, 0.0), min(others, default=0.0))

    def charge(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        if prompt_tokens or output_tokens:
            client = req.client or ""
            self.counters[client] = (
                self.counters.get(client, 0.0) + self.input_weight * prompt_tokens + self.output_weight * output_tokens
            )

    def order(self, candidates: list[Request]) -> list[Request]:
        """The candidates (in the policy's order), client by client, least service first; each
        pick counts its prompt toward its client, so one step does not admit one client's whole
        backlog."""
        queues: dict[str, list[Request]] = {}
        for r in candidates:
            queues.setdefault(r.client or "", []).append(r)
        tentative = {c: self.counters.get(c, 0.0) for c in queues}
        out = []
        while queues:
            client = min(queues, key=lambda c: tentative[c])
            req = queues[client].pop(0)
            out.append(req)
            tentative[client] += self.input_weight * (req.num_tokens - req.num_computed_tokens)
            if not queues[client]:
                del queues[client]
        return out
