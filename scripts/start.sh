#!/usr/bin/env bash
# Set up (or refresh) .venv, then start the main job: the OpenAI-compatible server on the embedded
# default model (http://127.0.0.1:8000/v1). Extra arguments go to `ruvllm serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/ruvllm serve "$@"
