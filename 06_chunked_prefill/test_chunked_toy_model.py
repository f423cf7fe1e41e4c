"""One forward over a mixed batch: chunked prefill gives the logits of one full prefill."""

import pytest
import torch

from chunked_prefill import ChunkedPrefillScheduler
from chunked_toy_model import ToyRunner, ToyTransformer
from prefix_block_manager import PrefixCachingBlockManager
from scheduler import Request, Scheduler

BS = 4


@pytest.fixture(scope="module")
def model():
    return ToyTransformer(vocab_size=64, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2, seed=0)


def requests():
    return [
        Request("d1", [1, 2, 3], max_tokens=10, block_size=BS),
        Request("d2", [4, 5, 6, 7, 8], max_tokens=10, block_size=BS),
        Request("long", [(7 * i) % 60 + 1 for i in range(23)], max_tokens=4, block_size=BS),
    ]


def run(model, sched, arrive_at=2, check_logits=True, drafts=False, runner=None):
    """Drive ``sched`` to the end; compare every sampled row's logits with a dense forward."""
    runner = runner or ToyRunner(model, sched.block_manager.num_blocks, BS)
    reqs = requests()
    for r in reqs[:2]:
        sched.add_request(r)
    step, mixed_steps, max_err = 0, 0, 0.0
    while sched.has_requests() or step <= arrive_at:
        if step == arrive_at:
            sched.add_request(reqs[2])
        if drafts:  # propose the model's true continuation: every draft must be accepted
            for r in sched.running:
                if r.num_computed_tokens == r.num_tokens - 1 and r.num_completion_tokens < r.max_tokens - 2:
                    r.spec_token_ids = greedy(model, r.token_ids, 2)
        out = sched.schedule()
        sampled = runner.execute(out)
        chunk_rows = [r for r in out.scheduled_requests if not out.produces_token(r)]
        decode_rows = [r for r in out.scheduled_requests if r.is_decoding]
        mixed_steps += bool(chunk_rows and decode_rows)
        if check_logits:
            for r in out.sampling_requests:
                known = r.token_ids + out.scheduled_spec_decode_tokens.get(r.request_id, [])
                n = len(runner.last_logits[r.request_id])
                ref = model.forward_dense(known)[r.num_tokens - 1 : r.num_tokens - 1 + n]
                max_err = max(max_err, (runner.last_logits[r.request_id] - ref).abs().max().item())
        sched.update_from_output(out, sampled)
        sched.check_invariants()
        step += 1
    assert sched.block_manager.all_blocks_free()
    return {r.request_id: r.completion_token_ids for r in reqs}, mixed_steps, max_err


def greedy(model, tokens, n):
    tokens = list(tokens)
    for _ in range(n):
        tokens.append(int(model.forward_dense(tokens)[-1].argmax()))
    return tokens[-n:]


def test_chunked_prefill_matches_full_prefill_with_decodes_in_the_batch(model):
    whole, _, err_whole = run(model, Scheduler(4, 64, 32, block_size=BS))
    chunked, mixed, err_chunked = run(model, ChunkedPrefillScheduler(4, 6, 32, block_size=BS))
    assert mixed >= 3  # the long prompt really went in chunks next to decoding requests
    assert err_whole < 1e-4 and err_chunked < 1e-4, (
        f"logits differ from a dense forward by {err_whole:.2g} (whole prompts) and {err_chunked:.2g} (chunks): "
        "the batch inputs put a token at the wrong position, row range (cu_seqlens_q), key count (seq_lens_k) or "
        "cache slot (slot_mapping, block_tables), or sampled the logits of the wrong rows (logits_indices)"
    )
    assert chunked == whole
    for r in requests():
        assert chunked[r.request_id] == greedy(model, r.token_ids, r.max_tokens)


def test_chunks_with_prefix_hits_and_threshold(model):
    bm = PrefixCachingBlockManager(32, BS)
    sched = ChunkedPrefillScheduler(4, 8, 32, block_size=BS, block_manager=bm, long_prefill_token_threshold=3)
    runner = ToyRunner(model, bm.num_blocks, BS)  # one KV cache: the hits must find their K/V
    first, _, err = run(model, sched, runner=runner)
    again, _, err2 = run(model, sched, runner=runner)  # the same prompts: blocks come from the cache
    assert bm.prefix_cache_hits > 0 and first == again and max(err, err2) < 1e-4


def test_spec_tokens_in_a_mixed_batch_score_every_position(model):
    plain, _, _ = run(model, ChunkedPrefillScheduler(4, 6, 32, block_size=BS), check_logits=False)
    with_drafts, _, err = run(model, ChunkedPrefillScheduler(4, 6, 32, block_size=BS), drafts=True)
    assert with_drafts == plain and err < 1e-4


def test_dense_reference_is_causal(model):
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    full = model.forward_dense(tokens)
    assert torch.allclose(model.forward_dense(tokens[:5]), full[:5], atol=1e-5)
