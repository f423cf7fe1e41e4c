"""Load a Hugging Face safetensors directory into one of the engine's models.

Every parameter's ``weight_loader`` copies *its rank's* slice of a checkpoint tensor; names fused
into one parameter (q/k/v, gate/up) are routed through the model's ``packed_modules_mapping``.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from safetensors import safe_open
from torch.distributed import ProcessGroup
from transformers import AutoConfig, PretrainedConfig

from machine import cpu_has_native_bf16
from vllm_from_scratch.errors import ParameterError
from vllm_from_scratch.models import get_config_class, get_model_class

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# vLLM's other spellings of two of them (``--dtype half``, ``LLM(dtype="float")``).
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
log = logging.getLogger(__name__)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device | str = "cpu") -> torch.dtype:
    """A dtype name, or ``None``/``"auto"``: vLLM's "auto", decided by the machine.

    On a GPU bfloat16 (float16 where the GPU lacks it); on a CPU bfloat16 only where the CPU
    has it in hardware, float32 otherwise. The choice is logged once per process.
    """
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if dtype is None or dtype == "auto":
        return _auto_dtype(torch.device(device).type)
    dtype = DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in DTYPES:
        names = sorted([*DTYPES, *DTYPE_ALIASES])
        raise ParameterError("dtype", f"must be 'auto' or one of {names}, got {dtype!r}")
    return DTYPES[dtype]


@functools.cache
def _auto_dtype(device_type: str) -> torch.dtype:
    if device_type == "cuda":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        log.info("dtype auto: %s on %s", dtype, torch.cuda.get_device_name())
    else:
        dtype = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        log.info("dtype auto: %s (CPU %s native bfloat16)", dtype, "with" if cpu_has_native_bf16() else "without")
    return dtype


def load_config(model_dir: str) -> PretrainedConfig:
    """The checkpoint's config.json, read by transformers, or by the engine's own class for a
    ``model_type`` transformers knows only through the checkpoint's code (``models._CONFIGS``)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model_dir {model_dir!r} has no config.json")
    with open(path) as f:
        config_cls = get_config_class(json.load(f).get("model_type"))
    return (config_cls or AutoConfig).from_pretrained(model_dir)


def default_weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded_weight.shape)} for a parameter of shape {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


def load_weights(model: torch.nn.Module, model_dir: str) -> None:
    """Copy every tensor of ``model_dir/*.safetensors`` into ``model``; every parameter must be hit."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"model_dir {model_dir!r} has no *.safetensors file")
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())  # tied weights appear once, under the first name
    loaded = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                target, shard_id = name, None
                for ckpt_part, (fused_part, sid) in packed.items():
                    if f".{ckpt_part}." in name:
                        target, shard_id = name.replace(f".{ckpt_part}.", f".{fused_part}."), sid
                        break
                if target not in params:
                    if name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
                        continue  # the head *is* the embedding
                    raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
                param = params[target]
                # A parallel layer's parameter carries its own loader, which takes a shard id.
                weight_loader: Callable[..., None] = getattr(param, "weight_loader", default_weight_loader)
                shard_args = () if shard_id is None else (shard_id,)
                weight_loader(param, f.get_tensor(name), *shard_args)
                loaded.add(target)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint {model_dir!r} lacks weights for {sorted(missing)}")


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def get_model(
    model_dir: str,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_group: ProcessGroup | None = None,
    config: PretrainedConfig | None = None,
) -> torch.nn.Module:
    """Build the registered model class for ``model_dir`` on ``device`` and load its weights."""
    config = config or load_config(model_dir)
    torch_dtype = resolve_dtype(dtype, device)
    model_cls = get_model_class(config)
    with _default_dtype(torch_dtype), torch.device(device):
        model = model_cls(config, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)
    load_weights(model, model_dir)
    return model.eval()
