#!/usr/bin/env bash
# Installs vireo's build and test dependencies from Debian's packages. Idempotent: packages already
# present are left alone, and apt is only consulted when something is missing.
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config
      nlohmann-json3-dev libcli11-dev libpcre2-dev libutf8proc-dev libcpp-httplib-dev
      libgtest-dev libgmock-dev zlib1g-dev python3 python3-venv)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install-deps: all packages present"
fi

# Python for the server tests (tests/server): the official `openai` client and pytest, pinned, in a
# venv that is not tracked by git. Recreated only when the pins change.
venv=.venv-test
pins=(openai==3.57.0 pytest==9.2.0)
cd "$(dirname "$0")/.."
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.pins" 2>/dev/null)" != "${pins[*]}" ]; then
  echo "install-deps: creating $venv with ${pins[*]}"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "${pins[@]}"
  echo "${pins[*]}" > "$venv/.pins"
else
  echo "install-deps: $venv up to date"
fi
