#!/usr/bin/env bash
# The book's essential GPU checks in one call, on a lent GPU machine as it is: no install, no
# network, no editable install. Usage (07_engine/gpu_check.md says what each step checks):
#
#   bash 07_engine/gpu_check.sh [--quick] [--dry-run] [--steps A,B] OUT_DIR
#
# The chapters import each other by module name, which the editable install provides here;
# without it, PYTHONPATH names every chapter directory, the engine and its benchmarks and tests.
# PYTHON picks the interpreter (default: python3 on PATH).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KIT_PATH=""
for dir in "$ROOT"/0[1-6]_*/ "$ROOT/07_engine/" "$ROOT/07_engine/benchmarks/" "$ROOT/07_engine/tests/"; do
    KIT_PATH="$KIT_PATH${KIT_PATH:+:}${dir%/}"
done
export PYTHONPATH="$KIT_PATH${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python3}"
# PYTHON may carry interpreter flags (the kit's own test runs it with -S); split it into words.
read -r -a PY <<< "$PYTHON"
exec "${PY[@]}" "$ROOT/07_engine/benchmarks/gpu_check.py" "$@"
