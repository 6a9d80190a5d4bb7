#!/usr/bin/env bash
# Refresh requirements.lock: resolve every dependency afresh (the newest releases pyproject.toml
# admits) in a scratch environment, and write down the versions it got. Run the suite on the new
# lock (scripts/test.sh) before committing it: the lock is what CI last passed with.
set -euo pipefail
cd "$(dirname "$0")/.."
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
RUVLLM_VENV="$scratch/venv" RUVLLM_LOCK=none scripts/bootstrap.sh
{
  echo "# The versions set-up installs (scripts/bootstrap.sh passes this file as pip's --constraint)."
  echo "# Written by scripts/lock.sh on $(date -u +%F); refresh with: scripts/lock.sh"
  "$scratch/venv/bin/pip" freeze --exclude-editable --disable-pip-version-check
} > requirements.lock
echo "requirements.lock: $(grep -vc '^#' requirements.lock) packages pinned"
