"""Tensor parallelism over ``torch.distributed``: start the ranks, mirror every call, shut down.

One model is split across ``world_size`` processes ("ranks"). Every rank holds a slice of every
weight (``layers/``) and runs *the same* forward on *the same* inputs; the layers talk only inside
the forward (an all-reduce after each row-parallel linear and after the embedding, a gather of
the logits to rank 0). The scheduler and block manager live on rank 0, the only rank that
samples. The engine reaches the ranks through ``executor.call(method, *args)``, which runs
``ModelRunner.<method>(*args)`` on every rank and returns rank 0's result::

    rank 0 (this process)                               ranks 1..N-1 (spawned workers)
    ─────────────────────                               ──────────────────────────────
    LLMEngine.step()
     ├─ scheduler.schedule() → scheduler_output
     ├─ executor.call("execute_model", scheduler_output)
     │    ├─ broadcast (method, args, kwargs) ───────►  worker loop: receive, then
     │    └─ ModelRunner.execute_model(...)              ModelRunner.execute_model(...)
     │         forward on shard 0 ◄──── all-reduce ───►    forward on shard r
     │         logits ◄───────────────── gather ───────    (no logits: an empty ModelRunnerOutput)
     │         sample, or verify the drafts → ModelRunnerOutput
     └─ scheduler.update_from_output(scheduler_output, sampled_token_ids)

Calls travel over a gloo control group; the compute group is NCCL on a GPU, gloo on the CPU. Why
each choice, against nano-vllm's: 07_engine/topics/tensor_parallel.md, "Starting, calling, stopping".
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

HOST = "127.0.0.1"
# Idle workers wait on the control group, so its timeout bounds how long an engine may sit idle.
CONTROL_TIMEOUT = timedelta(days=365)
COMPUTE_TIMEOUT = timedelta(minutes=10)
STARTUP_TIMEOUT_S = 300.0
EXIT = "__exit__"


def _init_process_groups(
    rank: int, world_size: int, store: dist.Store, device: str | torch.device
) -> dist.ProcessGroup:
    """Join the default (compute) group and create the gloo control group; return the latter."""
    on_gpu = torch.device(device).type == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank)
    else:
        # Every rank would otherwise start one thread per core: N ranks on C cores would run
        # N*C threads that preempt each other between every all-reduce. The affinity mask is a
        # container's CPU set, not the host's core count.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // world_size))
    backend = "nccl" if on_gpu else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=COMPUTE_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def _build_runner(runner_factory: Callable[[int], Any], rank: int) -> tuple[Any, str | None]:
    try:
        return runner_factory(rank), None
    except Exception:
        return None, traceback.format_exc()


def _startup_error(store: dist.Store, world_size: int, rank0_error: str) -> RuntimeError:
    """Rank 0's error plus every worker's traceback that the workers left in the store."""
    reports = [(0, rank0_error)]
    for rank in range(1, world_size):
        key = f"worker_error/{rank}"
        if store.check([key]):
            reports.append((rank, store.get(key).decode()))
    return RuntimeError(
        "tensor-parallel start-up failed:\n" + "\n".join(f"[rank {rank}] {error}" for rank, error in reports)
    )


def _exit_with_parent() -> None:
    """Exit this worker as soon as rank 0's process is gone, however it went."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watchdog", daemon=True).start()


def _worker_main(runner_factory: Callable[[int], Any], rank: int, world_size: int, port: int, device: str) -> None:
    """Entry point of ranks 1..N-1: join the groups, build the runner, serve rank 0's calls."""
    _exit_with_parent()
    store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    store.set(f"worker_up/{rank}", "1")
    control = _init_process_groups(rank, world_size, store, device)
    runner, error = _build_runner(runner_factory, rank)
    if error is not None:
        # Leave the traceback for rank 0 and die now: rank 0 may be inside a collective of its
        # own runner's start-up, and only a closed connection gets it out of there quickly.
        store.set(f"worker_error/{rank}", error)
        sys.stderr.write(error)
        sys.stderr.flush()
        os._exit(1)
    try:
        dist.barrier(group=control)  # tells rank 0 that every runner is built
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=control)
            method, args, kwargs = box[0]
            if method == EXIT:
                break
            getattr(runner, method)(*args, **kwargs)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # rank 0 sees its collective fail instead of waiting for this rank
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _wait_for_workers(store: dist.Store, procs: list[BaseProcess]) -> None:
    """Wait until every worker reached the store, failing fast if one died while starting.

    A blocking ``init_process_group`` would instead wait out its whole timeout for a worker
    that crashed while importing.
    """
    keys = [f"worker_up/{rank}" for rank in range(1, len(procs) + 1)]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not store.check(keys):
        dead = [p for p in procs if p.exitcode is not None]
        if dead:
            raise RuntimeError(
                f"tensor-parallel worker {dead[0].name} exited with code "
                f"{dead[0].exitcode} while starting (see its traceback above)"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel workers did not start in {STARTUP_TIMEOUT_S} s")
        time.sleep(0.02)


class _GroupState:
    """What shutdown needs, kept apart from the executor so the finalizer does not keep it alive."""

    def __init__(self, procs: list[BaseProcess]):
        self.procs = procs
        self.control: dist.ProcessGroup | None = None
        self.closed = False
        self.num_threads = torch.get_num_threads()  # rank 0's share is given back at shutdown


def _shutdown(state: _GroupState, join_timeout_s: float = 10.0) -> None:
    if state.closed:
        return
    state.closed = True
    if state.control is not None and all(p.is_alive() for p in state.procs):
        try:
            dist.broadcast_object_list([(EXIT, (), {})], src=0, group=state.control)
        except Exception:  # a worker already died; terminate below
            pass
    deadline = time.monotonic() + join_timeout_s
    for p in state.procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in state.procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(state.num_threads)


class LocalExecutor:
    """The ``world_size == 1`` executor: the same interface, no processes, no process group."""

    world_size = 1

    def __init__(self, runner_factory: Callable[[int], Any]):
        self.runner = runner_factory(0)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.runner, method)(*args, **kwargs)

    call_rank0 = call  # one rank: rank 0 is every rank

    def shutdown(self) -> None:
        pass

    @property
    def worker_pids(self) -> list[int]:
        return []


class TensorParallelExecutor:
    """Rank 0's handle on a tensor-parallel group: starts ranks 1..N-1, mirrors calls, shuts down.

    Args:
        runner_factory: a picklable ``runner_factory(rank) -> runner``, e.g.
            ``partial(ModelRunner, config)``, called on every rank after it joined the group.
        world_size: number of ranks, at least 2 (``LocalExecutor`` is the 1-rank case).
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, rank r on GPU r).

    One executor per process (rank 0 uses the default ``torch.distributed`` group). Workers are
    *spawned*, which re-imports the main module: a script needs ``if __name__ == "__main__":``.

    Raises:
        ValueError: ``world_size`` below 2, or more than the GPUs there are.
        RuntimeError: a process group already exists, or a rank failed to start (with its
            traceback).
    """

    def __init__(self, runner_factory: Callable[[int], Any], world_size: int, device: str | torch.device = "cpu"):
        if not isinstance(world_size, int) or world_size < 2:
            raise ValueError(f"world_size must be an int >= 2, got {world_size!r}")
        device = str(torch.device(device))
        if torch.device(device).type == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(f"world_size={world_size} needs {world_size} GPUs, found {torch.cuda.device_count()}")
        if dist.is_initialized():
            raise RuntimeError(
                "a torch.distributed process group already exists in this process "
                "(one tensor-parallel engine per process)"
            )
        self.world_size = world_size
        store = dist.TCPStore(
            HOST, 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S)
        )
        ctx = mp.get_context("spawn")
        procs: list[BaseProcess] = [
            ctx.Process(
                target=_worker_main,
                name=f"vllm-fs-tp-rank{rank}",
                daemon=True,
                args=(runner_factory, rank, world_size, store.port, device),
            )
            for rank in range(1, world_size)
        ]
        self._state = _GroupState(procs)
        # Registered before anything can fail, so a failed start still reaps what it started.
        self._finalizer = weakref.finalize(self, _shutdown, self._state)
        try:
            for p in procs:
                p.start()
            _wait_for_workers(store, procs)
            self._state.control = _init_process_groups(0, world_size, store, device)
            self.runner, error = _build_runner(runner_factory, 0)
            if error is None:
                try:
                    dist.barrier(group=self._state.control)
                except Exception:  # a worker died instead of arriving
                    error = traceback.format_exc()
            if error is not None:
                raise _startup_error(store, world_size, error)
        except BaseException:
            self._state.control = None  # the workers are not listening: terminate, don't ask
            self.shutdown()
            raise

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._state.procs if p.pid is not None]

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``runner.method(*args, **kwargs)`` on every rank; return rank 0's result.

        Arguments travel pickled: send CPU tensors or plain lists (a CUDA tensor would be
        unpickled onto rank 0's GPU in every worker).
        """
        if self._state.closed:
            raise RuntimeError("the tensor-parallel executor is shut down")
        dist.broadcast_object_list([(method, args, kwargs)], src=0, group=self._state.control)
        return getattr(self.runner, method)(*args, **kwargs)

    def call_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``runner.method(*args, **kwargs)`` on rank 0 only, which lives in this process: for
        what rank 0 alone answers (its global KV pool's queries and counters)."""
        return getattr(self.runner, method)(*args, **kwargs)

    def shutdown(self) -> None:
        """Stop the workers and leave the process group; safe to call twice."""
        self._finalizer()


def make_executor(
    runner_factory: Callable[[int], Any], world_size: int = 1, device: str | torch.device = "cpu"
) -> LocalExecutor | TensorParallelExecutor:
    """The executor the engine needs: in-process for one rank, spawned workers for more."""
    if world_size == 1:
        return LocalExecutor(runner_factory)
    return TensorParallelExecutor(runner_factory, world_size, device)


def gather_to_first_rank(
    x: torch.Tensor, tp_rank: int, tp_size: int, dim: int = -1, group: dist.ProcessGroup | None = None
) -> torch.Tensor | None:
    """Concatenate every rank's ``x`` along ``dim`` on the group's first rank (None elsewhere):
    the LM head's logits gather. A gather, not an all-gather, because only rank 0 samples."""
    if tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp_size)] if tp_rank == 0 else None
    dist.gather(x, parts, group=group, group_dst=0)
    return None if parts is None else torch.cat(parts, dim=dim)
