#!/usr/bin/env bash
# Set up (or refresh) .venv, then start the main job on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/python -m ruvllm "$@"
