"""The engine's settings: one list, validated once, shared by the engine, the model runner and
workers, and the source of every command-line flag (:meth:`EngineConfig.add_cli_args`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
from transformers import PretrainedConfig

from attention_backends import BACKENDS
from vllm_from_scratch.errors import ParameterError
from vllm_from_scratch.loader import DTYPE_ALIASES, DTYPES, load_config, resolve_dtype
from vllm_from_scratch.sampling_params import check_int
from vllm_from_scratch.vllm_env import check_environment, cpu_kvcache_space_gib

log = logging.getLogger(__name__)

SCHEDULING_POLICIES = ("fcfs", "priority")
# The server's token budget on a CPU, and the most tokens one prompt may take of it in a step.
# On the book's 2-core CPU a step carrying a prompt chunk costs about 0.6 ms a token plus its
# attention over the context, and a prompt that scores its logprobs 0.7 ms a token more: at the
# 4,000th token of such a prompt, beside 16 decoding requests, a step took 0.35 s with 128-token
# chunks, 0.97 s with 256 and 1.45 s with 384, so one prompt takes at most 128 a step. Several
# prompts share the 512, so that a burst's last prompt waits for fewer, larger steps: on vLLM's
# serving benchmark the p99 time to first token was 2.84 s against 3.35 with a budget of 128 in
# all, and vLLM's CPU server's 3.10 (07_engine/topics/sharing.md).
SERVING_CPU_TOKEN_BUDGET = 512
SERVING_CPU_PROMPT_CHUNK = 128
SPEC_METHODS = ("ngram", "draft_model")
# vLLM's -O levels: 0 runs op by op; 1-3 compile (on a GPU: capture CUDA graphs).
OPTIMIZATION_LEVELS = (0, 1, 2, 3)
# max_model_len's "as long as the model allows" (vLLM's -1, or "auto" on the command line).
MODEL_MAX_LEN = -1
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


# ------------------------------------------------------------------ vLLM's value syntax
# A size with a suffix: lower case is decimal (1k = 1,000), upper case binary (1K = 1,024).
SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """vLLM's sizes on the command line: ``4k`` is 4,000 and ``4K`` 4,096; a decimal mantissa
    only with a decimal suffix (``25.6k``, computed in floating point and truncated, as vLLM
    does); anything else is a plain int. ``argparse.ArgumentTypeError`` otherwise."""
    text = text.strip()
    match = SIZE_RE.fullmatch(text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int or a size such as 4k or 4K") from None
    number, suffix = match.groups()
    if suffix in DECIMAL_SUFFIXES:
        return int(float(number) * DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a binary suffix ({suffix}) takes a whole number; {number}{suffix.lower()} is decimal"
        )
    return int(number) * BINARY_SUFFIXES[suffix]


def human_readable_int_or_auto(text: str) -> int:
    """:func:`human_readable_int`, or ``auto`` / ``-1``: -1, vLLM's "as long as the model allows"."""
    if text.strip().lower() == "auto":
        return MODEL_MAX_LEN
    return human_readable_int(text)


def log_level(text: str) -> str:
    """A logging level in any case (vLLM spells them in capitals)."""
    return text.upper()


def _check_keys(name: str, config: object, cls: type) -> None:
    """``config`` must be a dict whose keys are fields of the dataclass ``cls``."""
    if not isinstance(config, dict):
        raise ParameterError(name, f"must be a dict or None, got {config!r}")
    unknown = sorted(set(config) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ParameterError(name, f"has unknown keys {unknown}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``speculative_config``, checked once, with vLLM's keys.

    ``method`` ("ngram" or "draft_model"), ``num_speculative_tokens`` (k >= 1), ``model`` (the
    draft checkpoint directory, draft_model only; it loads through the same model registry as
    the target), ``prompt_lookup_min`` / ``prompt_lookup_max`` (n-gram sizes, ngram only).
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    @classmethod
    def from_dict(cls, config: dict) -> SpeculativeConfig:
        """Parse a user's dict; :class:`ParameterError` naming the key that is wrong."""
        _check_keys("speculative_config", config, cls)
        if config.get("method") not in SPEC_METHODS:
            raise ParameterError(
                "speculative_config['method']", f"must be one of {SPEC_METHODS}, got {config.get('method')!r}"
            )
        k = config.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ParameterError("speculative_config['num_speculative_tokens']", f"must be an int >= 1, got {k!r}")
        if config["method"] == "draft_model" and config.get("model") is None:
            raise ParameterError(
                "speculative_config['model']", "(a draft checkpoint directory) is required for draft_model"
            )
        return cls(**{**config, "model": None if config.get("model") is None else str(config["model"])})


KV_CONNECTORS = ("mooncake", "embedded")
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")


@dataclass(frozen=True)
class KVTransferConfig:
    """``kv_transfer_config``, checked once, with vLLM's keys: the engine's global KV pool.

    ``kv_connector``: "mooncake" (the real Mooncake store: ``master_server_address`` "HOST:PORT"
    and ``metadata_server`` "http://HOST:PORT/metadata" are required) or "embedded" (an
    in-process pool: a second tier behind the local prefix cache, private to this process).
    ``kv_role``: "kv_both" (load and publish), "kv_producer" (publish only: a prefill instance),
    "kv_consumer" (load only: a decode instance). ``global_segment_size``: bytes this instance
    lends the pool (Mooncake; 0 lends nothing: values then live in other instances' segments or
    a ``mooncake_client``), or the embedded pool's capacity. ``protocol``: "tcp" or "rdma".
    """

    kv_connector: str
    kv_role: str = "kv_both"
    master_server_address: str | None = None
    metadata_server: str | None = None
    protocol: str = "tcp"
    global_segment_size: int = 256 << 20

    @classmethod
    def from_dict(cls, config: dict) -> KVTransferConfig:
        """Parse a user's dict; :class:`ParameterError` naming the key that is wrong."""
        _check_keys("kv_transfer_config", config, cls)
        if "kv_connector" not in config:
            raise ParameterError("kv_transfer_config['kv_connector']", f"is required: one of {KV_CONNECTORS}")
        parsed = cls(**config)
        if parsed.kv_connector not in KV_CONNECTORS:
            raise ParameterError(
                "kv_transfer_config['kv_connector']", f"must be one of {KV_CONNECTORS}, got {parsed.kv_connector!r}"
            )
        if parsed.kv_role not in KV_ROLES:
            raise ParameterError("kv_transfer_config['kv_role']", f"must be one of {KV_ROLES}, got {parsed.kv_role!r}")
        if parsed.protocol not in ("tcp", "rdma"):
            raise ParameterError("kv_transfer_config['protocol']", f"must be 'tcp' or 'rdma', got {parsed.protocol!r}")
        size = parsed.global_segment_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ParameterError("kv_transfer_config['global_segment_size']", f"must be an int >= 0, got {size!r}")
        if parsed.kv_connector == "mooncake":
            for key in ("master_server_address", "metadata_server"):
                if not isinstance(getattr(parsed, key), str) or not getattr(parsed, key):
                    raise ParameterError(f"kv_transfer_config['{key}']", "is required for the mooncake connector")
        return parsed

    @property
    def loads(self) -> bool:
        return self.kv_role in ("kv_both", "kv_consumer")

    @property
    def publishes(self) -> bool:
        return self.kv_role in ("kv_both", "kv_producer")


STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """``structured_outputs_config``, with vLLM's keys: ``backend`` ("auto" or "xgrammar", the
    one this engine has) and ``disable_any_whitespace`` (JSON output without whitespace between
    its tokens, for every request)."""

    backend: str = "auto"
    disable_any_whitespace: bool = False

    @classmethod
    def from_dict(cls, config: dict) -> StructuredOutputsConfig:
        """Parse a user's dict; :class:`ParameterError` naming the key that is wrong."""
        _check_keys("structured_outputs_config", config, cls)
        parsed = cls(**config)
        if parsed.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ParameterError(
                "structured_outputs_config['backend']",
                f"must be one of {STRUCTURED_OUTPUT_BACKENDS}, got {parsed.backend!r}",
            )
        if not isinstance(parsed.disable_any_whitespace, bool):
            raise ParameterError(
                "structured_outputs_config['disable_any_whitespace']",
                f"must be true or false, got {parsed.disable_any_whitespace!r}",
            )
        return parsed


def resolve_device(device: str) -> torch.device:
    """``"auto"`` is CUDA when present, else CPU; anything else must name a usable device."""
    if not isinstance(device, (str, torch.device)):
        raise ParameterError("device", f"must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ParameterError("device", f"must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ParameterError("device", f"must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ParameterError("device", f"{device!r} asks for CUDA, which is not available")
    return dev


def _positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ParameterError(name, f"must be a positive int, got {value!r}")


def setting(help: str, default: Any = None, **cli: Any) -> Any:
    """An :class:`EngineConfig` field: its default, its ``--help`` text, and how the command line
    spells it when that differs from the field's name: ``flag=`` (another long name),
    ``aliases=`` (vLLM's short forms, ``-tp``), ``choices=``, ``parse=`` (the text's parser, for
    vLLM's value syntax such as ``4k``). (Typed ``Any``, like ``dataclasses.field`` to a type
    checker, so a field keeps its own type.)"""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineConfig:
    """Everything ``LLM(...)``/``LLMEngine(...)`` accept, with defaults filled in.

    Each field's ``help`` says what it does and what ``None`` means; the server's flags are
    generated from this list (:meth:`add_cli_args`), so a setting exists in one place. A field
    typed ``int`` whose help says "None: ..." accepts None and holds the resolved number once
    the config is built, so the engine never handles a None there.

    ``enforce_eager`` means what it means in vLLM: off (the default), the forward runs through
    graphs made once at start-up — compiled by inductor on a CPU (:attr:`compiles`), captured as
    CUDA graphs on a GPU; on, every forward runs the model's Python code op by op.
    """

    model_dir: str
    device: str = setting("'auto' (CUDA when present, else CPU), 'cpu' or 'cuda[:N]'", "auto")
    dtype: str | None = setting(
        "'auto' (or None): bfloat16 on a GPU, and on a CPU with bfloat16 in hardware "
        "(AVX-512 BF16, AMX), else float32; or a dtype name",
        "auto",
        choices=("auto", *DTYPES, *DTYPE_ALIASES),
    )
    kv_cache_dtype: str = setting(
        "dtype of the KV cache: 'auto' (or the model's own dtype's name) keeps it in the model's dtype; "
        "the quantized caches of vLLM (fp8, int8 and the like) are refused at start-up",
        "auto",
    )
    tokenizer: str | None = setting("tokenizer directory; None: the model directory's")
    tensor_parallel_size: int = setting("ranks to split the model over (gloo on CPU, NCCL on GPU)", 1, aliases=("-tp",))
    pipeline_parallel_size: int = setting(
        "pipeline stages: only 1 (the engine splits a model by tensor parallelism, -tp)", 1, aliases=("-pp",)
    )
    data_parallel_size: int = setting(
        "engine replicas behind this server: only 1 (start one server per replica behind a load balancer)",
        1,
        aliases=("-dp",),
    )
    optimization_level: int | None = setting(
        "vLLM's -O: 0 runs every forward op by op (as enforce_eager); 1, 2 and 3 compile (inductor's "
        "graphs on a CPU, CUDA graphs on a GPU: the engine has one compiled mode, so they mean the same); "
        "None: as enforce_eager says",
        aliases=("-O",),
        choices=OPTIMIZATION_LEVELS,
    )
    enforce_eager: bool = setting(
        "run every forward eagerly, op by op. Off: a GPU captures CUDA graphs, a CPU (with "
        "tensor_parallel_size 1) runs graphs that inductor compiled ahead of time (compilation.py): "
        "the first start with a model, dtype and thread count compiles them (minutes on 2 cores) "
        "into ~/.cache/vllm_from_scratch, later starts load them in seconds",
        False,
    )
    max_num_seqs: int = setting("most requests in one batch (chapter 04)", 256)
    max_n_sequences: int = setting(
        "most completions one request may ask for (SamplingParams.n; vLLM's VLLM_MAX_N_SEQUENCES); "
        "None: max_num_seqs, so that a request's completions fit in one batch"
    )
    max_num_batched_tokens: int = setting(
        "token budget of one step (vLLM's sizes: 2k, 2K); None: 2048 with chunked prefill (512 for the "
        "server on a CPU, each prompt at most 128 of it: a step with a prompt chunk then stays well under "
        "a second on 2 cores), else max(max_model_len, 8192)",
        parse=human_readable_int,
    )
    max_model_len: int = setting(
        "longest prompt + output (vLLM's sizes: 4k is 4000, 4K 4096); -1 (auto): the model's "
        "max_position_embeddings, as in vLLM; None: that, but at most 4096 (a longer context's KV cache "
        "may not fit a CPU's default 2 GiB)",
        parse=human_readable_int_or_auto,
    )
    kvcache_block_size: int = setting(
        "tokens per KV block (chapter 01); None: 16, or 256 with flash-attn", flag="--block-size"
    )
    num_kvcache_blocks: int | None = setting(
        "KV blocks to allocate; None: sized from memory", aliases=("--num-gpu-blocks-override",)
    )
    gpu_memory_utilization: float = setting(
        "share of the GPU's memory the engine may use", 0.9, aliases=("--device-memory-utilization",)
    )
    cpu_kvcache_space_gib: float = setting(
        "KV cache size in GiB on a CPU when num_kvcache_blocks is None; None: VLLM_CPU_KVCACHE_SPACE "
        "(GiB, as in vLLM) when set, else 2"
    )
    enable_prefix_caching: bool = setting("share KV blocks of equal prefixes (chapter 03)", True)
    enable_chunked_prefill: bool = setting("split long prompts into chunks beside decodes (chapter 06)", True)
    long_prefill_token_threshold: int | None = setting(
        "most tokens of one prompt per step (chapter 06); None: only the budget limits it (128 for the "
        "server on a CPU when the budget is its default)"
    )
    scheduling_policy: str = setting(
        "'fcfs', or 'priority': lower `priority` values first (chapter 04)", "fcfs", choices=SCHEDULING_POLICIES
    )
    attention_backend: str = setting(
        "paged attention implementation (chapter 02); 'auto' picks by device", "auto", choices=BACKENDS
    )
    speculative_config: dict | None = setting(
        'speculative decoding (chapter 05), e.g. {"method": "ngram", "num_speculative_tokens": 4}', aliases=("-sc",)
    )
    kv_transfer_config: dict | None = setting(
        'the global KV pool (chapter 03) as a KV connector, e.g. {"kv_connector": "mooncake", "kv_role": '
        '"kv_both", "master_server_address": "HOST:PORT", "metadata_server": "http://HOST:PORT/metadata"}'
    )
    structured_outputs_config: dict | None = setting(
        'structured outputs (JSON schemas, regexes, grammars), e.g. {"backend": "xgrammar", '
        '"disable_any_whitespace": true}'
    )
    warm_up: bool = setting(
        "before the first request, run a prefill of each power of two up to the token budget "
        "and a decode step of each batch size up to max_num_seqs, so that the first batch "
        "runs as fast as the tenth (seconds at start-up on a CPU)",
        True,
    )
    disable_log_stats: bool = setting(
        "record no vllm: metrics and log no stats line (vLLM's flag): the server's /metrics keeps its "
        "HTTP and process families, and the line of throughputs, running and waiting requests, KV "
        "cache use and prefix cache hits every VLLM_LOG_STATS_INTERVAL seconds (default 10) stops. "
        "The offline LLM turns it on unless asked (LLM.get_metrics needs it off)",
        False,
    )
    seed: int | None = setting(
        "the engine's global random seed (vLLM's): a request without its own SamplingParams.seed "
        "samples from the engine's random stream, which starts from this seed, so the same requests "
        "in the same order give the same tokens on every run; None: a stream seeded by the OS",
        0,
    )
    trust_remote_code: bool = setting(
        "accepted for vLLM's scripts; the engine never runs a checkpoint's own Python: a config.json "
        "that asks for it (auto_map) is read and run by the engine's own model classes, with a warning",
        False,
    )
    step_trace: str | None = setting(
        "write one JSON line per engine step to this file (docs/step_trace.md); None: no trace, no cost"
    )
    # Whom the engine serves, which only some defaults depend on (vLLM's usage context): the
    # server passes True. Not a setting of its own (no flag).
    serving: bool = False
    hf_config: PretrainedConfig = field(init=False, repr=False)
    torch_dtype: torch.dtype = field(init=False, repr=False)
    torch_device: torch.device = field(init=False, repr=False)
    speculative: SpeculativeConfig | None = field(default=None, init=False, repr=False)
    kv_transfer: KVTransferConfig | None = field(default=None, init=False, repr=False)
    structured_outputs: StructuredOutputsConfig = field(default=StructuredOutputsConfig(), init=False, repr=False)

    def __post_init__(self) -> None:
        check_environment()
        self.hf_config = load_config(self.model_dir)
        self.torch_device = resolve_device(self.device)
        self.torch_dtype = resolve_dtype(self.dtype, self.torch_device)
        for name in ("tensor_parallel_size", "max_num_seqs", "pipeline_parallel_size", "data_parallel_size"):
            _positive_int(name, getattr(self, name))
        self._refuse_what_the_engine_lacks()
        if self.max_model_len != MODEL_MAX_LEN:
            _positive_int("max_model_len", self.max_model_len, allow_none=True)
        for name in (
            "max_num_batched_tokens",
            "kvcache_block_size",
            "num_kvcache_blocks",
            "long_prefill_token_threshold",
            "max_n_sequences",
        ):
            _positive_int(name, getattr(self, name), allow_none=True)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ParameterError(
                "scheduling_policy", f"must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        if self.attention_backend not in BACKENDS:
            raise ParameterError("attention_backend", f"must be one of {BACKENDS}, got {self.attention_backend!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ParameterError("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.seed is not None:
            check_int("seed", self.seed, -(2**63), 2**64 - 1)
        if not isinstance(self.trust_remote_code, bool):
            raise ParameterError("trust_remote_code", f"must be true or false, got {self.trust_remote_code!r}")
        self._warn_remote_code()
        if self.cpu_kvcache_space_gib is None:
            self.cpu_kvcache_space_gib = cpu_kvcache_space_gib()
        if self.cpu_kvcache_space_gib <= 0:
            raise ParameterError("cpu_kvcache_space_gib", f"must be positive, got {self.cpu_kvcache_space_gib!r}")
        max_pos = getattr(self.hf_config, "max_position_embeddings", 4096)
        if self.max_model_len == MODEL_MAX_LEN:
            self.max_model_len = max_pos
        elif self.max_model_len is None:
            self.max_model_len = min(max_pos, 4096)
        elif self.max_model_len > max_pos:
            raise ParameterError(
                "max_model_len", f"({self.max_model_len}) exceeds the model's max_position_embeddings ({max_pos})"
            )
        if self.max_num_batched_tokens is None:
            if not self.enable_chunked_prefill:
                self.max_num_batched_tokens = max(self.max_model_len, 8192)
            elif self.serving and self.torch_device.type == "cpu":
                self.max_num_batched_tokens = SERVING_CPU_TOKEN_BUDGET
                if self.long_prefill_token_threshold is None:
                    self.long_prefill_token_threshold = SERVING_CPU_PROMPT_CHUNK
            else:
                self.max_num_batched_tokens = 2048
        elif not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ParameterError(
                "max_num_batched_tokens",
                f"({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when enable_chunked_prefill is False",
            )
        if self.max_n_sequences is None:
            self.max_n_sequences = self.max_num_seqs
        if self.kvcache_block_size is None:
            self.kvcache_block_size = 256 if self._uses_flash_attn() else 16
        if self.speculative_config is not None:
            self.speculative = SpeculativeConfig.from_dict(self.speculative_config)
        if self.structured_outputs_config is not None:
            self.structured_outputs = StructuredOutputsConfig.from_dict(self.structured_outputs_config)
        if self.kv_transfer_config is not None:
            self.kv_transfer = KVTransferConfig.from_dict(self.kv_transfer_config)
            if not self.enable_prefix_caching:
                raise ParameterError(
                    "kv_transfer_config",
                    "needs enable_prefix_caching: the pool's keys are the prefix cache's block hashes",
                )

    def _refuse_what_the_engine_lacks(self) -> None:
        """vLLM's settings that ask for a set-up this engine does not build: a
        :class:`ParameterError` naming the setting and the value, before any weight is loaded."""
        if self.pipeline_parallel_size != 1:
            raise ParameterError(
                "pipeline_parallel_size",
                f"={self.pipeline_parallel_size}: the engine has no pipeline stages; split the model "
                "with tensor_parallel_size (-tp) instead",
            )
        if self.data_parallel_size != 1:
            raise ParameterError(
                "data_parallel_size",
                f"={self.data_parallel_size}: one server runs one engine; start {self.data_parallel_size} "
                "servers and balance the load between them",
            )
        if self.optimization_level is not None and self.optimization_level not in OPTIMIZATION_LEVELS:
            raise ParameterError(
                "optimization_level", f"must be one of {OPTIMIZATION_LEVELS}, got {self.optimization_level!r}"
            )
        if self.optimization_level == 0:
            self.enforce_eager = True
        model_dtype = str(self.torch_dtype).removeprefix("torch.")
        if self.kv_cache_dtype not in ("auto", model_dtype):
            raise ParameterError(
                "kv_cache_dtype",
                f"={self.kv_cache_dtype!r}: the KV cache is kept in the model's dtype ({model_dtype}); "
                "use 'auto' (quantized caches are not built)",
            )

    def _warn_remote_code(self) -> None:
        """Say what the engine does instead when the checkpoint asks for its own Python."""
        auto_map = getattr(self.hf_config, "auto_map", None)
        if not auto_map:
            return
        architecture = (getattr(self.hf_config, "architectures", None) or ["?"])[0]
        log.warning(
            "%s asks for remote code (config.json auto_map: %s); the engine runs no checkpoint code%s: it reads "
            "the config with %s and runs its own %s (vllm_from_scratch.models) on the checkpoint's weights",
            self.model_dir,
            ", ".join(sorted(auto_map)),
            ", trust_remote_code=True changes nothing" if self.trust_remote_code else "",
            type(self.hf_config).__name__,
            architecture,
        )

    def _uses_flash_attn(self) -> bool:
        if self.torch_device.type != "cuda":
            return False
        try:
            from flash_attention import HAS_FLASH_ATTN
        except ImportError:
            return False
        return HAS_FLASH_ATTN

    @property
    def compiles(self) -> bool:
        """Whether the forward runs through inductor's compiled graphs: on a CPU unless
        ``enforce_eager``. Tensor parallelism stays eager: the graphs are traced without the
        all-reduces between the ranks' layers."""
        return not self.enforce_eager and self.torch_device.type == "cpu" and self.tensor_parallel_size == 1

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    # ------------------------------------------------------------------ the command line
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per setting, with vLLM's spellings (``--max-num-seqs``,
        ``--enable-prefix-caching/--no-enable-prefix-caching``, ``--speculative-config JSON``)."""
        _add_setting_flags(cls, parser.add_argument_group("engine settings (EngineConfig)"))

    @classmethod
    def cli_kwargs(cls, args: argparse.Namespace) -> dict:
        """The settings parsed by :meth:`add_cli_args`, as keyword arguments of ``LLMEngine``."""
        return {f.name: getattr(args, f.name) for f in _settings(cls)}


class EngineArgs:
    """vLLM's ``EngineArgs``: a model and the engine's settings, from keywords or from the command
    line, for ``LLMEngine.from_engine_args`` (vLLM's scripts build their engine this way).

    ``model`` is a checkpoint directory (None: the embedded default model); every keyword is an
    :class:`EngineConfig` setting, checked when the engine is built.
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any):
        self.model = model
        self.engine_kwargs = engine_kwargs

    @property
    def model_dir(self) -> str:
        if self.model is not None:
            return self.model
        from vllm_from_scratch.default_model import default_model_dir

        return default_model_dir()

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """``--model`` and one flag per :class:`EngineConfig` setting; returns ``parser``, as vLLM's does."""
        parser.add_argument("--model", help="Hugging Face model directory (default: the embedded default model)")
        EngineConfig.add_cli_args(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(args.model, **EngineConfig.cli_kwargs(args))


SettingsT = TypeVar("SettingsT", bound="CommandLineSettings")


class CommandLineSettings:
    """A settings dataclass the server's command line sets whole: its flags in one ``--help``
    group (:func:`_add_setting_flags`), and the instance back from the parsed arguments."""

    CLI_GROUP: ClassVar[str]  # the group's title in --help

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        _add_setting_flags(cls, parser.add_argument_group(f"{cls.CLI_GROUP} ({cls.__name__})"))

    @classmethod
    def from_cli_args(cls: type[SettingsT], args: argparse.Namespace) -> SettingsT:
        return cls(**{f.name: getattr(args, f.name) for f in _settings(cls)})


@dataclass(frozen=True)
class ServingLimits(CommandLineSettings):
    """What one request may ask of a shared server (07_engine/topics/serving.md, "What a server
    owes its other clients"). A request over a limit is refused before any work, with a 400
    naming the field and the limit; the server's flags are generated from this list."""

    CLI_GROUP = "request limits"

    max_logprobs: int = setting("most top logprobs per token a request may ask for (vLLM's --max-logprobs)", 20)
    max_completion_prompts: int = setting(
        "most prompts in one /v1/completions request (vLLM's VLLM_MAX_COMPLETION_PROMPTS)", 1024
    )
    max_stop_strings: int = setting("most stop strings in one request (vLLM's VLLM_MAX_STOP_STRINGS; OpenAI's 4)", 4)
    max_request_kv_tokens: int = setting(
        "most tokens one request's sequences may hold in the KV cache: n x (prompt + max_tokens), "
        "summed over its prompts (max_tokens null: up to max_model_len); each decode step reads them all",
        262_144,
    )
    max_response_logprobs: int = setting(
        "most logprob entries one response may carry: every token shown with logprobs counts 1 + "
        "its top logprobs, over all n choices, the echoed prompt and prompt_logprobs included",
        1_000_000,
    )

    def __post_init__(self) -> None:
        for f in _settings(type(self)):
            _positive_int(f.name, getattr(self, f.name))


@dataclass(frozen=True)
class ServerConfig(CommandLineSettings):
    """The server's own settings (vLLM's frontend flags), in vLLM's spellings; the engine's are
    :class:`EngineConfig`'s and what one request may ask :class:`ServingLimits`'. The host is the
    one default the book keeps safer than vLLM's (which binds every interface)."""

    CLI_GROUP = "server"

    host: str = setting(
        "address to bind: this machine only, where vLLM listens on every interface; --host 0.0.0.0 "
        "serves other machines (then set an API key)",
        "127.0.0.1",
    )
    port: int = setting("port to bind", 8000)
    served_model_name: list[str] | None = setting(
        "the names clients may pass as `model`, the first one in responses and metrics (vLLM's); "
        "None: the model argument as given"
    )
    api_key: list[str] | None = setting(
        "require `Authorization: Bearer KEY` with any of these keys on every route but /health and "
        "/metrics; None: the VLLM_API_KEY environment variable (which keeps the key out of the "
        "process list), and without it no key"
    )
    generation_config: str = setting(
        "sampling defaults for fields a request leaves unset: 'auto' reads the model's "
        "generation_config.json, 'vllm' uses the engine's own defaults, or a directory holding "
        "a generation_config.json",
        "auto",
    )
    override_generation_config: dict | None = setting(
        "sampling defaults set over --generation-config's, e.g. {\"temperature\": 0.5} (vLLM's)"
    )
    chat_template: str | None = setting(
        "the chat template for /v1/chat/completions: a file, or the Jinja text itself; None: the tokenizer's"
    )
    root_path: str | None = setting("the path prefix a proxy serves this server under (FastAPI's root_path)")
    log_level: str | None = setting(
        "the engine's and the server's logging level, in any case; None: VLLM_LOGGING_LEVEL, else INFO",
        parse=log_level,
        choices=LOG_LEVELS,
    )
    uvicorn_log_level: str | None = setting(
        "uvicorn's logging level (its access log included); None: as --log-level (vLLM's default: info)",
        choices=UVICORN_LOG_LEVELS,
    )
    enable_log_requests: bool = setting("log each request as it arrives: its id, prompt length and sampling", False)
    enable_auto_tool_choice: bool = setting(
        'let the model decide whether to call tools (tool_choice "auto"); needs --tool-call-parser', False
    )
    tool_call_parser: str | None = setting(
        "the format the model writes tool calls in: hermes (<tool_call> JSON: Qwen2.5, Qwen3, Hermes, "
        "SmolLM3) or llama3_json (Llama 3.1+)"
    )
    max_request_bytes: int | None = setting(
        "refuse larger request bodies with a 413 before parsing them; None: 128 bytes per token of "
        "max_model_len, plus 64 KiB",
        parse=human_readable_int,
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ParameterError("port", f"must be in [0, 65535], got {self.port!r}")
        if self.api_key is not None and not all(self.api_key):
            raise ParameterError("api_key", "is empty (an unset shell variable?); leave it out to serve without a key")
        _positive_int("max_request_bytes", self.max_request_bytes, allow_none=True)
        from vllm_from_scratch.tool_calling import TOOL_PARSERS  # the parsers' module, not the settings'

        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ParameterError(
                "tool_call_parser", f"must be one of {sorted(TOOL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ParameterError("enable_auto_tool_choice", "needs --tool-call-parser: the format to read calls in")
        if self.resolved_log_level() not in LOG_LEVELS:
            level = self.resolved_log_level()
            raise ParameterError("VLLM_LOGGING_LEVEL", f"must be one of {LOG_LEVELS}, got {level!r}")

    def resolved_log_level(self) -> str:
        return self.log_level or os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()

    def resolved_uvicorn_log_level(self) -> str:
        """``--uvicorn-log-level``, else ``--log-level``'s in uvicorn's spelling (NOTSET: trace)."""
        level = self.resolved_log_level().lower()
        return self.uvicorn_log_level or ("trace" if level == "notset" else level)


def flag_of(name: str) -> str:
    """How the command line spells setting ``name`` of any settings class, or another argument
    (``config``: ``--config``); an environment variable's name stays as it is. Start-up errors
    name what the user typed."""
    for cls in (ServerConfig, ServingLimits, EngineConfig):
        for f in _settings(cls):
            if f.name == name:
                return setting_flag(f)
    return name if name.isupper() else "--" + name.replace("_", "-")


def _settings(cls: type) -> list[dataclasses.Field]:
    """The fields of a settings dataclass that a caller (or the command line) sets: those made
    with :func:`setting`."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def setting_flag(f: dataclasses.Field) -> str:
    """The command line's long name of a setting: ``--name-with-dashes`` unless it says ``flag=``."""
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def _add_setting_flags(cls: type, group: argparse._ArgumentGroup) -> None:
    """One flag per :func:`setting` of ``cls`` (:func:`setting_flag`, and its ``aliases``); a
    ``bool`` gets vLLM's ``--x/--no-x`` pair, a ``dict`` a JSON object, a ``list`` one or more values."""
    for f in _settings(cls):
        kwargs = dict(dest=f.name, default=f.default, help=f.metadata["help"] + " (default: %(default)s)")
        kind = str(f.type)
        if "bool" in kind:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif "dict" in kind:
            kwargs.update(type=_json_dict(f.name), metavar="JSON")
        elif "list" in kind:
            kwargs["nargs"] = "+"
        else:
            plain = int if "int" in kind else float if "float" in kind else str
            kwargs["type"] = f.metadata.get("parse", plain)
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        group.add_argument(setting_flag(f), *f.metadata.get("aliases", ()), **kwargs)


def _json_dict(name: str) -> Callable[[str], dict]:
    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{name} must be a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{name} must be a JSON object, got {text!r}")
        return value

    return parse
