#!/usr/bin/env bash
# Install (first run only), then run the main job on the bundled default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/tinyloop generate "def fibonacci(n):" --max-tokens 48
