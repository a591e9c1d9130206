#!/usr/bin/env bash
# Install what the tests need (first run only), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest tests "$@"
