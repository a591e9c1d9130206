#!/usr/bin/env bash
# Create .venv (once) and install TinyLoop with its test extras into it. torch is pinned to the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.tinyloop-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet torch==2.13.0
  .venv/bin/pip install --quiet -e ".[test]"
  touch "$stamp"
fi
