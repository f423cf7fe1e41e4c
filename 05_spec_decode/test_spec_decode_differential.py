"""Chapter 05's exercises against the book's own functions, on drawn inputs (exercises/differential.py).

Drawn: batches of requests with different numbers of drafts (padded with -1, including none),
vocabularies, draft distributions (one-hot, sampled, equal to the target, with zeros), target
distributions (greedy one-hot, dense, sparse), the sampler's noise given or drawn from a generator,
malformed inputs; token contexts over tiny vocabularies (so suffixes recur) with any n-gram bounds;
model calls that grow, roll back and reuse a cache; vLLM's flattened verification layout.
"""

from __future__ import annotations

import pytest
import torch

from proposers import HFCausalLM, NgramProposer
from rejection_sampler_triton import rejection_sample_triton
from spec_decode import PLACEHOLDER_TOKEN_ID, rejection_sample, rejection_sampling_batched, sample_rejection_noise
from triton_setup import KERNEL_DEVICE

REJECTION = (
    "draft j is accepted while u_j * q(x_j) < p(x_j); at the first rejection the token comes from normalize(max(p - "
    "q, 0)), after all K_i drafts the bonus token from p[K_i], both by the exponential race argmax(w / E) over the "
    "noise's exponentials; -1 after that, and -1 drafts (padding) are never accepted"
)


def _distributions(gen, rows: int, vocab: int, kind: str) -> torch.Tensor:
    if kind == "one-hot":
        return torch.nn.functional.one_hot(torch.randint(0, vocab, (rows,), generator=gen), vocab).float()
    logits = torch.randn(rows, vocab, generator=gen) * 2
    if kind == "sparse":  # tokens a top-k or top-p mask left at zero
        logits = logits.masked_fill(torch.rand(rows, vocab, generator=gen) < 0.5, float("-inf"))
        logits[:, 0] = logits[:, 0].nan_to_num(neginf=0.0)
    return logits.softmax(-1)


def _rejection_case(rng):
    """Drafts, q and p for a batch: requests with up to K drafts (fewer padded with -1)."""
    gen = torch.Generator().manual_seed(rng.getrandbits(32))
    batch, k, vocab = rng.randint(0, 4), rng.randint(0, 4), rng.randint(2, 12)
    num_drafts = [rng.randint(0, k) for _ in range(batch)]
    target = _distributions(gen, batch * (k + 1), vocab, rng.choice(["one-hot", "dense", "sparse"]))
    target = target.view(batch, k + 1, vocab)
    q_kind = rng.choice(["none", "dense", "sparse", "equal to p"])
    if q_kind == "none":  # deterministic drafts: q is one-hot, passed as None
        draft_probs = None
        drafts = torch.randint(0, vocab, (batch, k), generator=gen)
        for b in range(batch):  # drafts the target likes half the time, so some are accepted
            for j in range(k):
                if rng.random() < 0.5:
                    drafts[b, j] = int(target[b, j].argmax())
    else:
        draft_probs = (
            target[:, :k].clone() if q_kind == "equal to p" else _distributions(gen, batch * k, vocab, q_kind)
        ).view(batch, k, vocab)
        drafts = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(batch, k) if k else (
            torch.zeros(batch, 0, dtype=torch.long)
        )  # fmt: skip
    for b, n in enumerate(num_drafts):
        drafts[b, n:] = PLACEHOLDER_TOKEN_ID
    if batch and rng.random() < 0.1:  # inputs the sampler must refuse
        bad = rng.choice(["id past the vocabulary", "padding before a draft", "p does not sum to 1"])
        if bad == "id past the vocabulary" and k:
            drafts[0, 0] = vocab
        elif bad == "padding before a draft" and k > 1:
            drafts[0, 0], drafts[0, 1] = PLACEHOLDER_TOKEN_ID, 0
        elif bad == "p does not sum to 1":
            target = target * 2
    return drafts, draft_probs, target, q_kind


def _check_rejection(differential, rng, yours, book, device="cpu"):
    drafts, draft_probs, target, q_kind = _rejection_case(rng)
    batch, k = drafts.shape
    vocab = target.shape[-1]
    # A CPU generator cannot draw on a GPU: there the noise is drawn on the CPU and passed in.
    seed, given = rng.getrandbits(32), rng.random() < 0.5 or device != "cpu"

    def run(fn):
        gen = torch.Generator().manual_seed(seed)
        noise = sample_rejection_noise(batch, k, vocab, "cpu", torch.Generator().manual_seed(seed)) if given else None
        if noise is not None and device != "cpu":
            noise.uniform, noise.exponential = noise.uniform.to(device), noise.exponential.to(device)
        q = None if draft_probs is None else draft_probs.to(device)
        return differential.call(fn, drafts.to(device), q, target.to(device), None if given else gen, noise=noise)

    differential.agree(
        f"{getattr(book, '__name__', 'rejection sampler')}(draft_token_ids={drafts.tolist()}, draft_probs: "
        f"{q_kind}, target_probs: [{batch}, {k + 1}, {vocab}], "
        f"{'noise=' if given else 'generator='}<seed {seed}>)",
        run(yours),
        run(book),
        meaning=REJECTION,
    )


def test_rejection_sample(differential):
    book = differential.book(rejection_sample)
    differential.run(lambda rng: _check_rejection(differential, rng, rejection_sample, book), examples=200)


def test_rejection_sample_triton(differential):
    book = differential.book(rejection_sample_triton)

    def check(rng):
        _check_rejection(differential, rng, rejection_sample_triton, book, device=KERNEL_DEVICE)

    # On a CPU the kernel runs in Triton's interpreter: a few dozen batches.
    differential.run(check, examples=40)


def test_propose_one(differential):
    book_propose = differential.book(NgramProposer.propose_one)

    def check(rng):
        alphabet = rng.randint(1, 4)  # a tiny vocabulary: suffixes recur
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(0, 24))]
        min_n = rng.randint(1, 3)
        proposer = NgramProposer(min_n, rng.randint(min_n, 5))
        k = rng.choice([-1, 0, 1, 3, rng.randint(0, 8)])
        differential.agree(
            f"NgramProposer(min_n={proposer.min_n}, max_n={proposer.max_n}).propose_one({tokens}, k={k})",
            differential.call(NgramProposer.propose_one, proposer, list(tokens), k),
            differential.call(book_propose, proposer, list(tokens), k),
            meaning="for n from max_n down to min_n, find the last n tokens earlier in the context; the longest n "
            "wins, and of its matches the most recent; propose up to k tokens that followed it",
        )

    differential.run(check, examples=250)


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def test_get_logits(differential, tiny_model):
    BookLM = differential.twin(HFCausalLM, "get_logits")

    def check(rng):
        lms = [HFCausalLM(tiny_model), BookLM(tiny_model)]
        contexts = {slot: [rng.randrange(3, 500) for _ in range(rng.randint(1, 12))] for slot in range(2)}
        history = []
        for _ in range(rng.randint(1, 6)):
            slot = rng.randrange(2)
            ids = contexts[slot]
            move = rng.choice(["extend", "roll back", "same", "shorter", "other"])
            if move == "extend":
                ids = ids + [rng.randrange(3, 500) for _ in range(rng.randint(1, 4))]
            elif move == "roll back" and len(ids) > 1:  # rejected drafts: a shorter prefix, then new tokens
                ids = ids[: rng.randint(1, len(ids) - 1)] + [rng.randrange(3, 500)]
            elif move == "shorter" and len(ids) > 1:
                ids = ids[: rng.randint(1, len(ids) - 1)]
            elif move == "other":
                ids = [rng.randrange(3, 500) for _ in range(rng.randint(1, 8))]
            contexts[slot] = ids
            num_logits = rng.choice([1, 1, rng.randint(0, len(ids) + 1)])
            history.append(f"get_logits({ids}, num_logits={num_logits}, slot={slot})")
            outs = [differential.call(lm.get_logits, list(ids), num_logits, slot) for lm in lms]

            def state(lm):
                cached = {s: ids for s, (_, ids) in sorted(lm._caches.items())}
                return {"forwards": lm.num_forwards, "tokens computed": lm.num_tokens_computed, "cached ids": cached}

            differential.agree(
                " -> ".join(history),
                *outs,
                meaning="the logits of the last num_logits positions, computed from the slot's cache cropped to the "
                "longest common prefix (at most len - num_logits tokens, so the wanted positions run), counting "
                "one forward and the tokens run",
                atol=1e-4,
                rtol=1e-4,
                state=(state(lms[0]), state(lms[1])),
            )

    differential.run(check, examples=40)


def test_rejection_sampling_batched(differential):
    book_batched = differential.book(rejection_sampling_batched)

    def check(rng):
        k, vocab = rng.randint(0, 4), rng.randint(1, 4)
        counts = [rng.randint(1, k + 1) for _ in range(rng.randint(0, 5))]
        total = sum(counts)
        gen = torch.Generator().manual_seed(rng.getrandbits(32))
        target = torch.randint(0, vocab, (total,), generator=gen)
        drafts = torch.where(torch.rand(total, generator=gen) < 0.6, target.roll(-1), torch.randint(0, vocab, (total,)))
        cu = [0]
        for c in counts:
            cu.append(cu[-1] + c)
        if rng.random() < 0.1:  # offsets the function must refuse
            bad = rng.choice(["too many", "none", "short"])
            if bad == "too many" and counts:
                cu[-1] += k + 1
            elif bad == "none" and len(cu) > 1:
                cu.append(cu[-1])
            elif bad == "short" and total:
                target, drafts = target[:-1], drafts[:-1]
        cu_num_logits = torch.tensor(cu, dtype=rng.choice([torch.int32, torch.int64]))
        differential.agree(
            f"rejection_sampling_batched(target_sampled={target.tolist()}, draft_tokens={drafts.tolist()}, "
            f"cu_num_logits={cu}, num_speculative_steps={k})",
            differential.call(rejection_sampling_batched, target.clone(), drafts.clone(), cu_num_logits, k),
            differential.call(book_batched, target.clone(), drafts.clone(), cu_num_logits, k),
            meaning="request r owns flat positions cu[r]:cu[r+1]; position i verifies draft_tokens[i + 1]; keep the "
            "target tokens up to and including the first mismatch, -1 after, and count them (int32)",
        )

    differential.run(check, examples=250)
