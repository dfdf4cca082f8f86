#!/usr/bin/env bash
# CTest entry for the server tests: pytest from the venv that scripts/install-deps.sh creates.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
py="$root/.venv-test/bin/python"
if [ ! -x "$py" ]; then
  echo "tests/server: $py is missing; run scripts/install-deps.sh (it creates the venv with openai and pytest)" >&2
  exit 1
fi
cd "$root"
exec "$py" -m pytest -q -p no:cacheprovider tests/server "$@"
