"""Tensor parallelism on the CPU: 2 gloo ranks, the rank-0 process being this pytest process.

First the layers, independent of the engine: every parallel layer, built on 2 ranks from a full
weight through its ``weight_loader``, must compute what the unsharded layer computes. Then the
executor's life cycle (a failing rank, garbage collection, the parent exiting or being killed):
no worker process and no ``/dev/shm`` entry may outlive it. Then the engine: greedy output with
``tensor_parallel_size=2`` equals transformers', token for token.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from vllm_from_scratch.distributed import LocalExecutor, TensorParallelExecutor, gather_to_first_rank, make_executor
from vllm_from_scratch.layers.activation import SiluAndMul
from vllm_from_scratch.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from vllm_from_scratch.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

TP = 2
ATOL = 1e-5


# ---- runners that the spawned ranks build (module level, so they pickle by name) ---------------


class LayerCheckRunner:
    """Builds one parallel layer per call on every rank and returns (sharded result, reference)
    on rank 0. Every rank draws the same full weights from the same seed, as every rank of the
    engine reads the same checkpoint."""

    def __init__(self, rank: int):
        self.rank, self.size = rank, dist.get_world_size()
        self.tp = dict(tp_rank=self.rank, tp_size=self.size)

    def _load(self, param, *args):
        param.weight_loader(param, *args)

    def _loaded_linear(self, cls, seed: int, in_f: int, out_f: int, bias: bool):
        """``cls`` with this rank's slice of a full random weight (and bias) loaded, the full
        weight's reference output, and the input."""
        g = torch.Generator().manual_seed(seed)
        w, b, x = (
            torch.randn(out_f, in_f, generator=g),
            torch.randn(out_f, generator=g),
            torch.randn(5, in_f, generator=g),
        )
        layer = cls(in_f, out_f, bias=bias, **self.tp)
        self._load(layer.weight, w)
        if bias:
            self._load(layer.bias, b)
        return layer, F.linear(x, w, b if bias else None), x

    def column(self, seed: int, in_f: int = 8, out_f: int = 12, bias: bool = True):
        layer, expected, x = self._loaded_linear(ColumnParallelLinear, seed, in_f, out_f, bias)
        return gather_to_first_rank(layer(x), self.rank, self.size), expected

    def row(self, seed: int, in_f: int = 12, out_f: int = 8, bias: bool = True):
        layer, expected, x = self._loaded_linear(RowParallelLinear, seed, in_f, out_f, bias)
        # Row-parallel input arrives already split (it is a column layer's output).
        return layer(x.chunk(self.size, dim=-1)[self.rank]), expected

    def qkv(self, seed: int, hidden: int = 16, head: int = 4, heads: int = 4, kv_heads: int = 2):
        g = torch.Generator().manual_seed(seed)
        wq = torch.randn(heads * head, hidden, generator=g)
        wk, wv = (torch.randn(kv_heads * head, hidden, generator=g) for _ in range(2))
        x = torch.randn(5, hidden, generator=g)
        layer = QKVParallelLinear(hidden, head, heads, kv_heads, **self.tp)
        for shard, w in zip("qkv", (wq, wk, wv)):
            self._load(layer.weight, w, shard)
        local = layer(x)
        q_local = heads // self.size * head
        kv_local = kv_heads // self.size * head
        # Rank r holds [q heads of r | k heads of r | v heads of r]; regroup into full q, k, v.
        parts = [
            gather_to_first_rank(t, self.rank, self.size) for t in local.split([q_local, kv_local, kv_local], dim=-1)
        ]
        if self.rank:
            return None
        return torch.cat(parts, dim=-1), torch.cat([F.linear(x, w) for w in (wq, wk, wv)], dim=-1)

    def mlp(self, seed: int, hidden: int = 8, inter: int = 12):
        """gate/up merged column-parallel, SiluAndMul on the shard, down row-parallel: the one
        all-reduce of a Llama MLP."""
        g = torch.Generator().manual_seed(seed)
        wg, wu = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g)
        wd, x = torch.randn(hidden, inter, generator=g), torch.randn(5, hidden, generator=g)
        gate_up = MergedColumnParallelLinear(hidden, [inter, inter], **self.tp)
        self._load(gate_up.weight, wg, 0)
        self._load(gate_up.weight, wu, 1)
        down = RowParallelLinear(inter, hidden, **self.tp)
        self._load(down.weight, wd)
        y = down(SiluAndMul()(gate_up(x)))
        return y, F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)

    def embedding(self, seed: int, vocab: int = 37, dim: int = 6):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(vocab, dim, generator=g)
        ids = torch.tensor([0, 1, 17, 18, 19, 36, 5, 36])  # both shards, both edges, the padded tail
        layer = VocabParallelEmbedding(vocab, dim, **self.tp)
        self._load(layer.weight, w)
        return layer(ids), F.embedding(ids, w)

    def lm_head(self, seed: int, vocab: int = 37, dim: int = 6):
        g = torch.Generator().manual_seed(seed)
        w, x = torch.randn(vocab, dim, generator=g), torch.randn(4, dim, generator=g)
        layer = ParallelLMHead(vocab, dim, **self.tp)
        self._load(layer.weight, w)
        return layer(x), F.linear(x, w)


class EchoRunner:
    """The smallest runner: proves that calls reach every rank and that the ranks communicate."""

    def __init__(self, rank: int):
        self.rank = rank
        self.calls = 0

    def rank_sum(self, scale: int) -> int:
        self.calls += 1
        t = torch.tensor([self.rank * scale + self.calls])
        if dist.is_initialized():  # one rank (LocalExecutor) has nobody to reduce with
            dist.all_reduce(t)
        return int(t.item())


class FailingRunner(EchoRunner):
    def __init__(self, rank: int):
        if rank == 1:
            raise ValueError("checkpoint shard missing on rank 1")
        super().__init__(rank)


class FailingMidCollectiveRunner(EchoRunner):
    """Rank 0 enters a start-up collective (as ``ModelRunner`` does to agree on the KV cache
    size) that rank 1, failing first, never joins."""

    def __init__(self, rank: int):
        if rank == 1:
            raise ValueError("checkpoint shard missing on rank 1")
        dist.all_reduce(torch.zeros(1))
        super().__init__(rank)


# ---- process and /dev/shm inspection ---------------------------------------------------------


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (dead, not yet reaped by a sloppy init) counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pids, timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (workers, multiprocessing's resource tracker, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return [p for p in found if _alive(p)]


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


# What this stack can put in /dev/shm: multiprocessing's SharedMemory blocks and semaphores,
# torch's shared tensors, NCCL's transport segments, Intel OpenMP's registration file.
OUR_SHM_PREFIXES = ("psm_", "sem.mp-", "mp-", "torch_", "nccl", "__KMP_REGISTERED_LIB")


def _leaked_shm(before: set[str]) -> set[str]:
    """New ``/dev/shm`` entries of the kinds this stack creates that no live process holds.

    Other chapters' tests may run beside these on the same machine (Mooncake, for one) and
    create entries of their own: only our kinds count, and an entry must stay unheld for a
    second (not just be caught between its creation and its first mapping) to be a leak.
    """

    def unheld() -> set[str]:
        new = {n for n in _shm_entries() - before if n.startswith(OUR_SHM_PREFIXES)}
        if not new:
            return set()
        held: set[str] = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                held.update(
                    line.rsplit("/dev/shm/", 1)[1].split()[0]
                    for line in (entry / "maps").read_text().splitlines()
                    if "/dev/shm/" in line
                )
                for fd in (entry / "fd").iterdir():
                    target = os.readlink(fd)
                    if target.startswith("/dev/shm/"):
                        held.add(target[len("/dev/shm/") :].split()[0])
            except OSError:
                continue
        return new - held

    first = unheld()
    if not first:
        return set()
    time.sleep(1.0)
    return first & unheld()


# ---- the layers, on 2 gloo ranks --------------------------------------------------------------


class TestParallelLayersOnTwoRanks:
    """One 2-rank group for all layer checks (class scope: it is gone before the engine tests,
    which need this process's default process group for themselves)."""

    @pytest.fixture(scope="class")
    def ranks(self):
        executor = TensorParallelExecutor(LayerCheckRunner, world_size=TP, device="cpu")
        yield executor
        executor.shutdown()

    @pytest.mark.parametrize(
        "method,kwargs",
        [
            ("column", {}),
            ("column", {"bias": False}),
            ("row", {}),
            ("row", {"bias": False}),
            ("qkv", {}),
            ("mlp", {}),
            ("embedding", {}),
            ("lm_head", {}),
        ],
    )
    def test_layer_equals_unsharded(self, ranks, method, kwargs):
        got, expected = ranks.call(method, 1234, **kwargs)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-5)

    def test_embedding_shards_cover_the_vocabulary_once(self, ranks):
        # 37 ids over 2 ranks: rank 0 owns [0, 19), rank 1 [19, 37) plus one zero pad row.
        e0 = VocabParallelEmbedding(37, 4, tp_rank=0, tp_size=2)
        e1 = VocabParallelEmbedding(37, 4, tp_rank=1, tp_size=2)
        assert (e0.vocab_start_idx, e0.vocab_end_idx, e1.vocab_start_idx, e1.vocab_end_idx) == (0, 19, 19, 37)


# ---- the executor's life cycle ------------------------------------------------------------------


def test_calls_reach_every_rank_and_shutdown_reaps_the_workers():
    shm_before = _shm_entries()
    threads = torch.get_num_threads()
    executor = TensorParallelExecutor(EchoRunner, world_size=TP)
    pids = executor.worker_pids
    assert len(pids) == TP - 1 and all(_alive(p) for p in pids)
    # rank r contributes r*scale + calls: the sum proves both ranks ran every call, in order.
    assert executor.call("rank_sum", 10) == (0 + 1) + (10 + 1)
    assert executor.call("rank_sum", 100) == (0 + 2) + (100 + 2)
    executor.shutdown()
    executor.shutdown()  # idempotent
    assert _wait_gone(pids) == []
    assert not dist.is_initialized()
    assert torch.get_num_threads() == threads  # rank 0's CPU-thread share is given back
    with pytest.raises(RuntimeError, match="shut down"):
        executor.call("rank_sum", 1)
    assert _leaked_shm(shm_before) == set()


def test_garbage_collected_executor_takes_its_workers_with_it():
    executor = TensorParallelExecutor(EchoRunner, world_size=TP)
    pids = executor.worker_pids
    assert executor.call("rank_sum", 1) == 3
    del executor
    gc.collect()
    assert _wait_gone(pids) == []
    assert not dist.is_initialized()


def _new_children(before: set[int]) -> list[int]:
    """Processes below this one that were not there before, leaving out multiprocessing's
    resource tracker (one per process, started by the first spawn, on purpose long-lived)."""

    def is_tracker(pid: int) -> bool:
        try:
            return b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False

    return [p for p in _descendants(os.getpid()) if p not in before and not is_tracker(p)]


@pytest.mark.parametrize("runner_cls", [FailingRunner, FailingMidCollectiveRunner])
def test_a_rank_that_fails_to_start_is_reported_not_waited_for(runner_cls):
    before = set(_descendants(os.getpid()))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)rank 1.*checkpoint shard missing"):
        TensorParallelExecutor(runner_cls, world_size=TP)
    assert time.monotonic() - start < 60
    assert _wait_gone(_new_children(before)) == []
    assert not dist.is_initialized()


def test_make_executor_runs_one_rank_in_process():
    executor = make_executor(partial(EchoRunner), world_size=1)
    assert isinstance(executor, LocalExecutor) and executor.worker_pids == []
    assert executor.call("rank_sum", 5) == 1  # no all-reduce partner: only rank 0's 0*5 + 1
    with pytest.raises(ValueError, match="world_size"):
        TensorParallelExecutor(EchoRunner, world_size=1)


class SlowStartRunner(EchoRunner):
    """Rank 1 takes "forever" to load its shard, so it sits in Python code, not in a collective."""

    def __init__(self, rank: int):
        if rank == 1:
            Path(os.environ["VFS_TP_MARK"]).write_text(str(os.getpid()))
            time.sleep(120)
        super().__init__(rank)


_PARENT = textwrap.dedent("""
    import sys, time
    from vllm_from_scratch.distributed import TensorParallelExecutor
    from test_tensor_parallel import EchoRunner, SlowStartRunner
    if sys.argv[1] == "kill-while-starting":
        TensorParallelExecutor(SlowStartRunner, world_size=2)
    executor = TensorParallelExecutor(EchoRunner, world_size=2)
    assert executor.call("rank_sum", 1) == 3
    print(" ".join(map(str, executor.worker_pids)), flush=True)
    if sys.argv[1] == "kill":
        time.sleep(120)
    # "exit": leave without shutdown(); the interpreter's exit must reap the workers.
""")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "kill", "kill-while-starting"])
def test_no_orphans_when_the_parent_exits_or_is_killed(how, tmp_path):
    """The engine's process ends without calling shutdown (normal exit) or is SIGKILLed (no
    Python cleanup at all): every process it started must disappear, and no /dev/shm entry stay.

    A SIGKILL while the workers serve calls is also noticed by gloo (the peer's socket closes);
    a SIGKILL while a worker is still loading its shard is noticed only by the worker's
    parent watchdog, as is any parent death under NCCL, which does not watch its peers' sockets.
    """
    shm_before = _shm_entries()
    mark = tmp_path / "rank1-loading"
    env = dict(
        os.environ,
        VFS_TP_MARK=str(mark),
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, how], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        if how == "kill-while-starting":
            deadline = time.monotonic() + 60
            while not mark.exists() and parent.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert mark.exists(), parent.stderr.read()
        else:
            line = parent.stdout.readline()
            assert line.strip(), parent.stderr.read()
            assert set(map(int, line.split())) <= set(_descendants(parent.pid))
        spawned = _descendants(parent.pid)  # workers and multiprocessing's resource tracker
        assert spawned
        if how.startswith("kill"):
            parent.send_signal(signal.SIGKILL)
        assert parent.wait(timeout=60) == (-signal.SIGKILL if how.startswith("kill") else 0)
        assert _wait_gone(spawned) == []
        assert _leaked_shm(shm_before) == set()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_requests_travel_to_workers_without_generator():
    """A request is pickled to every worker every step: the core's request holds no tokenizer
    (text is the output processor's, on rank 0) and its seeded generator stays behind."""
    import pickle

    from vllm_from_scratch.engine import EngineRequest
    from vllm_from_scratch.input_processor import EngineCoreRequest
    from vllm_from_scratch.sampling_params import SamplingParams

    core_request = EngineCoreRequest("r0", "a prompt", [5, 6, 7], SamplingParams(seed=3, max_tokens=4))
    req = EngineRequest(core_request, eos_token_ids=[2], block_size=8)
    payload = pickle.dumps(req)
    assert len(payload) < 4096
    copy = pickle.loads(payload)
    assert copy.generator is None and req.generator is not None
    assert copy.token_ids == req.token_ids and copy.block_table == req.block_table


# ---- the engine with tensor_parallel_size=2 -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_llm_tp2_greedy_equals_transformers(arch, tiny_llama_dir, tiny_qwen3_dir):
    """Two gloo ranks, each holding half the heads, half the MLP and half the vocabulary. Llama
    runs with prefix caching and a KV cache too small for the batch (preemption: nano-vllm's TP
    broke there, its issue #145); then the workers must be gone after ``shutdown()`` (llama) or
    after the LLM is simply dropped (qwen3)."""
    from test_engine_parity import BLOCK, GREEDY, assert_no_leak, hf_greedy, make_prompts
    from vllm_from_scratch import LLM

    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen3_dir
    features = (
        dict(enable_prefix_caching=True, num_kvcache_blocks=12)
        if arch == "llama"
        else dict(enable_prefix_caching=False, num_kvcache_blocks=64)
    )
    llm = LLM(
        model_dir,
        tensor_parallel_size=TP,
        device="cpu",
        dtype="float32",
        kvcache_block_size=BLOCK,
        enable_chunked_prefill=False,
        **features,
        enforce_eager=True,
    )
    pids = llm.llm_engine.executor.worker_pids
    assert len(pids) == TP - 1 and all(_alive(p) for p in pids)
    prompts = make_prompts(0)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(model_dir, tuple(prompt)), f"prompt of {len(prompt)} tokens"
    assert_no_leak(llm)
    if arch == "llama":
        assert llm.llm_engine.get_stats()["num_preemptions_total"] > 0
        llm.shutdown()
    else:
        del llm, outs
        gc.collect()
    assert _wait_gone(pids) == []
    assert not dist.is_initialized()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < TP, reason=f"NCCL tensor parallelism needs {TP} GPUs")
def test_llm_tp2_over_nccl_greedy_equals_transformers(tiny_llama_dir):
    """The GPU path of the test above: one rank per GPU, NCCL all-reduces, CUDA graphs captured on
    every rank; greedy output equals transformers' (run on the CPU in float32) token for token."""
    from test_engine_parity import BLOCK, GREEDY, assert_no_leak, hf_greedy, make_prompts
    from vllm_from_scratch import LLM

    llm = LLM(tiny_llama_dir, tensor_parallel_size=TP, device="cuda", dtype="float32", kvcache_block_size=BLOCK)
    prompts = make_prompts(0)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(tiny_llama_dir, tuple(prompt)), f"prompt of {len(prompt)} tokens"
    assert_no_leak(llm)
    llm.shutdown()
    assert not dist.is_initialized()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() >= TP, reason=f"checks the error raised with fewer than {TP} GPUs")
def test_tp_on_too_few_gpus_is_refused_before_any_worker_starts(tiny_llama_dir):
    from vllm_from_scratch import LLM

    with pytest.raises(ValueError, match=f"world_size={TP} needs {TP} GPUs"):
        LLM(tiny_llama_dir, tensor_parallel_size=TP, device="cuda", dtype="float32")


def test_bench_tensor_parallel_help():
    script = Path(__file__).parents[1] / "benchmarks" / "bench_tensor_parallel.py"
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--tp" in out.stdout
