"""The embedded default model is an ordinary Hugging Face directory that transformers loads."""

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vllm_from_scratch.default_model import default_model_dir


def test_default_model_directory_is_plain_safetensors():
    d = Path(default_model_dir())
    config = json.loads((d / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["vocab_size"],
    ) == (30, 576, 9, 3, 49152)
    assert (d / "model.safetensors").stat().st_size > 400e6  # float32, dequantized


def test_transformers_answers_paris_through_the_chat_template():
    d = default_model_dir()
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
