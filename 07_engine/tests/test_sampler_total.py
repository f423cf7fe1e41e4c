"""The sampler is total: whatever a row's logits hold (``+inf``, ``-inf``, NaN, huge or tiny
numbers) and whatever its settings, it returns an id inside the vocabulary or ``NO_TOKEN``, and
which of the two, and which ids, follow one documented rule (``sampler.resolve_infinite_logits``).

Rows are drawn by Hypothesis (seeded, bounded), not listed: each entry is a finite float of any
magnitude or one of the three non-finite values, each row has its own temperature (0 to 2),
top-k, top-p and seed.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_from_scratch.sampler import NO_TOKEN, Sampler, keep_in_vocabulary, resolve_infinite_logits

V = 12
SETTINGS = settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ENTRY = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.floats(min_value=-30, max_value=30, width=32),
    st.sampled_from([float("inf"), float("-inf"), float("nan")]),
)
ROW = st.lists(ENTRY, min_size=V, max_size=V)


@st.composite
def batches(draw):
    rows = draw(st.lists(ROW, min_size=1, max_size=6))
    n = len(rows)
    temperatures = draw(st.lists(st.sampled_from([0.0, 0.01, 0.5, 1.0, 2.0]), min_size=n, max_size=n))
    top_ks = draw(st.none() | st.lists(st.integers(1, V), min_size=n, max_size=n))
    top_ps = draw(st.none() | st.lists(st.floats(1e-6, 1.0), min_size=n, max_size=n))
    seeds = draw(st.lists(st.none() | st.integers(0, 2**32), min_size=n, max_size=n))
    return rows, temperatures, top_ks, top_ps, seeds


def expected_support(row: list[float], top_k: int | None) -> set[int] | None:
    """The ids the rule allows for ``row`` (None: none, ``NO_TOKEN`` is due): NaN anywhere or no
    logit above -inf leaves none; else the ``+inf`` ids if any, else every id above -inf."""
    if any(math.isnan(x) for x in row) or max(row) == float("-inf"):
        return None
    if max(row) == float("inf"):
        return {i for i, x in enumerate(row) if x == float("inf")}
    support = {i for i, x in enumerate(row) if x > float("-inf")}
    if top_k is not None:  # top-k keeps at most k of them (ties at the k-th: any of the tied)
        kth = sorted(row, reverse=True)[top_k - 1]
        support = {i for i in support if row[i] >= kth}
    return support


@SETTINGS
@given(batches())
def test_every_row_gets_an_id_its_rule_allows_or_no_token(batch):
    rows, temperatures, top_ks, top_ps, seeds = batch
    logits = torch.tensor(rows, dtype=torch.float32)
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    sampled = Sampler.draw(
        logits,
        torch.tensor(temperatures),
        None if top_ks is None else torch.tensor(top_ks),
        None if top_ps is None else torch.tensor(top_ps),
        gens if any(g is not None for g in gens) else None,
    ).tolist()
    for i, (row, token) in enumerate(zip(rows, sampled)):
        support = expected_support(row, None if top_ks is None else top_ks[i])
        if support is None:
            assert token == NO_TOKEN, f"row {i} {row} has no token to draw, but the sampler returned {token}"
        else:
            assert token in support, (
                f"row {i} {row} (temperature {temperatures[i]}, top_k "
                f"{None if top_ks is None else top_ks[i]}) may only give {sorted(support)}, got {token}"
            )
        if temperatures[i] == 0.0 and support is not None:
            first_best = max(support, key=lambda t: (row[t], -t))
            assert token == first_best, f"greedy row {i} {row}: the first largest logit is {first_best}, got {token}"


def test_a_row_of_infinite_logits_is_uniform_over_them():
    # The limit of logits growing without bound: each +inf token as likely as the others.
    row = [float("inf"), 1.0, float("inf"), float("-inf"), float("inf")] + [0.0] * (V - 5)
    logits = torch.tensor([row] * 30_000)
    counts = torch.bincount(Sampler.draw(logits, torch.ones(30_000)), minlength=V)
    assert set(counts.nonzero().flatten().tolist()) == {0, 2, 4}
    # 4 standard deviations of a binomial proportion of 1/3 over 30k draws: 0.011.
    assert (counts[[0, 2, 4]].float() / 30_000 - 1 / 3).abs().max() < 0.011, counts.tolist()


def test_rows_without_infinity_pass_through_untouched():
    logits = torch.randn(4, V)
    logits[1, 3] = float("-inf")
    resolved, has_token = resolve_infinite_logits(logits)
    assert resolved is logits and has_token.all()


def test_ids_outside_the_vocabulary_become_no_token():
    ids = torch.tensor([0, V - 1, V, -1, -7, 2**40])
    assert keep_in_vocabulary(ids, V).tolist() == [0, V - 1, NO_TOKEN, NO_TOKEN, NO_TOKEN, NO_TOKEN]
