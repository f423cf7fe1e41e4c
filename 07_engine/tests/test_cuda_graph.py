"""Decode CUDA graphs: captured sizes, padding, and graph output equal to eager output.

On the CPU the runner gets a GPU platform whose graphs are ``_EagerReplay`` stand-ins (same
static buffers, same padding, the same warm-up forward at capture, no CUDA), so everything
around the graph runs here through ``ModelRunner``'s own constructor and ``_forward``; the
``cuda``-marked tests capture real CUDA graphs through the same code and skip without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from attention_backends import AttentionMetadata
from block_manager import BlockManager
from chunked_prefill import SchedulerInfo, build_batch_inputs
from gpu_standin import StandInMemory, cpu_gpu_platform
from sequence import Sequence
from vllm_from_scratch.config import EngineConfig
from vllm_from_scratch.cuda_graph import CUDAGraphRunner, capture_batch_sizes
from vllm_from_scratch.model_runner import ModelRunner

BLOCK = 8


@pytest.mark.parametrize(
    "max_num_seqs,expected",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (10, [1, 2, 4, 8, 10]),  # nano-vllm would stop at 8 and fail on a batch of 9
        (48, [1, 2, 4, 8, 16, 32, 48]),
        (256, [1, 2, 4, 8] + list(range(16, 257, 16))),
        (1000, [1, 2, 4, 8] + list(range(16, 513, 16))),  # capped at 512
    ],
)
def test_capture_batch_sizes(max_num_seqs, expected):
    assert capture_batch_sizes(max_num_seqs) == expected


def test_capture_batch_sizes_rejects_bad_input():
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_batch_sizes(0)


def test_cuda_graph_runner_needs_cuda_when_capturing():
    with pytest.raises(ValueError, match="device"):
        CUDAGraphRunner(lambda *a: None, 4, 64, BLOCK, 8, torch.float32, "cpu", use_cuda_graph=True)


class RecordingModel(torch.nn.Module):
    """Returns a function of every input row and remembers what the graph fed it."""

    def forward(self, input_ids, positions, md: AttentionMetadata):
        self.seen = dict(
            input_ids=input_ids.clone(),
            slot_mapping=md.slot_mapping.clone(),
            seq_lens_k=md.seq_lens_k.clone(),
            block_tables=md.block_tables.clone(),
            cu_seqlens_q=md.cu_seqlens_q.clone(),
            is_decode=md.is_decode,
        )
        row = input_ids * 1000 + positions * 10 + md.seq_lens_k + md.block_tables.sum(-1)
        return row.float().unsqueeze(-1).expand(-1, 4)


def _decode_metadata(n: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    g = torch.Generator().manual_seed(seed)
    ids, pos = torch.randint(0, 100, (n,), generator=g), torch.randint(0, 30, (n,), generator=g)
    md = AttentionMetadata(
        slot_mapping=torch.randint(0, 200, (n,), generator=g),
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
        seq_lens_k=(pos + 1).int(),
        block_tables=torch.randint(0, 25, (n, width), generator=g).int(),
        max_seqlen_q=1,
        max_seqlen_k=int(pos.max()) + 1,
    )
    return ids, pos, md


@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data(), max_num_seqs=st.integers(1, 40), max_model_len=st.sampled_from([8, 64, 100]))
def test_replay_pads_to_the_next_captured_size(data, max_num_seqs, max_model_len):
    """Batch after batch (sizes and block-table widths drawn, in any order): each replays the
    smallest captured size that holds it, its rows copied into the static buffers, the padding
    rows storing nothing (slot -1) and attending to one token, no column of an earlier, wider
    batch left behind."""
    model = RecordingModel()
    runner = CUDAGraphRunner(
        model,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        block_size=BLOCK,
        hidden_size=4,
        dtype=torch.float32,
        device="cpu",
        use_cuda_graph=False,
    )
    runner.capture()
    assert sorted(runner.graphs) == capture_batch_sizes(max_num_seqs)
    # Capturing ran every size on padding rows alone.
    assert model.seen["slot_mapping"].eq(-1).all() and model.seen["seq_lens_k"].eq(1).all()
    max_blocks = -(-max_model_len // BLOCK)
    batches = st.tuples(st.integers(1, min(max_num_seqs, 512)), st.integers(1, max_blocks), st.integers(0, 99))
    for n, width, seed in data.draw(st.lists(batches, min_size=1, max_size=6)):
        ids, pos, md = _decode_metadata(n, width, seed)
        assert runner.can_run(ids, md)
        out = runner.run(ids, pos, md)
        expected = (ids * 1000 + pos * 10 + md.seq_lens_k + md.block_tables.sum(-1)).float()
        assert out.shape == (n, 4)
        torch.testing.assert_close(out[:, 0], expected, rtol=0, atol=0)
        bs = runner.padded_batch_size(n)
        assert bs == min(s for s in runner.batch_sizes if s >= n)
        seen = model.seen
        assert seen["input_ids"].shape == (bs,) and seen["is_decode"]
        torch.testing.assert_close(seen["cu_seqlens_q"], torch.arange(bs + 1, dtype=torch.int32))
        # Padding rows store nothing and attend to one token; real rows are passed through.
        assert seen["slot_mapping"][n:].eq(-1).all() and seen["seq_lens_k"][n:].eq(1).all()
        torch.testing.assert_close(seen["slot_mapping"][:n], md.slot_mapping)
        torch.testing.assert_close(seen["block_tables"][:n, :width], md.block_tables)
        assert seen["block_tables"][:n, width:].eq(0).all()
        assert seen["block_tables"].shape[1] == runner.max_num_blocks == max_blocks


def test_can_run_only_pure_decode_batches_that_fit():
    runner = CUDAGraphRunner(RecordingModel(), 4, 64, BLOCK, 4, torch.float32, "cpu", use_cuda_graph=False)
    ids, pos, md = _decode_metadata(3, 2)
    assert not runner.can_run(ids, md)  # nothing captured yet
    runner.capture()
    assert runner.can_run(ids, md)
    big_ids, _, big_md = _decode_metadata(5, 2)
    assert not runner.can_run(big_ids, big_md)  # above max_num_seqs
    md.max_seqlen_q = 2  # a request brings two tokens: no longer a decode
    assert not runner.can_run(ids, md)
    with pytest.raises(ValueError, match="n must be"):
        runner.padded_batch_size(5)


# ---- the real model: graph replay equals the eager forward ----------------------------------


def _runner_with_graphs(model_dir: str, device: str, **overrides) -> ModelRunner:
    """A runner that captured decode graphs: CUDA's on a GPU, the eager stand-ins on the CPU."""
    settings = dict(
        dtype="float32",
        kvcache_block_size=BLOCK,
        num_kvcache_blocks=64,
        max_num_seqs=10,
        max_model_len=128,
    )
    config = EngineConfig(model_dir=model_dir, device=device, **(settings | overrides))
    if device == "cuda":
        return ModelRunner(config)
    memory = StandInMemory(total=0, free=0, allocated=0, peaks=[])
    runner = ModelRunner(config, gpu=cpu_gpu_platform(memory))
    assert memory.calls == [], "a given num_kvcache_blocks needs no profile"
    return runner


def _prefill(runner: ModelRunner, num_seqs: int) -> list[Sequence]:
    """``num_seqs`` prompts prefilled into the runner's cache, each with one decode token next."""
    bm = BlockManager(runner.num_kvcache_blocks, BLOCK)
    g = torch.Generator().manual_seed(0)
    seqs = [
        Sequence(torch.randint(3, 512, (int(n),), generator=g).tolist(), BLOCK)
        for n in torch.randint(3, 30, (num_seqs,), generator=g)
    ]
    for s in seqs:
        assert bm.allocate_slots(s, s.num_tokens)
    info = SchedulerInfo.from_sequences(seqs, [s.num_tokens for s in seqs])
    runner.compute_logits(build_batch_inputs(info, BLOCK, runner.device))
    for s in seqs:  # one decode token each, crossing a block boundary for some
        s.num_computed_tokens = s.num_tokens
        s.append_token(int(torch.randint(3, 512, (1,), generator=g)))
        assert bm.allocate_slots(s, 1)
    return seqs


@torch.inference_mode()
def _graph_equals_eager(model_dir: str, device: str, num_seqs: int) -> None:
    runner = _runner_with_graphs(model_dir, device)
    assert runner.graph_runner is not None
    assert runner.kv_cache.count_nonzero() == 0, "capturing wrote into the KV cache"
    seqs = _prefill(runner, num_seqs)
    batch = build_batch_inputs(SchedulerInfo.from_sequences(seqs, [1] * len(seqs)), BLOCK, runner.device)
    md = batch.attn_metadata
    assert runner.graph_runner.can_run(batch.input_ids, md)
    kv_before = runner.kv_cache.clone()
    eager = runner.model(batch.input_ids, batch.positions, md).clone()
    kv_eager = runner.kv_cache.clone()
    runner.kv_cache.copy_(kv_before)
    replayed = runner._forward(batch).clone()  # the runner's own path: through the graph that fits
    torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
    # The replay wrote the same new K/V into the same slots, and the padded rows wrote nothing.
    torch.testing.assert_close(runner.kv_cache, kv_eager, rtol=1e-4, atol=1e-4)


class HostReads(TorchDispatchMode):
    """Records every op that reads a value back to the host (``.item()``, ``.tolist()``, ``int()``)
    or makes a shape from data (``nonzero``): inside a CUDA graph capture each one fails."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default or func.name().startswith("aten::nonzero"):
            self.ops.append(func.name())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["triton", "auto"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_captured_forward_reads_nothing_back_from_the_device(request, arch, backend):
    """What capture_cudagraph records must never sync with the host: checked on the CPU on the
    exact closure a graph captures, with the GPU's attention (Triton, interpreted here) and the
    CPU's."""
    runner = _runner_with_graphs(request.getfixturevalue(f"tiny_{arch}_dir"), "cpu", attention_backend=backend)
    assert runner.graph_runner is not None
    with HostReads() as reads, torch.inference_mode():
        for bs in runner.graph_runner.batch_sizes:
            runner.graph_runner._forward_into_buffers(bs)
    assert reads.ops == []
    with HostReads() as reads:
        runner.kv_cache.sum().item()
    assert reads.ops == ["aten::_local_scalar_dense"]  # the check sees a read when there is one


@pytest.mark.parametrize("num_seqs", [5, 9])
def test_padded_replay_equals_eager_on_a_real_model_cpu(tiny_llama_dir, num_seqs):
    _graph_equals_eager(tiny_llama_dir, "cpu", num_seqs=num_seqs)


@pytest.mark.cuda
@pytest.mark.parametrize("num_seqs", [1, 5, 9])
def test_cuda_graph_equals_eager(tiny_llama_dir, tiny_qwen3_dir, num_seqs):
    for model_dir in (tiny_llama_dir, tiny_qwen3_dir):
        _graph_equals_eager(model_dir, "cuda", num_seqs=num_seqs)


@pytest.mark.cuda
def test_llm_with_cuda_graphs_generates_what_eager_does(tiny_llama_dir):
    from vllm_from_scratch import LLM, SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in (5, 17, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    outs = {}
    for eager in (True, False):
        llm = LLM(
            tiny_llama_dir,
            device="cuda",
            dtype="float32",
            enforce_eager=eager,
            max_num_seqs=8,
            kvcache_block_size=16,
            num_kvcache_blocks=64,
        )
        runner = llm.llm_engine.executor.runner
        assert (runner.graph_runner is None) == eager
        outs[eager] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert outs[False] == outs[True]
