#!/usr/bin/env bash
# Install what the tests need (first run only), lint the runtime and the service (ruff), type-check them (mypy), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check tinyloop broker workers
.venv/bin/mypy tinyloop broker workers
exec .venv/bin/python -m pytest tests "$@"
