#!/usr/bin/env bash
# Set up (or refresh) .venv, then start the main job: the OpenAI-compatible server on the embedded
# default model (http://127.0.0.1:8000/v1). Extra arguments go to `ruvllm serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
# Bytecode is written on first import (set-up installs without compiling it; some machines
# set PYTHONDONTWRITEBYTECODE, which would make every process compile torch anew).
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/ruvllm serve "$@"
