#!/usr/bin/env bash
# The test suite (multi-rank tests run real gloo collectives on loopback).
#
# With no arguments the launcher's fault tests (tests/runtime/test_spawn_faults.py: ranks that
# start 30 s late, stop, fall silent) run in a second pytest beside the rest: they spend about
# two minutes waiting on the launcher's windows, not computing, and are built to pass on a
# busy machine. Their report follows the main one; the suite fails if either fails. With
# arguments, one pytest runs exactly what they select.
source "$(dirname "$0")/env.sh"
cd "$ROOT"
if [ "$#" -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
FAULTS=tests/runtime/test_spawn_faults.py
work="$(mktemp -d)"
trap 'kill "$faults" 2>/dev/null || true; rm -rf "$work"' EXIT
python -m pytest -q -p no:cacheprovider --basetemp "$work/tmp" "$FAULTS" > "$work/faults.log" 2>&1 &
faults=$!
status=0
python -m pytest -q --durations=15 --ignore "$FAULTS" || status=$?
fault_status=0
wait "$faults" || fault_status=$?
echo "--- $FAULTS (run beside the rest) ---"
cat "$work/faults.log"
if [ "$status" -ne 0 ]; then exit "$status"; fi
exit "$fault_status"
