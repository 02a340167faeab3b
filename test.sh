#!/usr/bin/env bash
# Install what is missing (with test dependencies), then run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install.sh --test
# the suite starts hundreds of Python processes; where PYTHONDONTWRITEBYTECODE is set, each would compile
# simpletuner's own modules again (install.sh compiles only the venv): compile the checkout once here
"${SIMPLETUNER_VENV:-.venv}/bin/python" -m compileall -q simpletuner tests >/dev/null
# two workers (pytest-xdist), one test file each at a time: the suite's subprocesses and browsers use both cores
exec "${SIMPLETUNER_VENV:-.venv}/bin/python" -m pytest -n "${SIMPLETUNER_TEST_WORKERS:-2}" --dist loadfile "$@"
