#!/usr/bin/env bash
# Start `tickserve serve` on the default model (or $MODEL), show its start-up until its
# ready line, stream one chat answer to the terminal with the server's output held back
# meanwhile (it goes to $LOG), then keep serving and showing that output until Ctrl-C.
# Usage: PORT=8000 HOST=127.0.0.1 PY=.venv/bin/python [MODEL=path] [LOG=file] bash tools/run_and_demo.sh
set -u
PORT=${PORT:-8000}
HOST=${HOST:-127.0.0.1}
PY=${PY:-python3}
MODEL=${MODEL:-}
if ! "$PY" -c "import sys; from shared.cli import port_problem; p = port_problem('$HOST', $PORT); p and print(p); sys.exit(bool(p))"; then
    echo "Is another server running there? Pick another port: make run PORT=8001" >&2
    exit 1
fi
LOG=${LOG:-$(mktemp "${TMPDIR:-/tmp}/tickserve-run.XXXXXX")}
: >"$LOG"
echo "the server's output goes to $LOG"
"$(dirname "$PY")/tickserve" serve ${MODEL:+"$MODEL"} --host "$HOST" --port "$PORT" >"$LOG" 2>&1 &
server=$!
tail -n +1 -f --pid=$server "$LOG" &  # start-up: conversion progress, kernel build, ready line
tailer=$!
stop() { kill -TERM $server 2>/dev/null; wait $server; code=$?; kill $tailer 2>/dev/null; wait $tailer 2>/dev/null; exit $code; }
trap 'stop' INT TERM
until grep -q "^tickserve ready: " "$LOG"; do
    if ! kill -0 $server 2>/dev/null; then  # it stopped before it was ready: its last line says why
        wait $server; code=$?; sleep 0.3; kill $tailer 2>/dev/null; exit $code
    fi
    sleep 0.2
done
sleep 0.3  # let tail print the ready line, then hold the output back for the answer
kill $tailer 2>/dev/null; wait $tailer 2>/dev/null
shown=$(wc -l <"$LOG")
echo
"$PY" tools/demo_stream.py --url "http://$HOST:$PORT" --wait 60 || stop
echo
echo "tickserve is serving on http://$HOST:$PORT (dashboard http://$HOST:$PORT/dashboard; Ctrl-C to stop). Try:"
echo "  curl -N http://$HOST:$PORT/v1/chat/completions -H 'Content-Type: application/json' \\"
echo "    -d '{\"messages\":[{\"role\":\"user\",\"content\":\"Hello!\"}],\"max_tokens\":64,\"stream\":true}'"
echo "the server's output from here on (also in $LOG):"
tail -n +$((shown + 1)) -f --pid=$server "$LOG" &
tailer=$!
wait $server
code=$?
kill $tailer 2>/dev/null
exit $code
