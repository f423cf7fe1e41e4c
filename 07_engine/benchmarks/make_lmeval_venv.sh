#!/usr/bin/env bash
# Builds lm-evaluation-harness in a virtualenv of its own, for the evaluation check
# (lm_eval_check.py, 07_engine/eval/). Optional: never part of ./setup.sh; its test skips without it.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: 07_engine/benchmarks/make_lmeval_venv.sh [--venv DIR] [--python PY] [--force]

Creates DIR (default: .venv-lmeval/ at the repository root, ignored by git) with
lm-eval[api]==0.4.13 from the package index and the book's transformers (the version
requirements.txt pins, so the harness tokenizes exactly as the book does), and checks that
lm_eval's `local-completions` model loads.

The harness talks to a server over HTTP and tokenizes with transformers' tokenizer: it needs no
torch. Before downloading anything it asks pip what it would install and stops if that includes
torch or CUDA packages.

  --venv DIR     where to create the virtualenv (default: <repo>/.venv-lmeval)
  --python PY    interpreter to build it from (default: python3)
  --force        delete DIR first if it exists
  -h, --help     this text

About 600 MB on disk and a minute or two. Then:
  .venv/bin/python 07_engine/benchmarks/lm_eval_check.py
EOF
}

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="$ROOT/.venv-lmeval"
PYTHON="${PYTHON:-python3}"
FORCE=0
LMEVAL_SPEC="lm-eval[api]==0.4.13"
TRANSFORMERS_SPEC="$(grep -m1 '^transformers==' "$ROOT/requirements.txt")"

# shellcheck source=venv_lib.sh
source "$(dirname "$0")/venv_lib.sh"
parse_venv_args "$@"
fresh_venv "$VENV" "$PYTHON" "$FORCE"
PIP=("$VENV/bin/python" -m pip)

# Ask first, download second: an HTTP client has no use for torch, let alone CUDA wheels.
REPORT="$(mktemp)"
trap 'rm -f "$REPORT"' EXIT
resolve_into "$VENV" "$REPORT" "$LMEVAL_SPEC" "$TRANSFORMERS_SPEC"
"$VENV/bin/python" - "$REPORT" <<'PY'
import json, sys
items = [i["metadata"] for i in json.load(open(sys.argv[1]))["install"]]
names = {m["name"].lower().replace("_", "-"): m["version"] for m in items}
heavy = sorted(n for n in names if n == "torch" or n.startswith("nvidia-") or "cuda" in n)
if heavy:
    sys.exit(f"refusing: pip would install {heavy}")
print(f"pip resolves {len(names)} packages: lm-eval {names['lm-eval']}, "
      f"transformers {names['transformers']}, no torch")
PY

"${PIP[@]}" install -q "$LMEVAL_SPEC" "$TRANSFORMERS_SPEC"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
from lm_eval.api.registry import get_model
get_model("local-completions")  # the model class the check uses, with its HTTP dependencies
print(f"ok: lm-eval {md.version('lm-eval')}, transformers {md.version('transformers')}")
PY
echo "lm-evaluation-harness is in $VENV"
