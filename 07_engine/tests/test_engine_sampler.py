"""The sampler: greedy, temperature, top-k, top-p and seeded rows, all in one vectorized call."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vllm_from_scratch.sampler import ARGMAX_CHUNK, Sampler, apply_top_k_top_p, argmax_by_chunks, exponential_noise

V = 8


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_rows_are_argmax_even_in_a_sampled_batch():
    logits = _logits(4)
    temps = torch.tensor([0.0, 1.0, 0.0, 0.7])
    out = Sampler.draw(logits, temps)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_top_k_one_is_greedy_and_top_p_keeps_at_least_one():
    logits = _logits(3, 1)
    temps = torch.ones(3)
    top_k = Sampler.draw(logits, temps, top_ks=torch.tensor([1, 1, 1]))
    assert torch.equal(top_k, logits.argmax(-1)), (
        f"top_k = 1 keeps only the most likely token (ranks >= top_k are masked, counting from 0): sampled "
        f"{top_k.tolist()}, argmax {logits.argmax(-1).tolist()}"
    )
    top_p = Sampler.draw(logits, temps, top_ps=torch.tensor([1e-6] * 3))
    assert torch.equal(top_p, logits.argmax(-1)), (
        f"a tiny top_p still keeps the most likely token (a token is dropped when the tokens before it reach "
        f"top_p): sampled {top_p.tolist()}, argmax {logits.argmax(-1).tolist()}"
    )


def test_top_k_top_p_masks_match_a_per_row_reference():
    logits = _logits(5, 2)
    top_ks = torch.tensor([2, V, 5, 1, 3, 3, 3])
    top_ps = torch.tensor([1.0, 0.5, 0.8, 1.0, 0.3, 0.5, 0.0])
    # Two nearly flat rows: top-p's mass is over what top-k left, renormalized (the first three
    # hold ~1/3 each, so 0.5 keeps two, where the whole vocabulary's mass would keep three), and
    # even top_p = 0 keeps the most likely token.
    flat = torch.tensor([[4.0, 3.9, 3.8, 3.7, 3.6, 3.5, 3.4, 3.3]])
    logits = torch.cat([logits, flat, flat])
    masked = apply_top_k_top_p(logits, top_ks, top_ps)
    for row in range(len(logits)):
        order = logits[row].argsort(descending=True)
        keep = set(order[: top_ks[row]].tolist())
        probs = logits[row, order[: top_ks[row]]].softmax(-1)
        cum, kept_p = 0.0, set()
        for tok, p in zip(order[: top_ks[row]].tolist(), probs.tolist()):
            if cum >= top_ps[row]:
                break
            kept_p.add(tok)
            cum += p
        expected = (keep & kept_p) or {int(order[0])}
        kept = {i for i in range(V) if masked[row, i] > float("-inf")}
        assert kept == expected, (
            f"row {row} (top_k={int(top_ks[row])}, top_p={float(top_ps[row])}): kept {sorted(kept)}, expected "
            f"{sorted(expected)}; top-p counts the mass of what top-k left, renormalized, and never drops the top token"
        )


def test_sample_from_probs_draws_from_each_row():
    torch.manual_seed(0)
    n = 20_000
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0] + [0.0] * (V - 4)]).expand(n, V)
    freq = torch.bincount(Sampler.sample_from_probs(probs), minlength=V).float() / n
    # 4 standard deviations of a binomial proportion at n = 20k: about 0.014 at most.
    assert (freq - probs[0]).abs().max() < 0.015, (
        f"token frequencies {freq[:4].tolist()} over {n} draws from {probs[0, :4].tolist()}: a sample is a "
        "random draw from the row's distribution, not its most likely token"
    )


def test_sampled_frequencies_follow_the_tempered_distribution():
    torch.manual_seed(0)
    logits = _logits(1, 3)
    temp = 0.8
    n = 40_000
    out = Sampler.draw(logits.expand(n, V), torch.full((n,), temp))
    freq = torch.bincount(out, minlength=V).float() / n
    expected = (logits[0] / temp).softmax(-1)
    # 4 standard deviations of a binomial proportion at n = 40k: about 0.01 at most.
    assert (freq - expected).abs().max() < 4 * (0.25 / n) ** 0.5 + 1e-3


def test_seeded_rows_ignore_the_rest_of_the_batch():
    # Flat rows: any draw that leans on the batch's generator shows as a different token for
    # some of the 20 batch seeds (all 20 alike by chance: 8^-19).
    logits = torch.zeros(3, V)
    temps = torch.ones(3)

    def run(batch_seed: int) -> int:
        torch.manual_seed(batch_seed)
        gens = [None, torch.Generator().manual_seed(7), None]
        return int(Sampler.draw(logits, temps, generators=gens)[1])

    tokens = {run(seed) for seed in range(20)}
    assert len(tokens) == 1, (
        f"the seeded row drew {sorted(tokens)} over 20 batch seeds: its noise must come from its own "
        "generator alone, not from the default one the rest of the batch uses"
    )
    unseeded = {int(Sampler.draw(logits, temps)[1]) for _ in range(20)}
    assert len(unseeded) > 1, f"20 draws from a flat row gave only {unseeded}: the row is not sampled"


def test_a_generator_on_another_device_than_the_noise_is_refused():
    """The CUDA failure ("Expected a 'cuda' device type for generator") caught on any machine:
    ``meta`` tensors stand in for the GPU, where a CPU generator would otherwise pass silently."""
    probs = torch.full((3, V), 1 / V, device="meta")
    with pytest.raises(ValueError, match="generators"):
        Sampler.sample_from_probs(probs, [None, torch.Generator().manual_seed(7), None])
    assert Sampler.sample_from_probs(probs).shape == (3,)  # unseeded rows draw on the tensors' device


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)],
)
def test_inverse_transform_on_the_device_skips_masked_tokens_and_keeps_seeded_rows_alone(device):
    """The draw the engine makes on its own device: a token of probability 0 (first, middle or
    last in its row) is never drawn, and a seeded row equals the same generator's draw alone."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.25, 0.0, 0.75, 0.0]], device=device).repeat(256, 1)
    draws = Sampler.sample_from_probs(probs)
    assert set(draws[0::2].tolist()) == {1, 3} and set(draws[1::2].tolist()) == {0, 2}
    seeded_rows = range(0, 64, 4)  # 16 rows of two outcomes each: all equal by chance is 2^-16

    def generator(row: int) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(100 + row)

    gens: list[torch.Generator | None] = [None] * probs.shape[0]
    for row in seeded_rows:
        gens[row] = generator(row)
    in_batch = Sampler.sample_from_probs(probs, gens)
    alone = [int(Sampler.sample_from_probs(probs[row : row + 1], [generator(row)])[0]) for row in seeded_rows]
    assert [int(in_batch[row]) for row in seeded_rows] == alone


def test_exponential_noise_is_positive_and_a_seeded_row_is_its_generators_alone():
    gens = [None, torch.Generator().manual_seed(3)]
    noise = exponential_noise(2, 1000, torch.device("cpu"), gens)
    assert bool((noise > 0).all()) and noise.isfinite().all()
    alone = exponential_noise(1, 1000, torch.device("cpu"), [torch.Generator().manual_seed(3)])
    assert torch.equal(noise[1], alone[0])


def test_compute_probs_is_one_hot_for_greedy_rows():
    logits = _logits(2, 5)
    probs = Sampler.compute_probs(logits, torch.tensor([0.0, 1.0]))
    assert probs[0].max() == 1.0 and probs[0].argmax() == logits[0].argmax()
    torch.testing.assert_close(probs[1], logits[1].softmax(-1))


@settings(max_examples=80, deadline=None, derandomize=True)
@example(rows=3, vocab=2 * ARGMAX_CHUNK, levels=2, infinities="none", seed=0)  # whole chunks, no tail
@example(rows=3, vocab=ARGMAX_CHUNK - 1, levels=2, infinities="none", seed=0)  # no whole chunk
@given(
    rows=st.integers(0, 5),
    vocab=st.integers(1, 3 * ARGMAX_CHUNK + 40),
    levels=st.integers(1, 6),
    infinities=st.sampled_from(["none", "-inf", "+inf", "both"]),
    seed=st.integers(0, 2**16),
)
def test_argmax_by_chunks_is_torchs_argmax_ties_and_infinities_included(rows, vocab, levels, infinities, seed):
    """Drawn from a few levels, so ties inside a chunk, across chunks and with the tail are
    common; the first of them must win, as in torch's argmax."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=g).float()
    if infinities != "none":
        where = torch.rand(rows, vocab, generator=g) < 0.05
        logits[where] = float("-inf") if infinities == "-inf" else float("inf")
        if infinities == "both":
            logits[torch.rand(rows, vocab, generator=g) < 0.02] = float("-inf")
    assert torch.equal(argmax_by_chunks(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_argmax_by_chunks_on_the_device_is_torchs_argmax(device):
    """The path the sampler takes on the engine's own device (a GPU keeps torch's argmax): ties
    across chunks, a winner in the tail, and one inside a middle chunk."""
    logits = torch.zeros(3, 2 * ARGMAX_CHUNK + 5, device=device)
    logits[0, [3, ARGMAX_CHUNK + 3]] = 2.0  # a tie across chunks: the first wins
    logits[1, -2] = 1.0  # only the tail holds the maximum
    logits[2, ARGMAX_CHUNK + 17] = 5.0
    picked = argmax_by_chunks(logits)
    assert picked.device == logits.device and torch.equal(picked, logits.argmax(dim=-1))
    assert picked.tolist() == [3, 2 * ARGMAX_CHUNK + 3, ARGMAX_CHUNK + 17]


def test_argmax_by_chunks_gives_a_row_with_a_nan_an_index_in_the_vocabulary():
    logits = torch.zeros(2, 2 * ARGMAX_CHUNK + 3)
    logits[0, ARGMAX_CHUNK + 7] = float("nan")
    logits[1, -1] = float("nan")
    assert ((0 <= argmax_by_chunks(logits)) & (argmax_by_chunks(logits) < logits.shape[1])).all()
