#!/usr/bin/env bash
# Install (first run only), start the service (broker + 2 workers on the bundled default model), send it one
# real request, print the streamed answer and its stats, then stop the service cleanly.
# The service's own log lines go to $LOG_DIR (default logs/: serve.log, broker.log, w1.log, w2.log), so the
# answer reads as one piece; the last lines of serve.log are shown after it, in a block of their own.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
FRONTEND="${TINYLOOP_FRONTEND:-tcp://127.0.0.1:5555}"
BACKEND="${TINYLOOP_BACKEND:-tcp://127.0.0.1:5556}"
LOG_DIR="${TINYLOOP_LOG_DIR:-logs}"
mkdir -p "$LOG_DIR"
: > "$LOG_DIR/serve.log"
echo "starting the service (broker + 2 workers); its log: $LOG_DIR/serve.log" >&2
.venv/bin/tinyloop serve --workers 2 --frontend "$FRONTEND" --backend "$BACKEND" --log-dir "$LOG_DIR" \
  >>"$LOG_DIR/serve.log" 2>&1 &
SERVE=$!
trap 'kill -TERM $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT
# Wait until both workers have loaded the model, so the answer below is not interleaved with startup.
until grep -q "workers ready" "$LOG_DIR/serve.log"; do
  if ! kill -0 $SERVE 2>/dev/null; then cat "$LOG_DIR/serve.log" >&2; exit 1; fi
  sleep 0.2
done
echo >&2
.venv/bin/tinyloop submit --connect "$FRONTEND" --max-tokens 48 "def fibonacci(n):"
echo >&2
echo "---- service log ($LOG_DIR/serve.log) ----" >&2
cat "$LOG_DIR/serve.log" >&2
echo "----" >&2
