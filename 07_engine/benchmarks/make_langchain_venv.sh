#!/usr/bin/env bash
# Builds LangChain's OpenAI client in a virtualenv of its own, for the structured-output client
# check (langchain_check.py). Optional: never part of ./setup.sh; its test skips without it.
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: 07_engine/benchmarks/make_langchain_venv.sh [--venv DIR] [--python PY] [--force]

Creates DIR (default: .venv-langchain/ at the repository root, ignored by git) with
langchain-openai==1.7.4 and langchain-core==1.8.1 from the package index, and checks that
ChatOpenAI imports. A client over HTTP: it needs no torch (about 60 MB, under a minute).

  --venv DIR     where to create the virtualenv (default: <repo>/.venv-langchain)
  --python PY    interpreter to build it from (default: python3)
  --force        delete DIR first if it exists
  -h, --help     this text

Then, against a running server:
  .venv-langchain/bin/python 07_engine/benchmarks/langchain_check.py --base-url http://127.0.0.1:8000/v1
USAGE
}

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="$ROOT/.venv-langchain"
PYTHON="${PYTHON:-python3}"
FORCE=0

# shellcheck source=venv_lib.sh
source "$(dirname "$0")/venv_lib.sh"
parse_venv_args "$@"
fresh_venv "$VENV" "$PYTHON" "$FORCE"
"$VENV/bin/python" -m pip install -q "langchain-openai==1.7.4" "langchain-core==1.8.1"
"$VENV/bin/python" -c "from langchain_openai import ChatOpenAI; print('ok: langchain-openai imports')"
echo "LangChain is in $VENV"
