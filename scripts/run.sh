#!/usr/bin/env bash
# The main job: `layer-boundary run` (default: built-in tiny Qwen3 on 2 CPU ranks vs 1 rank).
# Extra arguments go to `layer-boundary`'s run command, e.g. scripts/run.sh --tp 4 --json
source "$(dirname "$0")/env.sh"
exec layer-boundary run "$@"
