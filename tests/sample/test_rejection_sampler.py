"""The rejection sampler: greedy against a brute-force loop, random rows against the target
distribution (statistically, with a bound a correct sampler passes and a wrong one fails), one-hot
drafts, truncation, seeds, edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.sample import rejection_sampler
from kvflow.sample.rejection_sampler import RejectionSampler
from kvflow.sample.sampler import transformed_probs
from kvflow.sampling_params import SamplingParams

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)
RANDOM = SamplingParams(temperature=1.0)


def _flat(logits_per_row: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(logits_per_row)


# ---- greedy ----------------------------------------------------------------------------------
def _greedy_reference(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    out = []
    for j, d in enumerate(drafts):
        best = int(logits[j].argmax())
        if d != best:
            return out + [best]
        out.append(d)
    return out + [int(logits[len(drafts)].argmax())]


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed with random rows", "all greedy"])
def test_greedy_matches_brute_force(mixed):
    """Greedy rows against the brute-force loop, in a batch with random rows (the vectorised
    path) and alone (the host path), ties in the logits included."""
    g = torch.Generator().manual_seed(0)
    vocab, rows = 50, 40
    ks = [int(x) for x in torch.randint(0, 6, (rows,), generator=g)]
    ks[0] = 0
    logits = [torch.randint(0, 4, (k + 1, vocab), generator=g).float() for k in ks]  # ties in every row
    drafts = []
    for lg, k in zip(logits, ks):  # mostly the argmax, sometimes not: every outcome occurs
        d = [
            int(lg[j].argmax()) if torch.rand((), generator=g) < 0.7 else int(torch.randint(vocab, (), generator=g))
            for j in range(k)
        ]
        drafts.append(d)
    params = [GREEDY if i % 2 == 0 or not mixed else RANDOM for i in range(rows)]
    q = [torch.softmax(torch.randn(k, vocab, generator=g), -1) for k in ks]
    out = RejectionSampler(seed=0, device=CPU)(_flat(logits), drafts, q, params, [None] * rows)
    greedy_rows = [i for i in range(rows) if params[i].greedy]
    for i in greedy_rows:
        ref = _greedy_reference(logits[i], drafts[i])
        assert out.token_ids[i] == ref, i
        assert out.num_accepted[i] == len(ref) - 1
    assert {out.num_accepted[i] == ks[i] for i in greedy_rows} == {True, False}  # both paths ran
    for i in range(rows):  # random rows: shape of the output
        assert 0 <= out.num_accepted[i] <= ks[i] and len(out.token_ids[i]) == out.num_accepted[i] + 1
        assert out.token_ids[i][:-1] == drafts[i][: out.num_accepted[i]]


# ---- the output distribution of random rows --------------------------------------------------
# Per position j: target logits LOGITS[j], draft distribution Q[j] (p != q; Q[2] has a zero).
LOGITS = torch.tensor(
    [
        [2.0, 1.0, 0.5, 0.0, -0.5, 1.5],
        [0.0, 1.5, -1.0, 1.0, 0.5, 0.2],
        [1.0, 0.0, 0.0, 2.0, 0.0, -1.0],
        [0.3, 0.2, 0.1, 0.0, -0.1, -0.2],
    ]
)
Q = torch.tensor(
    [
        [0.05, 0.3, 0.3, 0.05, 0.25, 0.05],
        [0.4, 0.05, 0.3, 0.05, 0.1, 0.1],
        [0.2, 0.2, 0.2, 0.2, 0.2, 0.0],
        [0.1, 0.1, 0.1, 0.1, 0.1, 0.5],
    ]
)
N_ROWS = 40_000
K_MAX = 3
DELTA = 1e-9  # chance that a correct sampler fails the bound


def _l1_bound(n_cells: int, n: int) -> float:
    """Weissman et al. 2003: P(||p_hat - p||_1 >= eps) <= (2^m - 2) exp(-n eps^2 / 2) for the
    empirical distribution of n draws over m cells; eps solved for probability DELTA."""
    return math.sqrt(2 * (n_cells * math.log(2) + math.log(1 / DELTA)) / n)


def _draws(sampler, params, q_of, draft_mode: str, seed: int, claimed_q=None) -> torch.Tensor:
    """[N_ROWS, 2]: the first two emitted tokens of rows with k = 0..K_MAX (cycling). A row that
    emitted one token takes its second from a next call, one position on (as the engine would).
    Drafts are drawn from q_of; the sampler is told claimed_q (default: q_of, the truth)."""
    claimed_q = q_of if claimed_q is None else claimed_q
    g = torch.Generator().manual_seed(seed)
    vocab = LOGITS.shape[1]

    def step(first_pos: int, ks: list[int]):
        k = torch.tensor(ks)
        starts = torch.cumsum(k + 1, 0) - (k + 1)
        within = torch.arange(int((k + 1).sum())) - torch.repeat_interleave(starts, k + 1)
        logits = LOGITS[first_pos + within]  # row i: positions first_pos .. first_pos + k_i
        if draft_mode == "onehot":  # a deterministic proposer: fixed tokens, q one-hot
            drafts = [[(first_pos + j + i) % vocab for j in range(n)] for i, n in enumerate(ks)]
        else:
            cols = [
                torch.multinomial(q_of[first_pos + j], len(ks), replacement=True, generator=g) for j in range(max(ks))
            ]
            table = torch.stack(cols, 1).tolist() if cols else [[] for _ in ks]
            drafts = [row[:n] for row, n in zip(table, ks)]
        # "sampled_as_onehot": drafts from q, but q withheld from the sampler
        probs = [claimed_q[first_pos : first_pos + n] if draft_mode == "q" else None for n in ks]
        return sampler(logits, drafts, probs, [params] * len(ks), [None] * len(ks)).token_ids

    first = step(0, [i % (K_MAX + 1) for i in range(N_ROWS)])
    need = [i for i, t in enumerate(first) if len(t) < 2]
    second = step(1, [1] * len(need))
    pairs = [t[:2] for t in first]
    for i, t in zip(need, second):
        pairs[i] = [pairs[i][0], t[0]]
    return torch.tensor(pairs)


def _l1_errors(draws: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    vocab = p.shape[1]
    first = torch.bincount(draws[:, 0], minlength=vocab).double() / len(draws)
    pair = torch.bincount(draws[:, 0] * vocab + draws[:, 1], minlength=vocab * vocab).double() / len(draws)
    want_pair = (p[0][:, None] * p[1][None, :]).flatten().double()
    return float((first - p[0].double()).abs().sum()), float((pair - want_pair).abs().sum())


CASES = {  # name: (params, draft mode)
    "q": (RANDOM, "q"),
    "onehot": (RANDOM, "onehot"),
    "sampled_as_onehot": (RANDOM, "sampled_as_onehot"),  # exact too, only accepts less
    "temperature_top_k": (SamplingParams(temperature=0.7, top_k=4), "q"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_random_rows_emit_the_target_distribution(case):
    params, mode = CASES[case]
    p = transformed_probs(LOGITS, [params] * len(LOGITS))
    # The caller transforms the draft side with the same function (log q as logits: q itself at T=1).
    q = transformed_probs(Q.log(), [params] * len(Q))
    draws = _draws(RejectionSampler(seed=1, device=CPU), params, q, mode, seed=2)
    err_first, err_pair = _l1_errors(draws, p)
    assert err_first < _l1_bound(6, N_ROWS), (case, err_first)
    assert err_pair < _l1_bound(36, N_ROWS), (case, err_pair)
    assert bool((p[0][draws[:, 0]] > 0).all() and (p[1][draws[:, 1]] > 0).all())  # none truncated


def test_wrong_samplers_fail_the_same_bound(monkeypatch):
    p = transformed_probs(LOGITS, [RANDOM] * len(LOGITS))
    # Wrong 1: on rejection, draw from p instead of norm(max(p - q, 0)).
    with monkeypatch.context() as m:
        m.setattr(rejection_sampler, "_RESIDUAL_EPS", float("inf"))
        draws = _draws(RejectionSampler(seed=1, device=CPU), RANDOM, Q, "q", seed=2)
    err_first, err_pair = _l1_errors(draws, p)
    assert err_first > _l1_bound(6, N_ROWS) and err_pair > _l1_bound(36, N_ROWS), (err_first, err_pair)
    # Wrong 2: accept with the wrong ratio: told q = p while the drafts come from Q, it computes
    # min(1, p/p) = 1 and accepts every draft, so it emits Q.
    draws = _draws(RejectionSampler(seed=1, device=CPU), RANDOM, Q, "q", seed=2, claimed_q=p)
    err_first, err_pair = _l1_errors(draws, p)
    assert err_first > _l1_bound(6, N_ROWS) and err_pair > _l1_bound(36, N_ROWS), (err_first, err_pair)


# ---- truncation, seeds, edge cases -----------------------------------------------------------
def test_top_k_rejects_drafts_outside_it():
    params = SamplingParams(temperature=1.0, top_k=2)
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0]] * 3)
    top2 = {0, 1}
    drafts = [[3, 0]] * 50  # token 3 has p = 0 under top-k: always rejected, whatever q says
    q = [torch.tensor([[0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])] * 50
    out = RejectionSampler(seed=0, device=CPU)(_flat([logits] * 50), drafts, q, [params] * 50, [None] * 50)
    assert out.num_accepted == [0] * 50
    assert {t[0] for t in out.token_ids} <= top2 and len({t[0] for t in out.token_ids}) == 2


def test_seeded_rows_do_not_depend_on_the_batch():
    vocab = 8
    g = torch.Generator().manual_seed(3)
    la, lb, lc = (torch.randn(n, vocab, generator=g) for n in (4, 3, 1))
    qa, qb = (torch.softmax(torch.randn(n, vocab, generator=g), -1) for n in (3, 2))
    da, db = [1, 2, 3], [4, 5]
    outs = set()
    for seed in range(12):
        alone = RejectionSampler(seed=0, device=CPU)(la, [da], [qa], [RANDOM], [torch.Generator().manual_seed(seed)])
        mixed = RejectionSampler(seed=99, device=CPU)(
            _flat([lb, la, lc]),
            [db, da, []],
            [qb, qa, None],
            [RANDOM, RANDOM, RANDOM],
            [None, torch.Generator().manual_seed(seed), torch.Generator().manual_seed(1234)],
        )
        assert mixed.token_ids[1] == alone.token_ids[0] and mixed.num_accepted[1] == alone.num_accepted[0]
        outs.add(tuple(alone.token_ids[0]))
    assert len(outs) > 1  # the seed matters: the test is not passing on a deterministic row


def test_zero_draft_probability_accepts_iff_target_allows_it():
    vocab = 5
    logits = torch.zeros(3, vocab)
    q = torch.tensor([[0.0, 0.25, 0.25, 0.25, 0.25]] * 2)  # the drafts (token 0) have q = 0, p > 0
    rows = 100
    out = RejectionSampler(seed=0, device=CPU)(
        _flat([logits] * rows), [[0, 0]] * rows, [q] * rows, [RANDOM] * rows, [None] * rows
    )
    assert out.num_accepted == [2] * rows


def test_empty_residual_falls_back_to_p():
    # q >= p everywhere (here q = 2p, an over-estimate): max(p - q, 0) is all zero, yet half the
    # drafts are rejected; the replacement must come from p, never from a zero row.
    logits = torch.tensor([[1.0, 0.0, -1.0, -float("inf")]] * 2)
    p = torch.softmax(logits, -1)
    rows = 400
    out = RejectionSampler(seed=0, device=CPU)(
        _flat([logits] * rows), [[0]] * rows, [2 * p[:1]] * rows, [RANDOM] * rows, [None] * rows
    )
    rejected = [t[0] for t, a in zip(out.token_ids, out.num_accepted) if a == 0]
    assert 100 < len(rejected) < 300
    assert set(rejected) <= {0, 1, 2} and len(set(rejected)) == 3  # from p (token 3 has p = 0)
    # Float noise: q = p plus tiny positive and negative errors still samples valid tokens.
    noisy = p[:1] + torch.tensor([[1e-9, -1e-9, 2e-9, 0.0]])
    out = RejectionSampler(seed=0, device=CPU)(
        _flat([logits] * rows), [[1]] * rows, [noisy] * rows, [RANDOM] * rows, [None] * rows
    )
    assert {t[-1] for t in out.token_ids} <= {0, 1, 2}


def test_no_drafts_and_bad_shapes():
    logits = torch.randn(3, 7)
    out = RejectionSampler(seed=0, device=CPU)(logits, [[], [], []], [None] * 3, [RANDOM, GREEDY, RANDOM], [None] * 3)
    assert out.num_accepted == [0, 0, 0] and all(len(t) == 1 for t in out.token_ids)
    assert out.token_ids[1] == [int(logits[1].argmax())]
    assert RejectionSampler(seed=0, device=CPU)(logits[:0], [], [], [], []).token_ids == []
    with pytest.raises(ValueError, match="sum"):
        RejectionSampler(seed=0, device=CPU)(logits, [[1]], [None], [RANDOM], [None])
    with pytest.raises(ValueError, match="draft_probs"):
        RejectionSampler(seed=0, device=CPU)(logits[:2], [[1]], [torch.ones(2, 7) / 7], [RANDOM], [None])
