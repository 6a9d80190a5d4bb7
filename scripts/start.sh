#!/usr/bin/env bash
# Set up (or refresh) .venv, then start the main job: the OpenAI-compatible server on the embedded
# default model (http://127.0.0.1:8000/v1). Extra arguments go to `ruvllm serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode is written on first import, set-up's own included (set-up compiles what it installs but
# torch, whose modules the kernels' build imports first; some machines set PYTHONDONTWRITEBYTECODE,
# which would make every process compile them anew).
unset PYTHONDONTWRITEBYTECODE
scripts/bootstrap.sh
exec .venv/bin/ruvllm serve "$@"
