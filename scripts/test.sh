#!/usr/bin/env bash
# Set up (or refresh) .venv, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode is written on first import, set-up's own included (set-up compiles what it installs but
# torch, whose modules the kernels' build imports first; some machines set PYTHONDONTWRITEBYTECODE,
# which would make every process compile them anew).
unset PYTHONDONTWRITEBYTECODE
# The chat page's browser test drives Debian's Chromium (docs/chat-page.md): installed beside the
# set-up when it is absent and apt is ours to use (root, as in CI); elsewhere that test skips.
browser=0
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium) \
    >/dev/null 2>&1 & browser=$!
fi
scripts/bootstrap.sh
[ "$browser" = 0 ] || wait "$browser" || echo "test.sh: chromium did not install; the browser test will fail in CI" >&2
# Two pytest workers, whole files each (a module's fixtures load once), one CPU thread per worker
# and per engine they start: two single-threaded processes keep both cores of the 2-core CI
# machine busy where one two-threaded process left one idle through imports, process starts and
# Python-bound work; two two-threaded workers would oversubscribe the cores. RUVLLM_TEST_WORKERS
# sets the count (0: one process, no workers). docs/decisions.md says why.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# --durations: every run's log names its slowest tests, what the 10-minute budget is spent on;
# -rs: and every skipped test with its reason, so a skip that appears between two runs is seen.
# --no-loadscope-reorder: xdist hands out files by their count of tests, most first, which put the
# heavy files of a few long tests (e2e's) last, one worker finishing them while the other idled;
# in path order e2e's come first and unit's many short files fill the end (docs/benchmarks.md,
# session 20: a replay of one run's per-file times, 56 s between the workers' ends against 6 s).
exec .venv/bin/python -m pytest tests -n "${RUVLLM_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  --durations=30 -rs "$@"
