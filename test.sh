#!/usr/bin/env bash
# Install what is missing (with test dependencies), then run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install.sh --test
# two workers (pytest-xdist), one test file each at a time: the suite's subprocesses and browsers use both cores
exec "${SIMPLETUNER_VENV:-.venv}/bin/python" -m pytest -n "${SIMPLETUNER_TEST_WORKERS:-2}" --dist loadfile "$@"
