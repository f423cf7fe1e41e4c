"""MiniCPM4 through the registry: greedy tokens and logprobs equal a reference that is not ours.

transformers has no MiniCPM and no checkpoint is downloaded: the test writes a tiny random one
with MiniCPM4's config keys (``scale_emb``, ``scale_depth``, ``dim_model_base``, a ``longrope``
``rope_scaling``) and tensor names, and compares the engine with

* a plain-torch MiniCPM written here from the formulas (µP's three scales, LongRoPE, GQA
  attention over the whole sequence, recomputed for every token), sharing no code with the
  engine; float32, logprobs within 1e-4;
* vLLM's own ``MiniCPMForCausalLM``, where ``.venv-vllm`` exists (skipped with the reason
  elsewhere).

The checkpoint's context (128 positions) is four times its ``original_max_position_embeddings``
(32), so LongRoPE takes its long factors and a 1.18 attention scale, and the longer prompts and
their continuations run past position 32. The scales are chosen so that leaving out any one
changes the logprobs (``scale_depth / sqrt(2 layers)`` is 0.35, as MiniCPM4-0.5B's 24 layers give
0.29; the final division is by 4, as in the 0.5B).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from test_logprobs import check_position
from vllm_from_scratch import LLM, SamplingParams
from vllm_from_scratch.layers.rotary_embedding import RotaryEmbedding
from vllm_from_scratch.loader import get_model, load_config

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
ATOL = 1e-4
K = 5
MAX_TOKENS = 24
HEAD_DIM = 16

TINY_MINICPM4 = {
    "architectures": ["MiniCPMForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_minicpm.MiniCPMConfig",
        "AutoModelForCausalLM": "modeling_minicpm.MiniCPMForCausalLM",
    },
    "model_type": "minicpm",
    "bos_token_id": 1,
    "eos_token_id": [2, 7],
    "pad_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
        "long_factor": [1.0, 1.4, 2.2, 3.5, 5.0, 7.5, 11.0, 16.0],
        "original_max_position_embeddings": 32,
    },
    "vocab_size": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "scale_emb": 12,
    "scale_depth": 0.5,
    "dim_model_base": 16,
    "mup_denominator": 32,
}


def save_tiny_minicpm4(path: Path, seed: int = 0, **overrides) -> str:
    """A random MiniCPM4-shaped checkpoint under the real tensor names (untied, as the 8B is;
    ``tie_word_embeddings=True`` leaves ``lm_head.weight`` out, as tied checkpoints do)."""
    config = {**TINY_MINICPM4, **overrides}
    g = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_size, kv_size = config["num_attention_heads"] * HEAD_DIM, config["num_key_value_heads"] * HEAD_DIM

    def normal(*shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    tensors = {
        "model.embed_tokens.weight": normal(config["vocab_size"], hidden),
        "model.norm.weight": 1 + normal(hidden),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": normal(q_size, hidden),
            p + "self_attn.k_proj.weight": normal(kv_size, hidden),
            p + "self_attn.v_proj.weight": normal(kv_size, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, q_size),
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
            p + "input_layernorm.weight": 1 + normal(hidden),
            p + "post_attention_layernorm.weight": 1 + normal(hidden),
        }
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = normal(config["vocab_size"], hidden)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return str(path)


@pytest.fixture(scope="module")
def tiny_minicpm4_dir(tmp_path_factory):
    return save_tiny_minicpm4(tmp_path_factory.mktemp("tiny_minicpm4"))


# ---- the reference: MiniCPM from its formulas, in plain torch ------------------------------------


class PlainMiniCPM:
    """MiniCPM's forward over a whole sequence, from the checkpoint's tensors and config.json."""

    def __init__(self, model_dir: str):
        from safetensors.torch import load_file

        self.w = load_file(os.path.join(model_dir, "model.safetensors"))
        self.c = json.loads(Path(model_dir, "config.json").read_text())
        if self.c.get("tie_word_embeddings", True):  # MiniCPM ties unless told otherwise
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        rope = self.c["rope_scaling"]
        longest, original = self.c["max_position_embeddings"], rope["original_max_position_embeddings"]
        factors = torch.tensor(rope["long_factor"] if longest > original else rope["short_factor"])
        exponents = torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM
        self.inv_freq = 1.0 / (factors * self.c["rope_theta"] ** exponents)
        self.mscale = math.sqrt(1 + math.log(longest / original) / math.log(original)) if longest > original else 1.0

    def rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c["rms_norm_eps"]) * self.w[name]

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` is ``[heads, T, head_dim]``; pairs ``(i, i + d/2)`` rotate by ``t * inv_freq[i]``."""
        angles = torch.arange(x.shape[1]).float()[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos() * self.mscale, angles.sin() * self.mscale
        x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def attention(self, x: torch.Tensor, p: str) -> torch.Tensor:
        c, w, t = self.c, self.w, x.shape[0]
        heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        q = (x @ w[p + "q_proj.weight"].T).view(t, heads, HEAD_DIM).transpose(0, 1)
        k = (x @ w[p + "k_proj.weight"].T).view(t, kv_heads, HEAD_DIM).transpose(0, 1)
        v = (x @ w[p + "v_proj.weight"].T).view(t, kv_heads, HEAD_DIM).transpose(0, 1)
        q, k = self.rope(q), self.rope(k)
        group = heads // kv_heads  # query head h reads KV head h // group
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = q @ k.transpose(1, 2) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, heads * HEAD_DIM)
        return out @ w[p + "o_proj.weight"].T

    def mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        gate, up = x @ self.w[p + "gate_proj.weight"].T, x @ self.w[p + "up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ self.w[p + "down_proj.weight"].T

    @torch.no_grad()
    def logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """``[T, V]``: row ``p`` is the log-softmax predicting token ``p + 1``."""
        c = self.c
        branch = c["scale_depth"] / math.sqrt(c["num_hidden_layers"])
        h = self.w["model.embed_tokens.weight"][torch.tensor(token_ids)] * c["scale_emb"]
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = h + branch * self.attention(self.rms(h, p + "input_layernorm.weight"), p + "self_attn.")
            h = h + branch * self.mlp(self.rms(h, p + "post_attention_layernorm.weight"), p + "mlp.")
        h = self.rms(h, "model.norm.weight") / (c["hidden_size"] / c["dim_model_base"])
        return (h @ self.w["lm_head.weight"].T).log_softmax(-1)


def make_prompts(seed: int, lengths=(5, 17, 40)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, 512, (n,), generator=g).tolist() for n in lengths]


def check_against_reference(model_dir: str, prompts, outs) -> None:
    """Each completion is the reference's greedy continuation and carries its logprobs.

    One reference forward over prompt + completion scores every position (it is causal): the
    completion is greedy for the reference when each token is the argmax of the row before it,
    and it ends where greedy decoding does, at an EOS token or after ``MAX_TOKENS``."""
    reference = PlainMiniCPM(model_dir)
    eos = reference.c["eos_token_id"]
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        tokens = completion.token_ids
        rows = reference.logprobs(prompt + tokens)[len(prompt) - 1 : -1]
        where = f"prompt of {len(prompt)} tokens"
        assert tokens == rows.argmax(-1).tolist(), f"{where}: not the reference's greedy tokens"
        assert not set(tokens[:-1]) & set(eos) and (len(tokens) == MAX_TOKENS or tokens[-1] in eos), where
        for j, (token, entry) in enumerate(zip(tokens, completion.logprobs)):
            check_position(entry, rows[j], token, K, f"{where}, output {j}")


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=K)
# Chunked prefill, prefix caching and preemption at once: prompts split into chunks, hits on a
# shared prefix, and requests recomputed after losing their blocks, all past position 32.
ENGINE = dict(
    dtype="float32",
    device="cpu",
    kvcache_block_size=8,
    num_kvcache_blocks=14,
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
    max_num_batched_tokens=16,
    enforce_eager=True,
    warm_up=False,
)


def test_minicpm4_greedy_tokens_and_logprobs_equal_the_plain_reference(tiny_minicpm4_dir):
    llm = LLM(tiny_minicpm4_dir, **ENGINE)
    prefix = make_prompts(1, (16,))[0]
    prompts = make_prompts(0) + [prefix + p for p in make_prompts(2, (9, 30))]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert max(len(p) + len(o.outputs[0].token_ids) for p, o in zip(prompts, outs)) > 32, "LongRoPE's long range"
    check_against_reference(tiny_minicpm4_dir, prompts, outs)
    stats = llm.llm_engine.get_stats()
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions_total"] > 0
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.block_manager.all_blocks_free()


def test_a_tied_checkpoint_without_lm_head_loads_as_the_embedding(tmp_path):
    """MiniCPM's configuration ties the embeddings unless config.json says otherwise."""
    config = {k: v for k, v in TINY_MINICPM4.items() if k != "tie_word_embeddings"}
    model_dir = save_tiny_minicpm4(tmp_path, seed=1, tie_word_embeddings=True)
    Path(model_dir, "config.json").write_text(json.dumps(config))
    assert load_config(model_dir).tie_word_embeddings
    llm = LLM(model_dir, **{**ENGINE, "num_kvcache_blocks": 64})
    prompts = make_prompts(3, (6, 35))
    check_against_reference(model_dir, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("max_position", [32, 24, 128])
def test_longrope_equals_transformers_longrope(max_position):
    """The rotary embedding's cosines and sines against transformers' LongRoPE parameters (Phi-3's
    ``_compute_longrope_parameters``, a reference that is not ours): short factors and no
    attention scale for a context within ``original_max_position_embeddings``, long ones and
    ``sqrt(1 + ln s / ln 32)`` past it, at every position of the context."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_theta": 10000.0, **TINY_MINICPM4["rope_scaling"]}
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_position,
        rope_parameters=rope,
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=max_position)
    angles = torch.arange(max_position).float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
    ours = RotaryEmbedding(HEAD_DIM, max_position, 10000.0, TINY_MINICPM4["rope_scaling"]).cos_sin_cache
    torch.testing.assert_close(ours, torch.cat([cos, cos, -sin, sin], dim=-1), atol=1e-6, rtol=1e-6)
    assert (attention_factor > 1) == (max_position > 32)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"sparse_config": {"kernel_size": 32, "topk": 64, "dense_len": 8192}}, "sparse_config"),
        ({"scale_depth": None}, "scale_depth"),
        ({"num_experts": 8}, "num_experts"),
        ({"hidden_act": "fatrelu"}, "hidden_act"),
        ({"rope_scaling": {**TINY_MINICPM4["rope_scaling"], "long_factor": [1.0] * 3}}, "long_factor"),
    ],
)
def test_what_is_not_built_is_refused_by_name(tiny_minicpm4_dir, tmp_path, change, named):
    model_dir = shutil.copytree(tiny_minicpm4_dir, tmp_path / "changed")
    config = {k: v for k, v in {**TINY_MINICPM4, **change}.items() if v is not None}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=named):
        get_model(str(model_dir), dtype="float32")


@pytest.mark.slow
def test_minicpm4_tensor_parallel_equals_the_plain_reference(tiny_minicpm4_dir):
    """Two gloo ranks, each with half the heads and half the MLP: the µP scales apply after the
    all-reduces, so the ranks' output is the whole model's."""
    llm = LLM(tiny_minicpm4_dir, **{**ENGINE, "tensor_parallel_size": 2, "num_kvcache_blocks": 64})
    prompts = make_prompts(4, (7, 38))
    check_against_reference(tiny_minicpm4_dir, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
    llm.shutdown()


VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams

    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype="float32", trust_remote_code=True, skip_tokenizer_init=True,
              max_model_len=spec["max_model_len"], enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=spec["k"], detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    result = [
        {"token_ids": list(o.outputs[0].token_ids),
         "logprobs": [{str(t): lp.logprob for t, lp in entry.items()} for entry in o.outputs[0].logprobs]}
        for o in outs
    ]
    json.dump(result, open(sys.argv[2], "w"))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason="vLLM's CPU build is optional: build .venv-vllm with 07_engine/benchmarks/make_vllm_venv.sh",
)
def test_minicpm4_equals_vllms_minicpm(tiny_minicpm4_dir, tmp_path):
    """vLLM's ``MiniCPMForCausalLM`` on the same checkpoint, with its full 128-token context (vLLM
    takes LongRoPE's long factors when ``max_model_len`` passes the original length). vLLM reads
    the config through the checkpoint's own code, so the copy gets a configuration_minicpm.py."""
    model_dir = shutil.copytree(tiny_minicpm4_dir, tmp_path / "for_vllm")
    (model_dir / "configuration_minicpm.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass MiniCPMConfig(LlamaConfig):\n    model_type = 'minicpm'\n"
    )
    prompts = make_prompts(0)
    spec = {"model": str(model_dir), "max_model_len": 128, "max_tokens": MAX_TOKENS, "k": K, "prompts": prompts}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "run_vllm.py").write_text(VLLM_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    subprocess.run(
        [str(VLLM_PYTHON), str(tmp_path / "run_vllm.py"), str(tmp_path / "spec.json"), str(tmp_path / "out.json")],
        check=True,
        env=env,
        timeout=600,
    )
    theirs = json.loads((tmp_path / "out.json").read_text())
    ours = LLM(tiny_minicpm4_dir, **{**ENGINE, "num_kvcache_blocks": 64}).generate(prompts, GREEDY, use_tqdm=False)
    for prompt, mine, vllm_out in zip(prompts, ours, theirs):
        completion = mine.outputs[0]
        assert completion.token_ids == vllm_out["token_ids"], f"prompt of {len(prompt)} tokens"
        for token, entry, vllm_entry in zip(completion.token_ids, completion.logprobs, vllm_out["logprobs"]):
            assert abs(entry[token].logprob - vllm_entry[str(token)]) < ATOL


def test_the_registry_lists_minicpm():
    from vllm_from_scratch.models import get_config_class, supported_architectures
    from vllm_from_scratch.models.minicpm import MiniCPMConfig

    assert "MiniCPMForCausalLM" in supported_architectures()
    assert get_config_class("minicpm") is MiniCPMConfig and get_config_class("llama") is None


def test_the_compiled_forwards_graphs_run_minicpm(tiny_minicpm4_dir, monkeypatch, tmp_path):
    """The CPU engine's default forward (compilation.py) with MiniCPM: its graphs (``graph_names``)
    are exported as they are for Llama, then run by the engine in place of the compiled packages,
    and the tokens and logprobs still equal the plain reference. Only AOTInductor's compilation of
    the exports is left out (minutes on two cores; model-independent, test_compile.py runs it)."""
    from vllm_from_scratch import compilation, graph_package

    def export_only(model, kv_cache, config, directory):
        directory.mkdir(parents=True, exist_ok=True)
        for name in compilation.graph_names(config):
            compilation._compile_graph(model, kv_cache, config, name, directory / f"{name}.pt2")

    monkeypatch.setattr(compilation, "cache_root", lambda: tmp_path)  # not XDG_CACHE_HOME: chapter 02's kernel is there
    monkeypatch.setattr(compilation, "_compile_graphs", export_only)
    monkeypatch.setattr(compilation, "_package", lambda program, name, path: torch.export.save(program, str(path)))
    monkeypatch.setattr(graph_package, "load", lambda path: torch.export.load(str(path)).module())
    llm = LLM(tiny_minicpm4_dir, **{**ENGINE, "enforce_eager": False, "num_kvcache_blocks": 64})
    runner = llm.llm_engine.executor.runner
    assert runner.compiled_forward is not None
    ran = []
    monkeypatch.setattr(type(runner.compiled_forward), "run", _counting(type(runner.compiled_forward).run, ran))
    prompts = make_prompts(5, (3, 38))
    check_against_reference(tiny_minicpm4_dir, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
    assert min(ran) <= compilation.SMALL_BATCH_TOKENS < max(ran), "both forward graphs should have run"


def _counting(run, sizes: list[int]):
    def counted(self, input_ids, *args):
        sizes.append(input_ids.shape[0])
        return run(self, input_ids, *args)

    return counted
