"""The rejection sampler's exact behaviour: torch vs Triton, greedy, padding, errors.

The Triton sampler runs where Triton kernels run here (``triton_setup.KERNEL_DEVICE``): on CPU
tensors in the interpreter, on CUDA tensors where the kernel is compiled.
"""

import pytest
import torch

from rejection_sampler_triton import rejection_sample_triton
from spec_decode import (
    RejectionNoise,
    num_accepted_tokens,
    one_hot_draft_probs,
    pad_draft_token_ids,
    probs_from_logits,
    rejection_sample,
    rejection_sampling_batched,
    sample_rejection_noise,
)
from triton_setup import KERNEL_DEVICE


def triton_sampler(draft_token_ids, draft_probs, target_probs, generator=None, *, noise=None, block_v=1024):
    """``rejection_sample_triton`` on the kernel's device, its tokens back on the CPU.

    On the CPU that is the sampler itself. On a GPU the inputs move to CUDA, and the noise is drawn
    first on the CPU from ``generator``, as the interpreted sampler draws it, so that both samplers
    still see the same noise from the same generator.
    """
    if KERNEL_DEVICE == "cpu":
        return rejection_sample_triton(
            draft_token_ids, draft_probs, target_probs, generator, noise=noise, block_v=block_v
        )
    if noise is None and draft_token_ids.dim() == 2 and target_probs.dim() == 3:  # else validation refuses them
        noise = sample_rejection_noise(*draft_token_ids.shape, target_probs.shape[-1], "cpu", generator)

    def to(t):
        return None if t is None else t.to(KERNEL_DEVICE)

    if noise is not None:
        noise = RejectionNoise(to(noise.uniform), to(noise.exponential))
    out = rejection_sample_triton(to(draft_token_ids), to(draft_probs), to(target_probs), noise=noise, block_v=block_v)
    return out.cpu()


# The Triton case keeps the sampler's name as its id: exercise 05.3 selects tests by it.
SAMPLERS = [rejection_sample, pytest.param(triton_sampler, id="rejection_sample_triton")]


def _case(B, K, V, seed, sharpness=2.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(B, K + 1, V, generator=g) * sharpness, -1)
    draft = torch.softmax(torch.randn(B, K, V, generator=g) * sharpness, -1)
    # Mix the draft towards the target so that some requests accept several tokens.
    draft = 0.5 * draft + 0.5 * target[:, :K]
    ids = torch.multinomial(draft.reshape(-1, V), 1, generator=g).reshape(B, K)
    return ids.to(device), draft.to(device), target.to(device), g


@pytest.mark.parametrize("B,K,V,block_v", [(8, 3, 37, 16), (5, 1, 64, 64), (4, 4, 130, 32)])
@pytest.mark.parametrize("seed", [0, 1])
def test_triton_matches_torch_exactly(B, K, V, block_v, seed):
    ids, draft, target, g = _case(B, K, V, seed)
    ids[1, K - 1 :] = -1  # a request with fewer drafts
    noise = sample_rejection_noise(B, K, V, generator=g)
    expected = rejection_sample(ids, draft, target, noise=noise)
    got = triton_sampler(ids, draft, target, noise=noise, block_v=block_v)
    assert torch.equal(got, expected)


def test_same_generator_state_gives_same_tokens_in_both():
    ids, draft, target, _ = _case(6, 3, 40, 3)
    a = rejection_sample(ids, draft, target, torch.Generator().manual_seed(7))
    b = triton_sampler(ids, draft, target, torch.Generator().manual_seed(7), block_v=16)
    assert torch.equal(a, b)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_output_layout(sampler):
    ids, draft, target, g = _case(16, 3, 20, 5)
    out = sampler(ids, draft, target, g)
    assert out.shape == (16, 4) and out.dtype == torch.long
    n_acc = num_accepted_tokens(out)
    for b in range(16):
        n = int(n_acc[b])
        assert out[b, :n].tolist() == ids[b, :n].tolist()
        assert 0 <= out[b, n] < 20
        assert (out[b, n + 1 :] == -1).all()


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_greedy_is_exact_match_verification(sampler):
    """One-hot p and q: accept iff the draft is the target's argmax, then emit the argmax."""
    g = torch.Generator().manual_seed(0)
    B, K, V = 6, 4, 25
    logits = torch.randn(B, K + 1, V, generator=g)
    target = probs_from_logits(logits, 0.0)
    greedy = logits.argmax(-1)
    ids = greedy[:, :K].clone()
    for b in range(B):  # break the draft at position b (none when b >= K)
        if b < K:
            ids[b, b] = (ids[b, b] + 1) % V
    outs = [sampler(ids, None, target, torch.Generator().manual_seed(s)) for s in range(3)]
    assert all(torch.equal(o, outs[0]) for o in outs), "greedy must not depend on the seed"
    for b in range(B):
        n = min(b, K)
        assert outs[0][b, : n + 1].tolist() == greedy[b, : n + 1].tolist()
        assert (outs[0][b, n + 1 :] == -1).all()


def test_greedy_agrees_with_the_seed_batched_layout():
    """rejection_sampling_batched (flattened, cu_num_logits) == rejection_sample on one-hot p."""
    g = torch.Generator().manual_seed(1)
    K, V = 3, 12
    num_drafts = [3, 1, 0, 2]
    drafts = [torch.randint(0, V, (n,), generator=g).tolist() for n in num_drafts]
    logits = torch.randn(len(drafts), K + 1, V, generator=g)
    for b, d in enumerate(drafts):  # make some drafts right
        for j, t in enumerate(d[:2]):
            logits[b, j, t] += 10.0
    target_tok = logits.argmax(-1)
    ids = pad_draft_token_ids(drafts, K)
    expected = rejection_sample(ids, None, probs_from_logits(logits, 0.0))

    target_flat, input_flat, cu = [], [], [0]
    for b, d in enumerate(drafts):
        target_flat += target_tok[b, : len(d) + 1].tolist()
        input_flat += [0] + d  # the token before the drafts, then the drafts
        cu.append(cu[-1] + len(d) + 1)
    sampled, num_sampled = rejection_sampling_batched(
        torch.tensor(target_flat), torch.tensor(input_flat), torch.tensor(cu), K
    )
    assert torch.equal(sampled, expected), (
        f"got {sampled.tolist()}, expected {expected.tolist()}: position i's target token is checked against "
        "the next input id, draft_tokens[i + 1], and the target's token at the first mismatch is kept"
    )
    assert num_sampled.tolist() == (num_accepted_tokens(expected) + 1).tolist()


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_identical_draft_and_target_accept_everything(sampler):
    _, _, target, g = _case(32, 3, 50, 2)
    ids = torch.multinomial(target[:, :3].reshape(-1, 50), 1, generator=g).reshape(32, 3)
    out = sampler(ids, target[:, :3].clone(), target, g)
    assert (num_accepted_tokens(out) == 3).all()
    assert torch.equal(out[:, :3], ids)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_zero_draft_tokens_gives_a_plain_sample(sampler):
    g = torch.Generator().manual_seed(4)
    target = torch.softmax(torch.randn(3, 1, 9, generator=g), -1)
    noise = RejectionNoise(torch.empty(3, 0), torch.ones(3, 9))
    out = sampler(torch.empty(3, 0, dtype=torch.long), None, target, noise=noise)
    assert out[:, 0].tolist() == target[:, 0].argmax(-1).tolist()  # argmax(p / 1)


def test_one_hot_draft_probs_and_padding():
    ids = pad_draft_token_ids([[2, 0], [1], []], 2)
    assert ids.tolist() == [[2, 0], [1, -1], [-1, -1]]
    q = one_hot_draft_probs(ids, 3)
    assert q[0, 0].tolist() == [0, 0, 1] and q[1, 1].tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="drafts"):
        pad_draft_token_ids([[1, 2, 3]], 2)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_invalid_arguments_raise_value_error(sampler):
    ids, draft, target, _ = _case(2, 2, 5, 0)
    with pytest.raises(ValueError, match="draft_token_ids"):
        sampler(ids[0], draft, target)
    with pytest.raises(ValueError, match="draft_token_ids"):
        sampler(ids.int(), draft, target)
    with pytest.raises(ValueError, match="target_probs"):
        sampler(ids, draft, target[:, :2])
    with pytest.raises(ValueError, match="draft_probs"):
        sampler(ids, draft[:, :, :4], target)
    with pytest.raises(ValueError, match="target_probs.*sum to one"):
        sampler(ids, draft, target * 1.1)
    with pytest.raises(ValueError, match="draft_probs.*sum to one"):
        sampler(ids, draft * 0.5, target)
    neg = draft.clone()
    neg[0, 0, 0] = -0.1
    neg[0, 0, 1] += 0.1
    with pytest.raises(ValueError, match="draft_probs.*non-negative"):
        sampler(ids, neg, target)
    bad = ids.clone()
    bad[0, 0] = 5
    with pytest.raises(ValueError, match="draft_token_ids"):
        sampler(bad, draft, target)
    bad[0] = torch.tensor([-1, 3])
    with pytest.raises(ValueError, match="padding"):
        sampler(bad, draft, target)


def test_triton_block_v_must_be_power_of_two():
    ids, draft, target, _ = _case(2, 2, 5, 0)
    with pytest.raises(ValueError, match="block_v"):
        rejection_sample_triton(ids, draft, target, block_v=24)


def test_probs_from_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert probs_from_logits(logits, 0.0).tolist() == [[0.0, 1.0, 0.0]]
    assert torch.allclose(probs_from_logits(logits, 2.0), torch.softmax(logits / 2, -1))
    with pytest.raises(ValueError, match="temperature"):
        probs_from_logits(logits, -1.0)


def test_rejection_sampling_batched_rejects_bad_offsets():
    t = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="cu_num_logits"):
        rejection_sampling_batched(t, t, torch.tensor([0, 2]), 2)
    with pytest.raises(ValueError, match="cu_num_logits"):
        rejection_sampling_batched(t, t, torch.tensor([0, 0, 3]), 2)
    with pytest.raises(ValueError, match="cu_num_logits"):
        rejection_sampling_batched(t, t, torch.tensor([0, 3]), 1)


@pytest.mark.cuda
def test_triton_matches_torch_on_gpu():
    ids, draft, target, _ = _case(64, 4, 1000, 0, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    noise = sample_rejection_noise(64, 4, 1000, "cuda", g)
    expected = rejection_sample(ids, draft, target, noise=noise)
    got = rejection_sample_triton(ids, draft, target, noise=noise, block_v=256)
    assert torch.equal(got, expected)
