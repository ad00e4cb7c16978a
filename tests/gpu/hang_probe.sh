#!/usr/bin/env bash
# Runs a command; if it is still running after PROBE_S seconds, prints py-spy's dump of
# it and its children (where it waits), then stops it. Device tool only.
#
#   PROBE_S=120 bash tests/gpu/hang_probe.sh python3 tests/gpu/check_capture.py --arch gemma3mm
set -u
probe="${PROBE_S:-120}"
"$@" &
pid=$!
for ((s = 0; s < probe; s++)); do
  kill -0 "$pid" 2>/dev/null || { wait "$pid"; exit $?; }
  sleep 1
done
echo "=== hang_probe: still running after ${probe}s; py-spy dump of pid $pid and children"
py-spy dump --subprocesses --pid "$pid" 2>&1 | head -400
pkill -TERM -P "$pid"; kill -TERM "$pid" 2>/dev/null; sleep 5; pkill -KILL -P "$pid"; kill -KILL "$pid" 2>/dev/null
exit 124
