#!/usr/bin/env bash
# Create .venv (once) and install TinyLoop with its test extras into it. torch is pinned to the CPU build.
# Then fetch the real pretrained model the README's first command chats with (SmolLM2-135M-Instruct, GGUF, once).
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
bash scripts/get_smollm2.sh >/dev/null || true  # offline: the looped model still runs; the chat needs the file
