"""The engine's settings, validated once, shared by the engine, the model runner and workers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from attention_backends import BACKENDS
from vllm_from_scratch.loader import load_config, resolve_dtype

SCHEDULING_POLICIES = ("fcfs", "priority")
SPEC_METHODS = ("ngram", "draft_model")


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
    def from_dict(cls, config: dict) -> "SpeculativeConfig":
        """Parse a user's dict; ``ValueError`` naming the key that is wrong."""
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict or None, got {config!r}")
        unknown = sorted(set(config) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}")
        if config.get("method") not in SPEC_METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {SPEC_METHODS}, "
                             f"got {config.get('method')!r}")
        k = config.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config['num_speculative_tokens'] must be an int >= 1, got {k!r}")
        if config["method"] == "draft_model" and config.get("model") is None:
            raise ValueError("speculative_config['model'] (a draft checkpoint directory) is required "
                             "for draft_model")
        return cls(**{**config, "model": None if config.get("model") is None else str(config["model"])})


def resolve_device(device: str) -> torch.device:
    """``"auto"`` is CUDA when present, else CPU; anything else must name a usable device."""
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for CUDA, which is not available")
    return dev


def _positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass
class EngineConfig:
    """Everything ``LLM(...)``/``LLMEngine(...)`` accept, with defaults filled in.

    ``max_model_len`` defaults to ``min(max_position_embeddings, 4096)``; ``max_num_batched_tokens``
    to 2048 with chunked prefill (vLLM's online default) and to ``max(max_model_len, 8192)``
    without it (a whole prompt must fit in one step). ``kvcache_block_size`` defaults to 16, and
    to 256 on CUDA when flash-attn is used (its paged KV wants multiples of 256).
    """

    model_dir: str
    device: str = "auto"
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    kvcache_block_size: int | None = None
    num_kvcache_blocks: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None
    scheduling_policy: str = "fcfs"
    dtype: str | None = None
    attention_backend: str = "auto"
    speculative_config: dict | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kvcache_space_gib: float = 2.0
    hf_config: object = field(default=None, repr=False)
    torch_dtype: torch.dtype = field(default=None, repr=False)
    torch_device: torch.device = field(default=None, repr=False)
    speculative: SpeculativeConfig | None = field(default=None, repr=False)

    def __post_init__(self):
        self.hf_config = load_config(self.model_dir)
        self.torch_dtype = resolve_dtype(self.dtype, self.hf_config)
        self.torch_device = resolve_device(self.device)
        for name in ("tensor_parallel_size", "max_num_seqs"):
            _positive_int(name, getattr(self, name))
        for name in ("max_num_batched_tokens", "max_model_len", "kvcache_block_size", "num_kvcache_blocks",
                     "long_prefill_token_threshold"):
            _positive_int(name, getattr(self, name), allow_none=True)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.cpu_kvcache_space_gib <= 0:
            raise ValueError(f"cpu_kvcache_space_gib must be positive, got {self.cpu_kvcache_space_gib!r}")
        max_pos = getattr(self.hf_config, "max_position_embeddings", 4096)
        if self.max_model_len is None:
            self.max_model_len = min(max_pos, 4096)
        elif self.max_model_len > max_pos:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's max_position_embeddings ({max_pos})")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else max(self.max_model_len, 8192)
        elif not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                             f"({self.max_model_len}) when enable_chunked_prefill is False")
        if self.kvcache_block_size is None:
            self.kvcache_block_size = 256 if self._uses_flash_attn() else 16
        if self.speculative_config is not None:
            self.speculative = SpeculativeConfig.from_dict(self.speculative_config)

    def _uses_flash_attn(self) -> bool:
        if self.torch_device.type != "cuda":
            return False
        try:
            from flash_attention import HAS_FLASH_ATTN
        except ImportError:
            return False
        return HAS_FLASH_ATTN

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size
