#!/usr/bin/env bash
# The test suite (multi-rank tests run real gloo collectives on loopback).
#
# With no arguments the suite runs as three pytest processes side by side (the first two
# reports follow the third's); the suite fails if any fails:
# - the multi-rank directories (tests/distributed, tests/adapters, tests/residual), and
# - everything else, each with its own rank pools: a gloo collective among processes on
#   two cores spends much of its time waiting for the peer to be scheduled (one pytest kept
#   the two cores 55-75% busy), and the other stream's work fills those waits;
# - the launcher's fault tests (tests/runtime/test_spawn_faults.py: ranks that start 30 s
#   late, stop, fall silent), which spend about two minutes waiting on the launcher's
#   windows, not computing, and are built to pass on a busy machine.
# With arguments, one pytest runs exactly what they select.
source "$(dirname "$0")/env.sh"
cd "$ROOT"
if [ "$#" -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
FAULTS=tests/runtime/test_spawn_faults.py
MULTI_RANK=(tests/distributed tests/adapters tests/residual)
work="$(mktemp -d)"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$work"' EXIT
python -m pytest -q -p no:cacheprovider --basetemp "$work/faults" "$FAULTS" \
  > "$work/faults.log" 2>&1 &
pids+=($!)
python -m pytest -q -p no:cacheprovider --basetemp "$work/multi" --durations=10 \
  "${MULTI_RANK[@]}" > "$work/multi.log" 2>&1 &
pids+=($!)
ignore=(--ignore "$FAULTS")
for dir in "${MULTI_RANK[@]}"; do ignore+=(--ignore "$dir"); done
status=0
python -m pytest -q --basetemp "$work/rest" --durations=10 "${ignore[@]}" || status=1
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
echo "--- ${MULTI_RANK[*]} (run beside the rest) ---"
cat "$work/multi.log"
echo "--- $FAULTS (run beside the rest) ---"
cat "$work/faults.log"
exit "$status"
