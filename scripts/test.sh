#!/usr/bin/env bash
# Set up (or refresh) .venv, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/python -m pytest tests "$@"
