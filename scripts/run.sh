#!/usr/bin/env bash
# The main job: `layer-boundary run` (default: the built-in tiny Qwen3 on 4 CPU ranks, tensor
# parallelism 4 with attention DP 2, checked against 1 rank). Extra arguments go to the run
# command, e.g. scripts/run.sh --tp 2 --json
source "$(dirname "$0")/env.sh"
exec layer-boundary run "$@"
