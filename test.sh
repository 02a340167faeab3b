#!/usr/bin/env bash
# Install what is missing (with test dependencies), then run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install.sh --test
exec "${SIMPLETUNER_VENV:-.venv}/bin/python" -m pytest "$@"
