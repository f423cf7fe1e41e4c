"""``vllm serve``'s command line, read as vLLM reads it: the flags a vLLM user pastes, vLLM's value
syntax, ``--config`` YAML, ``vllm-fs serve MODEL``, the ``VLLM_*`` CPU variables, and the deploying
page's table of every ``vllm serve`` flag beside ours.

vLLM's own answers (its flags, what its size parser makes of a few texts) come from its parser,
kept in ``docs/data/vllm_serve_flags.json``; where ``.venv-vllm`` exists, one test reads them
afresh and checks the copy. Nothing here starts a server or loads weights: the refusals happen
while the settings are checked, before any weight loads.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import bench
import vllm_serve_flags
from vllm_from_scratch import serve, vllm_env
from vllm_from_scratch.config import (
    BINARY_SUFFIXES,
    DECIMAL_SUFFIXES,
    MODEL_MAX_LEN,
    EngineConfig,
    human_readable_int,
    human_readable_int_or_auto,
)
from vllm_from_scratch.errors import ParameterError
from vllm_from_scratch.loader import resolve_dtype

ROOT = Path(__file__).resolve().parents[2]
VLLM = vllm_serve_flags.load_vllm_flags()


# ---- vLLM's value syntax --------------------------------------------------------------------------


@pytest.mark.parametrize("text", sorted(VLLM["sizes"]))
def test_sizes_parse_as_vllms_parser_parses_them(text):
    expected = VLLM["sizes"][text]  # vLLM's answer: an int, None for auto/-1, or "error"
    if expected == "error":
        with pytest.raises(argparse.ArgumentTypeError):
            human_readable_int_or_auto(text)
    else:
        assert human_readable_int_or_auto(text) == (MODEL_MAX_LEN if expected is None else expected)


@settings(derandomize=True, max_examples=60, deadline=None)
@given(
    number=st.integers(0, 10**6),
    suffix=st.sampled_from([*DECIMAL_SUFFIXES, *BINARY_SUFFIXES, ""]),
    tenths=st.none() | st.integers(0, 9),
    pad=st.sampled_from(["", " "]),
)
def test_size_syntax_decimal_lower_binary_upper(number, suffix, tenths, pad):
    text = f"{pad}{number}{'' if tenths is None else f'.{tenths}'}{suffix}{pad}"
    multiplier = {**DECIMAL_SUFFIXES, **BINARY_SUFFIXES}.get(suffix, 1)
    if tenths is not None and suffix not in DECIMAL_SUFFIXES:
        with pytest.raises(argparse.ArgumentTypeError):  # 1.5K, 1.5: decimals take a decimal suffix
            human_readable_int(text)
    elif tenths is None:
        assert human_readable_int(text) == number * multiplier
    else:  # vLLM's float arithmetic, truncated: within one of the exact value, never above it
        exact = (number * 10 + tenths) * multiplier // 10
        assert exact - 1 <= human_readable_int(text) <= exact
    # The same text on the command line, as --max-model-len and --max-num-batched-tokens take it.
    if tenths is None or suffix in DECIMAL_SUFFIXES:
        args = serve.parse_args(["m", "--max-model-len", text, "--max-num-batched-tokens", text])
        assert args.max_model_len == args.max_num_batched_tokens == human_readable_int(text)


@settings(derandomize=True, max_examples=20, deadline=None)
@given(dtype=st.sampled_from(next(f for f in VLLM["flags"] if f["flags"] == ["--dtype"])["choices"]))
def test_every_vllm_dtype_spelling_means_what_it_means_in_vllm(dtype):
    meaning = {"half": torch.float16, "float16": torch.float16, "float": torch.float32, "float32": torch.float32}
    meaning["bfloat16"] = torch.bfloat16
    assert serve.parse_args(["m", "--dtype", dtype]).dtype == dtype
    assert resolve_dtype(dtype) == meaning.get(dtype, resolve_dtype("auto"))


# ---- each flag a vLLM user passes ----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--seed", "7"], {"seed": 7}),
        (["--chat-template", "t.jinja"], {"chat_template": "t.jinja"}),
        (["--max-logprobs", "5"], {"max_logprobs": 5}),
        (["--enable-log-requests"], {"enable_log_requests": True}),
        (["--uvicorn-log-level", "trace"], {"uvicorn_log_level": "trace"}),
        (["--kv-cache-dtype", "fp8"], {"kv_cache_dtype": "fp8"}),  # parsed; refused with the engine's settings
        (["--trust-remote-code"], {"trust_remote_code": True}),
        (["--tokenizer", "./tok"], {"tokenizer": "./tok"}),
        (
            ["--override-generation-config", '{"temperature": 0.2}'],
            {"override_generation_config": {"temperature": 0.2}},
        ),
        (["--disable-log-stats"], {"disable_log_stats": True}),
        (["--root-path", "/llm"], {"root_path": "/llm"}),
        (
            ["-tp", "2", "-pp", "3", "-dp", "4"],
            {"tensor_parallel_size": 2, "pipeline_parallel_size": 3, "data_parallel_size": 4},
        ),
        (["-O3"], {"optimization_level": 3}),
        (["-O=1"], {"optimization_level": 1}),
        (["-O", "0"], {"optimization_level": 0}),
        (["--optimization-level", "2"], {"optimization_level": 2}),
        (["--dtype", "half"], {"dtype": "half"}),
        (["--dtype", "float"], {"dtype": "float"}),
        (["--max-model-len", "4k"], {"max_model_len": 4000}),
        (["--max-model-len", "auto"], {"max_model_len": MODEL_MAX_LEN}),
        (["--served-model-name", "a", "b"], {"served_model_name": ["a", "b"]}),
        (["--api-key", "k1", "k2"], {"api_key": ["k1", "k2"]}),
        (["--log-level", "debug"], {"log_level": "DEBUG"}),
        (["--log-level", "WARNING"], {"log_level": "WARNING"}),
        (["--max_model_len", "2K", "--num-gpu-blocks-override", "9"], {"max_model_len": 2048, "num_kvcache_blocks": 9}),
        (
            ["-sc", '{"method": "ngram", "num_speculative_tokens": 2}'],
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
        ),
    ],
)
def test_vllms_flags_parse_with_vllms_syntax(argv, expected):
    args = vars(serve.parse_args(["./model", *argv]))
    assert {key: args[key] for key in expected} == expected
    assert args["model"] == "./model"


def test_uvicorn_logs_at_the_servers_level_unless_told(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    assert serve.parse_args(["m", "--log-level", "Warning"]).server.resolved_uvicorn_log_level() == "warning"
    assert serve.parse_args(["m", "--uvicorn-log-level", "debug"]).server.resolved_uvicorn_log_level() == "debug"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "error")
    assert serve.parse_args(["m"]).server.resolved_log_level() == "ERROR"


def test_a_value_the_parser_refuses_names_the_flag(capsys):
    for argv, flag in (
        (["-O4"], "--optimization-level/-O"),
        (["--max-model-len", "1.5K"], "--max-model-len"),
        (["--log-level", "loud"], "--log-level"),
    ):
        with pytest.raises(SystemExit):
            serve.parse_args(["m", *argv])
        assert f"error: argument {flag}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve.parse_args(["m", "--api-key", "k", ""])
    assert "error: --api-key is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve.parse_args(["./a", "--model", "./b"])
    assert "error: --model given twice" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["-pp", "2"], "--pipeline-parallel-size =2"),
        (["-dp", "2"], "--data-parallel-size =2"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype ='fp8'"),
        (["--dtype", "float32", "--kv-cache-dtype", "bfloat16"], "--kv-cache-dtype ='bfloat16'"),
    ],
)
def test_what_the_engine_lacks_stops_the_start_naming_the_flag(tiny_llama_dir, argv, flag):
    with pytest.raises(SystemExit) as info:
        serve.cli(["serve", tiny_llama_dir, "--enforce-eager", *argv])
    assert str(info.value).startswith(f"vllm-fs serve: error: {flag}"), info.value


def test_the_engine_takes_what_it_can_honour(tiny_llama_dir):
    config = EngineConfig(tiny_llama_dir, enforce_eager=False, dtype="float", kv_cache_dtype="float32")
    assert config.torch_dtype == torch.float32 and not config.enforce_eager
    assert EngineConfig(tiny_llama_dir, optimization_level=0).enforce_eager  # -O0: op by op
    assert not EngineConfig(tiny_llama_dir, optimization_level=3).enforce_eager
    assert EngineConfig(tiny_llama_dir, max_model_len=MODEL_MAX_LEN).max_model_len == (
        EngineConfig(tiny_llama_dir).hf_config.max_position_embeddings
    )
    with pytest.raises(ParameterError, match="^optimization_level"):
        EngineConfig(tiny_llama_dir, optimization_level=5)


# ---- --config YAML and the vllm-fs command ------------------------------------------------------------


def test_config_yaml_round_trips_and_the_command_line_wins(tmp_path):
    settings_ = {
        "max_model_len": "4k",
        "enforce-eager": True,
        "enable-prefix-caching": False,
        "served-model-name": ["a", "b"],
        "speculative-config": {"method": "ngram", "num_speculative_tokens": 3},
        "port": 9000,
        "dtype": "half",
        "seed": 11,
        "log-level": "debug",
    }
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(settings_))
    for argv in (["m", "--config", str(path)], ["m", f"--config={path}"], ["--config", str(path), "--model", "m"]):
        args = serve.parse_args(argv)
        assert (args.model, args.max_model_len, args.enforce_eager, args.enable_prefix_caching) == (
            "m",
            4000,
            True,
            False,
        )
        assert args.served_model_name == ["a", "b"] and args.speculative_config == settings_["speculative-config"]
        assert (args.port, args.dtype, args.seed, args.server.log_level) == (9000, "half", 11, "DEBUG")
    assert serve.parse_args(["m", "--config", str(path), "--port", "9001", "--enforce-eager"]).port == 9001
    assert serve.parse_args(["m", "--port", "9001", "--config", str(path)]).port == 9001


def test_a_bad_config_file_is_refused_naming_config(tmp_path, capsys):
    (tmp_path / "serve.json").write_text("{}")
    (tmp_path / "list.yaml").write_text("- 1\n")
    (tmp_path / "unknown.yaml").write_text("no-such-flag: 1\n")
    for name in ("serve.json", "list.yaml", "missing.yaml"):
        with pytest.raises(SystemExit):
            serve.parse_args(["m", "--config", str(tmp_path / name)])
        assert "error: --config " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve.parse_args(["m", "--config", str(tmp_path / "unknown.yaml")])
    assert "--no-such-flag" in capsys.readouterr().err


def test_vllm_fs_serve_takes_the_model_first_as_vllm_serve_does(capsys):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["vllm-fs"] == "vllm_from_scratch.serve:cli"
    assert scripts["vllm-fs-serve"] == "vllm_from_scratch.serve:main"
    with pytest.raises(SystemExit) as info:
        serve.cli(["serve", "--help"])
    assert info.value.code == 0 and "usage: vllm-fs serve" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown command 'run'"):
        serve.cli(["run", "m"])
    with pytest.raises(SystemExit):
        serve.cli([])


# ---- vLLM's CPU environment variables ---------------------------------------------------------------


def test_vllm_cpu_variables_are_honoured(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    assert EngineConfig(tiny_llama_dir).cpu_kvcache_space_gib == 8
    assert EngineConfig(tiny_llama_dir, cpu_kvcache_space_gib=1.5).cpu_kvcache_space_gib == 1.5  # the setting wins
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "")  # set but empty: unset, as in vLLM
    assert EngineConfig(tiny_llama_dir).cpu_kvcache_space_gib == vllm_env.DEFAULT_CPU_KVCACHE_SPACE_GIB
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-2,5|6"}
    assert [vllm_env.thread_cores(rank, 2, env) for rank in (0, 1)] == [[0, 1, 2, 5], [6]]
    assert vllm_env.thread_cores(0, 1, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) is None
    assert vllm_env.thread_cores(0, 1, {}) is None  # neither set: the book's threads as they are
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) > 1:
        reserved = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
        assert vllm_env.thread_cores(0, 1, reserved) == usable[:-1]


def test_thread_binding_binds_the_process():
    code = (
        "import os, torch; from vllm_from_scratch.vllm_env import bind_threads, thread_cores; "
        "bind_threads(thread_cores(0, 1)); print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())"
    )
    core = sorted(os.sched_getaffinity(0))[0]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [f"[{core}]", "1"]


@pytest.mark.parametrize(
    "name, value",
    [
        ("VLLM_CPU_SGL_KERNEL", "1"),
        ("VLLM_CPU_ATTN_SPLIT_KV", "0"),
        ("VLLM_CPU_KVCACHE_SPACE", "lots"),
        ("VLLM_CPU_KVCACHE_SPACE", "-1"),
        ("VLLM_CPU_KVCACHE_SPACE", "0"),
        ("VLLM_CPU_NUM_OF_RESERVED_CPU", "one"),
        ("VLLM_CPU_OMP_THREADS_BIND", "0-x"),
        ("VLLM_LOG_STATS_INTERVAL", "soon"),
    ],
)
def test_vllm_variables_that_cannot_be_honoured_stop_the_start_by_name(tiny_llama_dir, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ParameterError, match=f"^{name}"):
        EngineConfig(tiny_llama_dir)
    for refused, (default, _) in vllm_env.REFUSED.items():
        assert vllm_env.check_environment({refused: default}) is None  # vLLM's default asks for nothing


# ---- the deploying page's table ------------------------------------------------------------------------


def test_every_vllm_serve_flag_is_accounted_for_and_the_table_is_current():
    table = vllm_serve_flags.rows()
    assert len(table) == len(VLLM["flags"])
    here = {spelled.split("`")[1]: status for _, spelled, status, _ in table}
    for flag in ("--seed", "--chat-template", "--max-logprobs", "--enable-log-requests", "--uvicorn-log-level",
                 "--trust-remote-code", "--tokenizer", "--override-generation-config", "--disable-log-stats",
                 "--root-path", "--config", "--tensor-parallel-size", "--optimization-level", "--dtype",
                 "--max-model-len", "--served-model-name", "--api-key", "--log-level"):  # fmt: skip
        assert here[flag] == "kept", flag
    for flag in ("--kv-cache-dtype", "--pipeline-parallel-size", "--data-parallel-size"):
        assert here[flag] == "refused by name", flag
    page = (ROOT / "07_engine" / "topics" / "deploying.md").read_text()
    assert vllm_serve_flags.table_markdown() in page, "run python docs/hooks/book_pages.py --write"


def test_the_table_fails_when_our_parser_loses_or_gains_a_flag(monkeypatch):
    ours = vllm_serve_flags.our_flags()
    lost = {name: action for name, action in ours.items() if name != "--seed"}
    monkeypatch.setattr(vllm_serve_flags, "our_flags", lambda: lost)
    with pytest.raises(ValueError, match="no reason for \\['--seed'\\]"):
        vllm_serve_flags.rows()
    gained = {**ours, "--quantization": ours["--seed"]}
    monkeypatch.setattr(vllm_serve_flags, "our_flags", lambda: gained)
    with pytest.raises(ValueError, match="a reason for \\['--quantization'\\]"):
        vllm_serve_flags.rows()


@pytest.mark.slow
@pytest.mark.skipif(
    not (bench.VLLM_VENV / "bin" / "python").exists(),
    reason="vLLM's CPU build is optional: build .venv-vllm with 07_engine/benchmarks/make_vllm_venv.sh",
)
def test_the_committed_copy_is_vllms_parser():
    assert vllm_serve_flags.vllm_flags_afresh(bench.VLLM_VENV) == VLLM
