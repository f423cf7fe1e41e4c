"""The engine's settings: one list, validated once, shared by the engine, the model runner and
workers, and the source of every command-line flag (:meth:`EngineConfig.add_cli_args`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig

from attention_backends import BACKENDS
from vllm_from_scratch.errors import ParameterError
from vllm_from_scratch.loader import DTYPES, load_config, resolve_dtype

SCHEDULING_POLICIES = ("fcfs", "priority")
# The server's token budget on a CPU. On the book's 2-core CPU a step carrying a prompt chunk
# costs about 0.6 ms a token plus its attention over the context (0.45 s per thousand queries
# over a thousand keys), and a prompt that scores its logprobs 0.7 ms a token more: at the
# 4,000th token of such a prompt, beside 16 decoding requests, a step took 0.35 s with 128-token
# chunks, 0.97 s with 256 and 1.45 s with 384. On the serving benchmark 128 keeps the throughput
# of 2048, halves the mean time to first token and cuts the p99 gap between tokens by 3-4x
# (07_engine/topics/sharing.md).
SERVING_CPU_TOKEN_BUDGET = 128
SPEC_METHODS = ("ngram", "draft_model")


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
    spells it (``flag=``, ``choices=``) when that differs from the field's name. (Typed ``Any``,
    like ``dataclasses.field`` to a type checker, so a field keeps its own type.)"""
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
        choices=("auto", *DTYPES),
    )
    tensor_parallel_size: int = setting("ranks to split the model over (gloo on CPU, NCCL on GPU)", 1)
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
        "token budget of one step; None: 2048 with chunked prefill (128 for the server on a CPU: a "
        "step with a prompt chunk then stays well under a second on 2 cores), else max(max_model_len, 8192)"
    )
    max_model_len: int = setting("longest prompt + output; None: min(max_position_embeddings, 4096)")
    kvcache_block_size: int = setting(
        "tokens per KV block (chapter 01); None: 16, or 256 with flash-attn", flag="--block-size"
    )
    num_kvcache_blocks: int | None = setting("KV blocks to allocate; None: sized from memory")
    gpu_memory_utilization: float = setting("share of the GPU's memory the engine may use", 0.9)
    cpu_kvcache_space_gib: float = setting("KV cache size on a CPU when num_kvcache_blocks is None", 2.0)
    enable_prefix_caching: bool = setting("share KV blocks of equal prefixes (chapter 03)", True)
    enable_chunked_prefill: bool = setting("split long prompts into chunks beside decodes (chapter 06)", True)
    long_prefill_token_threshold: int | None = setting(
        "most tokens of one prompt per step (chapter 06); None: only the budget limits it"
    )
    scheduling_policy: str = setting(
        "'fcfs', or 'priority': lower `priority` values first (chapter 04)", "fcfs", choices=SCHEDULING_POLICIES
    )
    attention_backend: str = setting(
        "paged attention implementation (chapter 02); 'auto' picks by device", "auto", choices=BACKENDS
    )
    speculative_config: dict | None = setting(
        'speculative decoding (chapter 05), e.g. {"method": "ngram", "num_speculative_tokens": 4}'
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
        self.hf_config = load_config(self.model_dir)
        self.torch_device = resolve_device(self.device)
        self.torch_dtype = resolve_dtype(self.dtype, self.torch_device)
        for name in ("tensor_parallel_size", "max_num_seqs"):
            _positive_int(name, getattr(self, name))
        for name in (
            "max_num_batched_tokens",
            "max_model_len",
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
        if self.cpu_kvcache_space_gib <= 0:
            raise ParameterError("cpu_kvcache_space_gib", f"must be positive, got {self.cpu_kvcache_space_gib!r}")
        max_pos = getattr(self.hf_config, "max_position_embeddings", 4096)
        if self.max_model_len is None:
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


@dataclass(frozen=True)
class ServingLimits:
    """What one request may ask of a shared server (07_engine/topics/serving.md, "What a server
    owes its other clients"). A request over a limit is refused before any work, with a 400
    naming the field and the limit; the server's flags are generated from this list."""

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

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        _add_setting_flags(cls, parser.add_argument_group("request limits (ServingLimits)"))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServingLimits:
        return cls(**{f.name: getattr(args, f.name) for f in _settings(cls)})


def _settings(cls: type) -> list[dataclasses.Field]:
    """The fields of a settings dataclass that a caller (or the command line) sets: those made
    with :func:`setting`."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def _add_setting_flags(cls: type, group: argparse._ArgumentGroup) -> None:
    """One flag per :func:`setting` of ``cls``: ``--name-with-dashes`` unless it says ``flag=``."""
    for f in _settings(cls):
        kwargs = dict(dest=f.name, default=f.default, help=f.metadata["help"] + " (default: %(default)s)")
        kind = str(f.type)
        if "bool" in kind:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif "dict" in kind:
            kwargs.update(type=_json_dict(f.name), metavar="JSON")
        elif "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        else:
            kwargs["type"] = int if "int" in kind else float if "float" in kind else str
        group.add_argument(f.metadata.get("flag", "--" + f.name.replace("_", "-")), **kwargs)


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
