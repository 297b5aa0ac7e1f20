#!/usr/bin/env bash
# layer-boundary run across two machines with torchrun: two pipeline stages, one per machine,
# each stage tensor-parallel over that machine's 2 processes (--pp 2 --tp 2, 4 ranks).
#
#   on machine 0:  NODE_RANK=0 MASTER_ADDR=<machine 0's address> examples/torchrun_two_nodes.sh
#   on machine 1:  NODE_RANK=1 MASTER_ADDR=<machine 0's address> examples/torchrun_two_nodes.sh
#
# LOCAL=1 starts both "machines" on this host (what tests/examples run). Extra arguments go
# to `layer-boundary run` (e.g. --json, --max-new-tokens 2); rank 0, on machine 0, prints the
# report with its parity verdict against world 1. MASTER_PORT (default 29500) must be free.
set -euo pipefail
PORT="${MASTER_PORT:-29500}"

node() {
  local rank="$1"
  shift
  python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --node-rank "$rank" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "$PORT" \
    -m layer_boundary run --pp 2 --tp 2 "$@"
}

if [ "${LOCAL:-0}" = 1 ]; then
  node 1 "$@" > /dev/null &
  other=$!
  node 0 "$@"
  wait "$other"
else
  node "${NODE_RANK:?set NODE_RANK: 0 on the machine at MASTER_ADDR, 1 on the other}" "$@"
fi
