#!/usr/bin/env bash
# Install what is missing, then train. With no arguments this trains the shipped example: a tiny Flux LoRA on
# datasets/sample (config/config.json + config/multidatabackend.json), on CPU, writing to output/models.
#   ./train.sh                          the example
#   ./train.sh --config my/config.json  any config (all `simpletuner train` options work)
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install.sh
exec "${SIMPLETUNER_VENV:-.venv}/bin/simpletuner" train "$@"
