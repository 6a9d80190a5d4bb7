#!/usr/bin/env bash
# Refresh constraints.txt (the lock): resolve every dependency afresh (the newest releases pyproject.toml
# admits) in a scratch environment, and write down the versions it got. Run the suite on the new
# lock (scripts/test.sh) before committing it: the lock is what CI last passed with.
set -euo pipefail
cd "$(dirname "$0")/.."
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
RUVLLM_VENV="$scratch/venv" RUVLLM_LOCK=none scripts/bootstrap.sh
{
  echo "# The lock: the exact versions set-up installs, the ones CI last passed with (scripts/bootstrap.sh passes"
  echo "# this file as pip's --constraint). Written by scripts/lock.sh on $(date -u +%F); refresh with: scripts/lock.sh"
  "$scratch/venv/bin/pip" freeze --all --exclude-editable --disable-pip-version-check  # --all: pip and setuptools too
} > constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) packages pinned"
