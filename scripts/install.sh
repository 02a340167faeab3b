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
  "$VENV/bin/python" -m pip install -q --no-compile --upgrade pip
fi
stamp="$VENV/.simpletuner-install${EXTRAS:+-test}"
want="$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1) $TORCH_SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
log="$VENV/install.log"
# pip byte-compiles each package in one process as it unpacks it, most of an install's time (transformers alone on a
# slow machine: 3.5 min, 35 s with --no-compile). Installing with --no-compile and compiling the venv once at the end,
# on every core, took a fresh `--test` install from 27 to 19 minutes there. The bytecode is still written here: a
# user may run with PYTHONDONTWRITEBYTECODE set, and then every import would compile torch from source again.
pip_install() {  # pip's and the build backend's chatter goes to the log, shown only when something fails
  if ! "$VENV/bin/python" -m pip install --no-compile "$@" >>"$log" 2>&1; then
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
echo "==> compiling"
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
  >>"$log" 2>&1 || true  # as with pip's own pass: a few files are for other Pythons (torch's py312 examples)
echo "$want" > "$stamp"
