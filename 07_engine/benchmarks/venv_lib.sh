# Sourced by the scripts that build the optional virtualenvs of other systems (make_vllm_venv.sh,
# make_lmeval_venv.sh, make_langchain_venv.sh): the steps they share. Each script keeps its own
# checks of what pip resolves.

# fresh_venv VENV PYTHON FORCE: create VENV from PYTHON (deleting it first when FORCE is 1) unless
# it already exists, and bring its pip up to date.
# parse_venv_args ARGS...: a make_*_venv.sh script's flags (--venv DIR, --python PY, --force,
# -h/--help, which calls its usage) into VENV, PYTHON and FORCE.
parse_venv_args() {
  while [ $# -gt 0 ]; do
    case "$1" in
      -h|--help) usage; exit 0 ;;
      --venv) VENV="$2"; shift 2 ;;
      --python) PYTHON="$2"; shift 2 ;;
      --force) FORCE=1; shift ;;
      *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
  done
}

fresh_venv() {
  if [ -e "$1" ] && [ "$3" = 1 ]; then rm -rf "$1"; fi
  [ -x "$1/bin/python" ] || "$2" -m venv "$1"
  "$1/bin/python" -m pip install -q --upgrade pip
}

# resolve_into VENV REPORT PIP_ARGS...: what pip would install for PIP_ARGS, as its JSON report in
# REPORT, without downloading a wheel: ask first, download second.
resolve_into() {
  local venv="$1" report="$2"
  shift 2
  echo "resolving $* ..."
  "$venv/bin/python" -m pip install -q --dry-run --ignore-installed --report "$report" "$@" 2>/dev/null
}
