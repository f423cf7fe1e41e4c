"""Proposers: n-gram prompt lookup, the cached HF wrapper and the draft-model proposer."""

import pytest
import torch

from proposers import DraftModelProposer, HFCausalLM, NgramProposer, make_truncated_draft
from spec_decode import speculative_decode_step


def test_ngram_copies_what_followed_the_suffix():
    drafts = NgramProposer(1, 2).propose([[1, 2, 3, 4, 1, 2]], 3)
    assert drafts == [[3, 4, 1]], (
        f"the suffix [1, 2] occurred earlier, followed by 3, 4, 1: got {drafts}; search the context before "
        "the suffix itself, or the suffix finds itself with nothing after it"
    )


def test_ngram_prefers_the_longest_match():
    # The 1-gram [9] last occurred before 5, the 2-gram [7, 9] before 4.
    ids = [7, 9, 4, 0, 9, 5, 7, 9]
    assert NgramProposer(1, 1).propose_one(ids, 1) == [5]
    drafts = NgramProposer(1, 2).propose_one(ids, 1)
    assert drafts == [4], f"the longest recurring suffix, [7, 9], wins over [9]: expected [4], got {drafts}"
    assert NgramProposer(2, 2).propose_one(ids, 3) == [4, 0, 9]


def test_ngram_prefers_the_most_recent_occurrence_and_stops_at_the_end():
    ids = [3, 1, 3, 2, 3]
    drafts = NgramProposer(1, 1).propose_one(ids, 4)
    assert drafts == [2, 3], (
        f"[3] occurred at 0 and 2: the most recent occurrence wins and the copy stops at the end, got {drafts}"
    )


def test_ngram_no_match_and_edge_cases():
    p = NgramProposer(2, 3)
    assert p.propose([[1, 2, 3, 4], [5], []], 3) == [[], [], []]
    assert p.propose_one([1, 2, 1, 2], 0) == []
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(0, 2)
    with pytest.raises(ValueError, match="max_n"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="k"):
        p.propose_one([1, 2], -1)


def test_cached_logits_equal_a_fresh_forward(tiny_llama_dir):
    lm = HFCausalLM(tiny_llama_dir)
    ids = [5, 17, 99, 3, 250, 17, 99, 41, 8]
    fresh = lm.model(torch.tensor([ids])).logits[0].float()
    assert torch.allclose(lm.get_logits(ids[:6], 2), fresh[4:6], atol=1e-4)
    # Extends the cache by three tokens, then rolls it back as after a rejected draft.
    assert torch.allclose(lm.get_logits(ids, 3), fresh[6:9], atol=1e-4)
    assert torch.allclose(
        lm.get_logits(ids[:7] + [1], 1), lm.model(torch.tensor([ids[:7] + [1]])).logits[0, -1:].float(), atol=1e-4
    )
    # Every token is already cached (a shorter context than the last call): the position whose
    # logits are wanted is still run through the model, never read from nowhere.
    assert torch.allclose(lm.get_logits(ids[:5], 1), fresh[4:5], atol=1e-4), (
        "ids[:5] is a prefix of the cached ids: reuse at most len - num_logits of them"
    )
    assert lm.num_tokens_computed == 6 + 3 + 1 + 1
    with pytest.raises(ValueError, match="num_logits"):
        lm.get_logits(ids[:2], 3)


def test_draft_model_proposer_greedy_and_sampled_drafts(tiny_llama_dir):
    proposer = DraftModelProposer(tiny_llama_dir)
    contexts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    drafts, probs = proposer.propose(contexts, 3)
    assert [len(d) for d in drafts] == [3, 3] and probs is None  # greedy: q is one-hot
    lm = HFCausalLM(tiny_llama_dir)
    for ctx, row in zip(contexts, drafts):  # each draft is the argmax after the ones before it
        for j, t in enumerate(row):
            assert t == int(lm.get_logits(ctx + row[:j], 1)[0].argmax())
    ids, none = proposer.propose_tensors(contexts, 3)
    assert ids.tolist() == drafts and none is None
    sampler = DraftModelProposer(proposer.lm, temperature=0.8, generator=torch.Generator().manual_seed(0))
    drafts, probs = sampler.propose(contexts, 3)
    assert probs.shape == (2, 3, 512)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))
    assert all(probs[b, j, drafts[b][j]] > 0 for b in range(2) for j in range(3))
    with pytest.raises(ValueError, match="token_ids_list"):
        proposer.propose([[]], 2)
    with pytest.raises(ValueError, match="keys"):
        proposer.propose(contexts, 2, keys=["a"])
    with pytest.raises(ValueError, match="temperature"):
        DraftModelProposer(proposer.lm, temperature=-1)


def test_draft_caches_follow_keys_not_rows(tiny_llama_dir):
    """A request keeps its cache under its key when the batch reorders, and loses it on release."""
    proposer = DraftModelProposer(tiny_llama_dir)
    lm = proposer.lm
    a, b = [5, 6, 7, 8, 9, 10], [20, 21, 22, 23]
    first, _ = proposer.propose([a, b], 2, keys=["a", "b"])
    computed = lm.num_tokens_computed
    swapped, _ = proposer.propose([b + first[1], a + first[0]], 2, keys=["b", "a"])
    # Each cache already holds its context and first draft: one new token per request per position.
    assert lm.num_tokens_computed - computed == 2 * 1 + 2 * 1
    fresh, _ = DraftModelProposer(HFCausalLM(lm.model)).propose([b + first[1], a + first[0]], 2)
    assert swapped == fresh
    proposer.release(["a"])
    computed = lm.num_tokens_computed
    proposer.propose([a], 1, keys=["a"])
    assert lm.num_tokens_computed - computed == len(a)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_equal_to_target_accepts_everything(tiny_llama_dir, temperature):
    target = HFCausalLM(tiny_llama_dir)
    g = torch.Generator().manual_seed(0)
    proposer = DraftModelProposer(target.model, temperature=temperature, generator=g)
    ctx = [5, 17, 99, 3]
    for _ in range(3):
        tokens, stats = speculative_decode_step(target, proposer, ctx, 4, temperature, g)
        assert stats["num_accepted"] == 4 and len(tokens) == 5
        ctx += tokens


def test_truncated_draft_keeps_the_first_layers(tiny_llama_dir, tmp_path):
    out = make_truncated_draft(tiny_llama_dir, 1, tmp_path / "draft")
    full = HFCausalLM(tiny_llama_dir).model
    draft = HFCausalLM(out).model
    assert draft.config.num_hidden_layers == 1
    assert torch.equal(draft.model.layers[0].mlp.up_proj.weight, full.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(draft.lm_head.weight, full.lm_head.weight)
    assert make_truncated_draft(tiny_llama_dir, 1, tmp_path / "draft") == out  # reused
    with pytest.raises(ValueError, match="num_layers"):
        make_truncated_draft(tiny_llama_dir, 3, tmp_path / "bad")
