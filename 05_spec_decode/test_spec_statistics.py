"""The rejection sampler keeps the target distribution: a statistical test with stated tolerances.

Setting (vLLM's test): vocabulary 10, k = 2, a random target distribution p_j and a random draft
distribution q_j per position j, drafts sampled from q_j. Every emitted token at position j —
accepted draft, recovered token or bonus token — must follow p_j. Rows of the batch are
independent speculative steps, so the sampling loop is one vectorised call.
"""

import pytest
import torch

from spec_decode import num_accepted_tokens, rejection_sample

VOCAB = 10
K = 2
NUM_ROWS = 1_000_000  # enough for >= 100k emitted tokens at the last position
SAMPLE_SIZES = [10, 100, 1_000, 10_000, 100_000]
NUM_REFERENCES = 100
IMPROVEMENT = 20  # vLLM's "shrinks >= 20x faster than to random references"
TV_TOL = 0.01  # at 100k samples; sampling noise alone gives a mean TV of ~0.004
ACCEPT_TOL = 0.01  # acceptance rate over 1M rows: std ~0.0005


def _distributions(seed: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(K + 1, VOCAB, generator=g), -1)
    q = torch.softmax(torch.randn(K, VOCAB, generator=g), -1)
    refs = torch.softmax(torch.randn(NUM_REFERENCES, VOCAB, generator=g), -1)
    return p, q, refs, g


def _run(p, q, n, g):
    draft = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(K)], 1)
    out = rejection_sample(draft, q.expand(n, K, VOCAB), p.expand(n, K + 1, VOCAB), g)
    return draft, out


def _hist(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=VOCAB).double() / tokens.numel()


_SAMPLED: dict[tuple[int, object], tuple] = {}


@pytest.fixture(params=[0, 1])
def sampled(request):
    """The large sample, drawn once per seed and per rejection sampler in place: a module-wide
    fixture would be built with the book's sampler, whatever sampler the test runs with."""
    key = (request.param, rejection_sample)
    if key not in _SAMPLED:
        p, q, refs, g = _distributions(request.param)
        draft, out = _run(p, q, NUM_ROWS, g)
        _SAMPLED[key] = p, q, refs, draft, out
    return _SAMPLED[key]


def test_emitted_tokens_converge_to_target_faster_than_to_references(sampled):
    p, _, refs, _, out = sampled
    for j in range(K + 1):
        emitted = out[:, j][out[:, j] >= 0]
        assert emitted.numel() >= SAMPLE_SIZES[-1], f"position {j}: too few samples"
        to_target, to_refs = [], []
        for n in SAMPLE_SIZES:
            h = _hist(emitted[:n])
            to_target.append(torch.linalg.norm(h - p[j].double()).item())
            to_refs.append(torch.linalg.norm(h - refs.double(), dim=-1).mean().item())
        target_ratio = to_target[0] / to_target[-1]
        ref_ratio = to_refs[0] / to_refs[-1]
        assert target_ratio > IMPROVEMENT * ref_ratio, (j, to_target, to_refs)


def test_total_variation_at_large_sample(sampled):
    p, _, _, _, out = sampled
    for j in range(K + 1):
        emitted = out[:, j][out[:, j] >= 0][: SAMPLE_SIZES[-1]]
        tv = 0.5 * (_hist(emitted) - p[j].double()).abs().sum().item()
        assert tv < TV_TOL, (
            f"position {j}: the emitted tokens are {tv:.4f} (total variation) from the target p, tolerance "
            f"{TV_TOL}: accept draft x with probability min(1, p(x) / q(x)) and, after a rejection, resample "
            "from normalize(max(p - q, 0)), not from p"
        )


def test_first_position_acceptance_is_sum_of_min(sampled):
    p, q, _, _, out = sampled
    accepted = (num_accepted_tokens(out) >= 1).double().mean().item()
    expected = torch.minimum(p[0], q[0]).sum().item()
    assert abs(accepted - expected) < ACCEPT_TOL, (
        f"the first draft was accepted {accepted:.3f} of the time, expected sum(min(p, q)) = {expected:.3f}: "
        "accept while u * q(x) < p(x)"
    )
    # With independent positions the mean tokens per step is 1 + a0 + a0*a1.
    a = torch.minimum(p[:K], q).sum(-1)
    emitted = (out >= 0).sum(1).double().mean().item()
    assert abs(emitted - (1 + a[0] + a[0] * a[1]).item()) < 2 * ACCEPT_TOL


def test_accepted_prefix_is_the_draft(sampled):
    _, _, _, draft, out = sampled
    n_acc = num_accepted_tokens(out)
    for j in range(K):
        rows = n_acc > j
        assert torch.equal(out[rows, j], draft[rows, j]), f"position {j}: an accepted token is the draft itself"
    assert ((out >= 0).sum(1) == n_acc + 1).all(), (
        "each row emits its accepted drafts plus exactly one more token (the resampled or the bonus one), "
        "and only the drafts before the first rejection count as accepted"
    )


def test_the_test_detects_a_wrong_resampling_rule():
    """Resampling from p instead of normalize(max(0, p - q)) after a rejection is biased
    towards the draft's tokens; the TV check above must catch it."""
    p, q, _, g = _distributions(0)
    n = SAMPLE_SIZES[-1]
    x = torch.multinomial(q[0], n, replacement=True, generator=g)
    accept = torch.rand(n, generator=g) * q[0][x] < p[0][x]
    wrong = torch.where(accept, x, torch.multinomial(p[0], n, replacement=True, generator=g))
    tv = 0.5 * (_hist(wrong) - p[0].double()).abs().sum().item()
    assert tv > 5 * TV_TOL, tv
