"""Chapter 06: the chunked-prefill scheduler, SchedulerInfo and the flat inputs of a mixed batch."""

import pytest
import torch

from block_manager import BlockManager
from chunked_prefill import ChunkedPrefillScheduler, SchedulerInfo, build_batch_inputs
from chunked_prefill_testing import FakeBatchModel
from scheduler import Request, Scheduler
from scheduler_testing import run_random_workload

BS = 4


def req(rid, n, max_tokens=4, start=10):
    return Request(rid, list(range(start, start + n)), max_tokens=max_tokens, block_size=BS)


def step(sched, default=7):
    out = sched.schedule()
    sched.update_from_output(out, {r.request_id: [default] for r in out.sampling_requests})
    sched.check_invariants()
    return out


def scheduled(out):
    return [(r.request_id, out.num_scheduled_tokens[r.request_id]) for r in out.scheduled_requests]


def test_long_prompt_is_accepted_and_split_under_the_budget():
    s = ChunkedPrefillScheduler(max_num_seqs=4, max_num_batched_tokens=8, num_gpu_blocks=16, block_size=BS)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(4, 8, 16, block_size=BS).add_request(req("p", 20))
    s.add_request(req("p", 20, max_tokens=2))
    outs = [step(s) for _ in range(3)]
    assert [scheduled(o) for o in outs] == [[("p", 8)], [("p", 8)], [("p", 4)]]
    assert [o.sampling_request_ids for o in outs] == [set(), set(), {"p"}]  # only the last chunk samples
    assert [o.num_computed_tokens["p"] for o in outs] == [0, 8, 16]
    assert s.requests["p"].completion_token_ids == [7]
    assert scheduled(step(s)) == [("p", 1)] and not s.has_requests()
    assert s.block_manager.all_blocks_free()


def test_long_prefill_token_threshold_caps_each_chunk():
    s = ChunkedPrefillScheduler(4, 16, 32, block_size=BS, long_prefill_token_threshold=5)
    s.add_request(req("a", 12))
    s.add_request(req("b", 7, start=50))
    assert scheduled(step(s)) == [("a", 5), ("b", 5)]
    assert scheduled(step(s)) == [("a", 5), ("b", 2)]  # b is on its last chunk: it samples
    assert scheduled(step(s)) == [("b", 1), ("a", 2)]  # b decodes, first; a finishes its prompt
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        ChunkedPrefillScheduler(4, 16, 32, block_size=BS, long_prefill_token_threshold=-1)


def test_decodes_are_never_starved_by_a_long_prefill():
    s = ChunkedPrefillScheduler(max_num_seqs=4, max_num_batched_tokens=6, num_gpu_blocks=64, block_size=BS)
    s.add_request(req("d1", 2, max_tokens=30, start=100))
    s.add_request(req("d2", 2, max_tokens=30, start=200))
    step(s)
    s.add_request(req("long", 40, max_tokens=2))
    for i in range(10):  # 40 tokens at 4 per step, while d1 and d2 decode every step
        out = step(s)
        assert scheduled(out) == [("d1", 1), ("d2", 1), ("long", 4)]
        assert out.produces_token("long") == (i == 9)


def test_decodes_go_first_even_behind_a_prefill_in_the_running_list():
    s = ChunkedPrefillScheduler(4, 6, 64, block_size=BS, long_prefill_token_threshold=2)
    s.add_request(req("long", 40, max_tokens=2))
    s.add_request(req("d", 2, max_tokens=30, start=100))
    assert scheduled(step(s)) == [("long", 2), ("d", 2)]
    assert [r.request_id for r in s.running] == ["long", "d"]
    s.long_prefill_token_threshold = None  # now long alone could take the whole budget
    assert scheduled(step(s)) == [("d", 1), ("long", 5)]
    # The order is a view for phase 1 only: self.running keeps admission order (FCFS preempts its
    # end), and preemption edits it while phase 1 walks the order, so the order is a new list.
    order = s._running_order()
    assert [r.request_id for r in s.running] == ["long", "d"] and order is not s.running, (
        "_running_order must return a new list and leave self.running in admission order"
    )


def test_chunked_scheduler_keeps_chapter_04_behaviour_when_everything_fits():
    a, b = Scheduler(4, 64, 32, block_size=BS), ChunkedPrefillScheduler(4, 64, 32, block_size=BS)
    for s in (a, b):
        s.add_request(req("x", 9))
        s.add_request(req("y", 5, start=60))
    for _ in range(4):
        assert scheduled(step(a)) == scheduled(step(b))


def test_scheduler_info_describes_a_mixed_batch():
    s = ChunkedPrefillScheduler(max_num_seqs=4, max_num_batched_tokens=8, num_gpu_blocks=32, block_size=BS)
    s.add_request(req("d", 3, max_tokens=9, start=1))
    step(s)  # d: 3 prompt tokens + 1 sampled (7)
    s.add_request(req("p", 10, max_tokens=2, start=20))
    s.requests["d"].spec_token_ids = [8, 9]
    out = s.schedule()
    info = SchedulerInfo.from_scheduler_output(out)
    assert info.ids == ["d", "p"]
    assert info.chunk_prompts == [[7, 8, 9], [20, 21, 22, 23, 24]]
    assert info.merge_prompt == [7, 8, 9, 20, 21, 22, 23, 24]
    assert info.chunk_idx == [0, 3] and info.chunk_len == [3, 5]
    assert info.kv_len == [3, 0] and info.kv_page_len == [2, 2]
    assert info.block_tables == [r.block_table for r in out.scheduled_requests]
    assert info.is_decoding == [True, False] and info.last_pos == [2, -1] and info.num_spec == [2, 0], (
        f"is_decoding {info.is_decoding}, last_pos {info.last_pos}, num_spec {info.num_spec}: d decodes with 2 "
        "drafts and samples at its last position; p's chunk ends mid-prompt, so it samples nothing (last_pos -1)"
    )
    assert (info.decoding_batch, info.prefill_batch) == (1, 1)
    assert info.logits_indices == [0, 1, 2]  # every position of the row with 2 drafts
    assert info.num_sample_rows == [3, 0]

    inp = build_batch_inputs(info, BS)
    assert inp.input_ids.tolist() == info.merge_prompt
    assert inp.positions.tolist() == [3, 4, 5, 0, 1, 2, 3, 4], (
        f"positions {inp.positions.tolist()}: each chunk continues after the tokens already in its cache "
        "(d has 3), it does not restart at 0"
    )
    md = inp.attn_metadata
    assert md.cu_seqlens_q.tolist() == [0, 3, 8] and md.seq_lens_k.tolist() == [6, 5], (
        f"cu_seqlens_q {md.cu_seqlens_q.tolist()}: a leading 0, then the running sum of the chunk lengths"
    )
    bm = s.block_manager
    d, p = out.scheduled_requests
    assert md.slot_mapping.tolist() == bm.slot_mapping(d, 3, 6) + bm.slot_mapping(p, 0, 5)
    assert md.block_tables.tolist() == [d.block_table, p.block_table]
    assert (md.max_seqlen_q, md.max_seqlen_k) == (5, 6) and inp.logits_indices.tolist() == [0, 1, 2]
    assert md.cu_seqlens_q.dtype == md.seq_lens_k.dtype == torch.int32 and not md.is_decode
    with pytest.raises(ValueError, match="empty"):
        build_batch_inputs(SchedulerInfo(), BS)


def test_preempted_request_resumes_in_chunks():
    bm = BlockManager(6, BS)
    s = ChunkedPrefillScheduler(4, 4, 6, block_size=BS, block_manager=bm)
    s.add_request(req("a", 8, max_tokens=9))
    s.add_request(req("b", 8, max_tokens=9, start=40))
    preempted = []
    for _ in range(60):
        if not s.has_requests():
            break
        out = step(s)
        preempted += [r.request_id for r in out.preempted_requests]
        assert out.total_num_scheduled_tokens <= 4
    assert preempted and not s.has_requests() and bm.all_blocks_free()


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["paged", "prefix_cache"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workloads_with_chunking(policy, prefix_caching):
    """The engine's hand-off under test: every step goes through SchedulerInfo and the batch tensors."""
    results = [
        run_random_workload(
            ChunkedPrefillScheduler,
            seed,
            chunked=True,
            policy=policy,
            prefix_caching=prefix_caching,
            model_cls=FakeBatchModel,
            remote=seed % 3 == 0,
        )
        for seed in range(400)
    ]
    assert sum(r.num_steps for r in results) > 4000
    assert sum(r.num_preemptions for r in results) > 50
    assert sum(r.num_spec_accepted for r in results) > 500
    assert any(r.params.get("long_prefill_token_threshold") for r in results)
    assert sum(r.num_remote_tokens for r in results) > 500  # a third of the seeds load from a pool
