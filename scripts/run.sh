#!/usr/bin/env bash
# Install (first run only), start the service (logs in logs/) (broker + 2 workers on the bundled default model),
# send it one real request, print the streamed answer and its stats, then stop the service cleanly.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
FRONTEND="${TINYLOOP_FRONTEND:-tcp://127.0.0.1:5555}"
BACKEND="${TINYLOOP_BACKEND:-tcp://127.0.0.1:5556}"
.venv/bin/tinyloop serve --workers 2 --frontend "$FRONTEND" --backend "$BACKEND" --log-dir logs &
SERVE=$!
trap 'kill -TERM $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT
# The broker queues the request until a worker has loaded its model and announced itself ready.
.venv/bin/tinyloop submit --connect "$FRONTEND" --max-tokens 48 "def fibonacci(n):"
