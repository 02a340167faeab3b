#!/usr/bin/env bash
# Create .venv (or $SIMPLETUNER_VENV) and install SimpleTuner into it. Idempotent and quick when up to date.
#   scripts/install.sh          the trainer, server and CLI
#   scripts/install.sh --test   plus the test dependencies
# torch is installed first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build here.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SIMPLETUNER_VENV:-.venv}"
TORCH_SPEC="${SIMPLETUNER_TORCH_SPEC:-torch==2.13.0}"
EXTRAS=""
[ "${1:-}" = "--test" ] && EXTRAS="[test]"

PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
stamp="$VENV/.simpletuner-install${EXTRAS:+-test}"
want="$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1) $TORCH_SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
log="$VENV/install.log"
pip_install() {  # pip's and the build backend's chatter goes to the log, shown only when something fails
  if ! "$VENV/bin/python" -m pip install "$@" >>"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "install failed: pip install $* (full log: $log)" >&2
    exit 1
  fi
}
: >"$log"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '${TORCH_SPEC#torch==}' else 1)" 2>/dev/null; then
  echo "==> installing $TORCH_SPEC"
  pip_install "$TORCH_SPEC"
fi
echo "==> installing simpletuner$EXTRAS"
pip_install -e ".$EXTRAS"
echo "$want" > "$stamp"
