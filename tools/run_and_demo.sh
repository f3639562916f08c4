#!/usr/bin/env bash
# Start `tickserve serve` on the default model, wait until it is healthy, stream one
# chat answer to the terminal, then keep serving until Ctrl-C.
# Usage: PORT=8000 HOST=127.0.0.1 PY=.venv/bin/python bash tools/run_and_demo.sh
set -u
PORT=${PORT:-8000}
HOST=${HOST:-127.0.0.1}
PY=${PY:-python3}
if ! "$PY" -c "import sys; from shared.cli import port_problem; p = port_problem('$HOST', $PORT); p and print(p); sys.exit(bool(p))"; then
    echo "Is another server running there? Pick another port: make run PORT=8001" >&2
    exit 1
fi
"$(dirname "$PY")/tickserve" serve --host "$HOST" --port "$PORT" &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server; exit 0' INT TERM
"$PY" tools/demo_stream.py --url "http://$HOST:$PORT" --wait 300 || { kill -TERM $server; wait $server; exit 1; }
echo
echo "tickserve is serving on http://$HOST:$PORT  (Ctrl-C to stop). Try:"
echo "  curl -N http://$HOST:$PORT/v1/chat/completions -H 'Content-Type: application/json' \\"
echo "    -d '{\"messages\":[{\"role\":\"user\",\"content\":\"Hello!\"}],\"stream\":true}'"
wait $server
