#!/usr/bin/env bash
# The test suite (multi-rank tests run real gloo collectives on loopback).
source "$(dirname "$0")/env.sh"
cd "$ROOT"
exec python -m pytest -q "$@"
