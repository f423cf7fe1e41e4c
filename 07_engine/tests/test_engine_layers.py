"""The engine's layers against transformers' own modules, and the model runner's inputs.

(The tensor-parallel split of each linear layer is checked on 2 gloo ranks in
``test_tensor_parallel.py``.)
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as hf_llama

from chunked_prefill import SchedulerInfo, build_batch_inputs
from sequence import Sequence
from vllm_from_scratch.config import EngineConfig
from vllm_from_scratch.layers import bf16_gemm, prepacked
from vllm_from_scratch.layers.embed_head import ParallelLMHead
from vllm_from_scratch.layers.layernorm import RMSNorm
from vllm_from_scratch.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear
from vllm_from_scratch.layers.prepacked import FLOAT32_MIN_ROWS, can_pack, linear, pack_weight
from vllm_from_scratch.layers.rotary_embedding import get_rope
from vllm_from_scratch.loader import get_model
from vllm_from_scratch.model_runner import ModelRunner
from vllm_from_scratch.models import get_model_class


@pytest.mark.parametrize(
    "device,packed",
    [("cpu", False), ("cpu", True), pytest.param("cuda", False, marks=pytest.mark.cuda)],
    ids=["F.linear", "prepacked", "cuda"],
)
def test_a_bfloat16_head_breaks_its_rounding_ties_as_float32_would(device, packed):
    """Token 1's logit is 25.15625 and token 0's 25.125: bfloat16 rounds both to 25.125, and
    argmax would take token 0; the head recomputes its largest logits in float32."""
    head = ParallelLMHead(16, 4).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.zero_()
        head.weight[0] = torch.tensor([6.25, 6.25, 6.25, 6.375])
        head.weight[1] = torch.tensor([6.25, 6.25, 6.25, 6.40625])
    if packed:
        head.prepack()
    head = head.to(device)
    x = torch.ones(2, 4, dtype=torch.bfloat16, device=device)
    assert torch.nn.functional.linear(x, head.weight)[0, :2].tolist() == [25.125, 25.125]
    logits = head(x)
    assert logits.dtype == torch.float32
    assert logits[0, :2].tolist() == [25.125, 25.15625] and logits.argmax(-1).tolist() == [1, 1]
    assert logits[0, 2:].eq(0).all()


@pytest.mark.skipif(not bf16_gemm.gemm_available(), reason="this CPU has no AVX-512 BF16")
def test_through_the_engines_gemm_every_logit_of_a_bfloat16_head_is_float32():
    """Not only the largest: the GEMM's float32 sums come back unrounded (log-probabilities of
    every token then match a float32 product of the same 16-bit values)."""
    torch.manual_seed(0)
    head = ParallelLMHead(300, 64).to(torch.bfloat16)
    head.weight.data.normal_()
    head.prepack()
    x = torch.randn(6, 64).bfloat16()
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (6, 300)
    torch.testing.assert_close(logits, x.float() @ head.weight.float().T, rtol=1e-5, atol=1e-5)
    rounded = torch.nn.functional.linear(x, head.weight).float()
    assert not torch.equal(logits, rounded), "bfloat16 would round most of 1,800 logits"


def test_rmsnorm_with_and_without_residual_matches_hf():
    torch.manual_seed(0)
    x, res = torch.randn(5, 32), torch.randn(5, 32)
    ours = RMSNorm(32, 1e-6)
    ours.weight.data.normal_()
    ref = hf_llama.LlamaRMSNorm(32, eps=1e-6)
    ref.weight.data.copy_(ours.weight.data)
    torch.testing.assert_close(ours(x), ref(x))
    normed, new_res = ours(x, res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(normed, ref(x + res))


@pytest.mark.parametrize("shape", [(64, 576), (1, 576), (7, 9, 64)])
def test_rmsnorm_in_bfloat16_matches_hf_bit_for_bit(shape):
    """Normalised in float32 and rounded once, then scaled in bf16, as transformers does (the
    (7, 9, 64) case is Qwen3's per-head norm of q and k)."""
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).bfloat16()
    ours = RMSNorm(shape[-1], 1e-5).bfloat16()
    ours.weight.data.normal_()
    ref = hf_llama.LlamaRMSNorm(shape[-1], eps=1e-5).bfloat16()
    ref.weight.data.copy_(ours.weight.data)
    assert torch.equal(ours(x), ref(x))


BF16_PACKING = can_pack(torch.empty(1, 1, dtype=torch.bfloat16))


@pytest.mark.skipif(not BF16_PACKING, reason="this CPU's oneDNN has no bfloat16 matmul")
@pytest.mark.parametrize("rows", [0, 1, 7, 33, 300])
def test_prepacked_weight_gives_f_linear_bit_for_bit(rows):
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 80).bfloat16(), torch.randn(96).bfloat16()
    x = torch.randn(rows, 80).bfloat16()
    packed = pack_weight(weight)
    assert packed is not None
    assert torch.equal(linear(x, weight, bias, packed), torch.nn.functional.linear(x, weight, bias))
    assert torch.equal(linear(x, weight, None, packed), torch.nn.functional.linear(x, weight))


@pytest.mark.skipif(not BF16_PACKING, reason="this CPU's oneDNN has no bfloat16 matmul")
@pytest.mark.parametrize("rows", [1, FLOAT32_MIN_ROWS - 1, FLOAT32_MIN_ROWS, 300])
def test_float32_copy_of_a_bf16_weight_takes_large_matmuls_to_within_one_rounding(rows):
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 80).bfloat16(), torch.randn(96).bfloat16()
    x = torch.randn(rows, 80).bfloat16()
    out = linear(x, weight, bias, pack_weight(weight), pack_weight(weight.float()))
    expected = torch.nn.functional.linear(x, weight, bias)
    assert out.dtype == torch.bfloat16
    if rows < FLOAT32_MIN_ROWS:  # the bf16 copy: bit for bit
        assert torch.equal(out, expected)
    else:  # the same exact products summed in another order, then one rounding to bf16
        torch.testing.assert_close(out, expected, atol=2**-6, rtol=2**-7)


@pytest.mark.skipif(not BF16_PACKING, reason="this CPU's oneDNN has no bfloat16 matmul")
@pytest.mark.parametrize("slow", [True, False])
def test_prepack_keeps_a_float32_copy_where_bf16_matmuls_are_slow_or_when_asked(monkeypatch, slow):
    monkeypatch.setattr(bf16_gemm, "gemm_available", lambda: False)  # a CPU without AVX-512 BF16
    monkeypatch.setattr(prepacked, "bf16_matmul_is_slow", lambda: slow)
    layer = ReplicatedLinear(80, 96, bias=True).bfloat16()
    assert layer.prepack() and (layer.packed_weight_fp32 is not None) == slow
    assert layer.prepack(float32_copy=not slow) and (layer.packed_weight_fp32 is not None) == (not slow)
    fp32_layer = ReplicatedLinear(80, 96)  # already float32: nothing to copy
    assert fp32_layer.prepack(float32_copy=True) and fp32_layer.packed_weight_fp32 is None


def test_float32_packing_agrees_to_rounding_and_other_dtypes_are_not_packed():
    torch.manual_seed(0)
    weight, x = torch.randn(96, 80), torch.randn(33, 80)
    packed = pack_weight(weight)
    assert (packed is not None) == can_pack(weight)
    if packed is not None:  # a oneDNN build with the ops
        torch.testing.assert_close(linear(x, weight, None, packed), x @ weight.T, atol=1e-4, rtol=1e-5)
    for other in (weight.double(), weight.half(), weight[0]):
        assert pack_weight(other) is None
    assert torch.equal(linear(x.double(), weight.double()), x.double() @ weight.double().T)


@pytest.mark.skipif(not BF16_PACKING, reason="this CPU's oneDNN has no bfloat16 matmul")
@pytest.mark.parametrize(
    "own_gemm",
    [
        False,
        pytest.param(True, marks=pytest.mark.skipif(not bf16_gemm.gemm_available(), reason="no AVX-512 BF16 here")),
    ],
    ids=["oneDNN", "bf16_gemm"],
)
def test_model_runner_packs_every_linear_and_logits_do_not_change(tiny_llama_dir, monkeypatch, own_gemm):
    """oneDNN's packed weights give F.linear's logits bit for bit; the engine's own GEMM sums the
    same exact products in another order, so its logits agree to bfloat16 rounding."""
    monkeypatch.setattr(bf16_gemm, "gemm_available", lambda: own_gemm)
    runner = ModelRunner(
        EngineConfig(
            tiny_llama_dir,
            device="cpu",
            kvcache_block_size=4,
            num_kvcache_blocks=16,
            dtype="bfloat16",
            enforce_eager=True,
        )
    )
    model = runner.model
    packable = [m for m in model.modules() if isinstance(m, LinearBase)] + [model.lm_head]
    assert len(packable) == 4 * model.config.num_hidden_layers + 1
    assert all((m.gemm_weight is not None, m.packed_weight is not None) == (own_gemm, not own_gemm) for m in packable)
    seq = Sequence(list(range(3, 14)), block_size=4)
    seq.block_table = [0, 1, 2]
    batch = build_batch_inputs(SchedulerInfo.from_sequences([seq], [11]), 4)
    packed_logits = runner.compute_logits(batch)
    for m in packable:
        m.gemm_weight = m.packed_weight = m.packed_weight_fp32 = None
    plain_logits = runner.compute_logits(batch)
    if own_gemm:
        torch.testing.assert_close(packed_logits, plain_logits, atol=0.05, rtol=2**-6)
    else:
        assert torch.equal(packed_logits, plain_logits)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rotary_embedding_matches_hf(rope_parameters):
    cfg = LlamaConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256, rope_parameters=rope_parameters
    )
    torch.manual_seed(0)
    positions = torch.tensor([0, 1, 7, 100, 255, 3])
    q, k = torch.randn(6, 4 * 16), torch.randn(6, 2 * 16)
    scaling = rope_parameters if rope_parameters["rope_type"] != "default" else None
    rope = get_rope(16, 256, rope_parameters["rope_theta"], scaling)
    oq, ok = rope(positions, q, k)
    hf_rope = hf_llama.LlamaRotaryEmbedding(cfg)
    cos, sin = hf_rope(q, positions.unsqueeze(0))
    rq, rk = hf_llama.apply_rotary_pos_emb(
        q.view(1, 6, 4, 16).transpose(1, 2), k.view(1, 6, 2, 16).transpose(1, 2), cos, sin
    )
    for name, ours, theirs in (("q", oq, rq), ("k", ok, rk)):
        torch.testing.assert_close(
            ours,
            theirs.transpose(1, 2).reshape(6, -1),
            atol=1e-5,
            rtol=1e-5,
            msg=lambda m, name=name: (
                f"rotated {name} differs from transformers' at positions {positions.tolist()} "
                f"({rope_parameters['rope_type']} RoPE): each token turns by the angles of its own position "
                "(cos_sin_cache[positions], not rows 0..T-1), every head of q and of k rotates its two halves, and "
                f"llama3 scaling changes the inverse frequencies first.\n{m}"
            ),
        )


def test_rotary_embedding_in_bfloat16_matches_hf_bit_for_bit():
    """SmolLM2's RoPE (head 64, theta 1e5, 8,192 positions): same angles, same roundings."""
    cfg = LlamaConfig(
        hidden_size=576,
        num_attention_heads=9,
        head_dim=64,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )
    torch.manual_seed(0)
    positions = torch.tensor([0, 1, 7, 100, 255, 3, 4000, 8191])
    q, k = (torch.randn(8, 9 * 64) * 3).bfloat16(), (torch.randn(8, 3 * 64) * 3).bfloat16()
    oq, ok = get_rope(64, 8192, 100000.0)(positions, q, k)
    cos, sin = hf_llama.LlamaRotaryEmbedding(cfg)(q, positions.unsqueeze(0))
    rq, rk = hf_llama.apply_rotary_pos_emb(
        q.view(1, 8, 9, 64).transpose(1, 2), k.view(1, 8, 3, 64).transpose(1, 2), cos, sin
    )
    assert torch.equal(oq, rq.transpose(1, 2).reshape(8, -1)) and torch.equal(ok, rk.transpose(1, 2).reshape(8, -1))


def test_layers_share_one_rotary_embedding(tiny_llama_dir):
    model = get_model(tiny_llama_dir, dtype="float32")
    assert len({id(layer.self_attn.rotary_emb) for layer in model.model.layers}) == 1


def test_registry_and_loader_fuse_qkv_and_gate_up(tiny_qwen3_dir):
    from safetensors import safe_open

    model = get_model(tiny_qwen3_dir, dtype="bfloat16")
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    with safe_open(f"{tiny_qwen3_dir}/model.safetensors", framework="pt") as f:
        q = f.get_tensor("model.layers.1.self_attn.q_proj.weight")
        v = f.get_tensor("model.layers.1.self_attn.v_proj.weight")
        up = f.get_tensor("model.layers.1.mlp.up_proj.weight")
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(qkv[: q.shape[0]], q.bfloat16())
    assert torch.equal(qkv[-v.shape[0] :], v.bfloat16())
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight[up.shape[0] :], up.bfloat16())


def _rows(n: int, start: int) -> torch.Tensor:
    """``n`` rows of width 2 whose values say which checkpoint row they are."""
    return torch.arange(start, start + n, dtype=torch.float32).unsqueeze(1).expand(n, 2).clone()


def test_qkv_loader_takes_this_ranks_heads_of_each_shard():
    # Rank 1 of 2, GQA: 4 query heads and 2 kv heads of size 2, so this rank holds query heads
    # 2-3 (checkpoint rows 4..7 of q) and kv head 1 (rows 2..3 of k and of v).
    layer = QKVParallelLinear(2, 2, 4, 2, tp_rank=1, tp_size=2)
    q, k, v = _rows(8, 0), _rows(4, 100), _rows(4, 200)
    for shard, w in (("q", q), ("k", k), ("v", v)):
        layer.weight_loader(layer.weight, w, shard)
    expected = torch.cat([q[4:8], k[2:4], v[2:4]])
    assert torch.equal(layer.weight.data, expected), (
        f"rank 1's fused weight holds checkpoint rows {layer.weight.data[:, 0].tolist()}, expected "
        f"{expected[:, 0].tolist()}: [this rank's q heads; its k heads; its v heads], each sized by "
        "its own head count (fewer kv heads than q heads)"
    )


def test_merged_loader_stacks_this_ranks_gate_and_up():
    # Rank 1 of 2: the local weight is [gate rows 3..5; up rows 3..5], each part's own slice.
    layer = MergedColumnParallelLinear(2, [6, 6], tp_rank=1, tp_size=2)
    gate, up = _rows(6, 0), _rows(6, 100)
    layer.weight_loader(layer.weight, gate, 0)
    layer.weight_loader(layer.weight, up, 1)
    expected = torch.cat([gate[3:6], up[3:6]])
    assert torch.equal(layer.weight.data, expected), (
        f"rank 1's fused weight holds checkpoint rows {layer.weight.data[:, 0].tolist()}, expected "
        f"{expected[:, 0].tolist()}: part i starts at sum(output_sizes[:i]) // tp_size and holds this "
        "rank's slice of that part"
    )
    with pytest.raises(ValueError, match="loaded_shard_id"):
        layer.weight_loader(layer.weight, gate)


def test_unknown_architecture_is_a_value_error():
    with pytest.raises(ValueError, match="architectures"):
        get_model_class(LlamaConfig(architectures=["GPT2LMHeadModel"]))


def test_a_mixed_batch_reaches_attention_as_chapter_06_builds_it():
    """A prefill chunk, a decode and a chunk that does not reach the end of its prompt."""
    a = Sequence(list(range(10, 16)), block_size=4)  # 6 prompt tokens, all scheduled
    a.block_table = [5, 2]
    b = Sequence(list(range(20, 29)), block_size=4)  # decoding: 8 computed, 1 new
    b.num_computed_tokens, b.block_table = 8, [0, 1, 3]
    c = Sequence(list(range(30, 40)), block_size=4)  # chunk of 3 starting at 4, prompt of 10
    c.num_computed_tokens, c.block_table = 4, [7, 8]
    batch = build_batch_inputs(SchedulerInfo.from_sequences([a, b, c], [6, 1, 3]), 4)
    md = batch.attn_metadata
    assert batch.input_ids.tolist() == list(range(10, 16)) + [28] + [34, 35, 36]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 5, 8, 4, 5, 6]
    assert md.slot_mapping.tolist() == [20, 21, 22, 23, 8, 9, 12, 32, 33, 34]
    assert md.cu_seqlens_q.tolist() == [0, 6, 7, 10]
    assert md.seq_lens_k.tolist() == [6, 9, 7]
    assert md.block_tables.tolist() == [[5, 2, 0], [0, 1, 3], [7, 8, 0]]
    assert not md.is_decode and (md.max_seqlen_q, md.max_seqlen_k) == (6, 9)
    assert batch.logits_indices.tolist() == [5, 6]
