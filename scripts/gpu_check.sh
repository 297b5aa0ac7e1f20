#!/usr/bin/env bash
# The checks that need an NVIDIA GPU (scripts/gpu_check.py says which): world 1 against
# transformers on CUDA, run --device cuda (captured graphs, --compile, --fusions triton) and
# multi-rank parity (NCCL with a GPU per rank, else gloo on a shared one; --compile over gloo
# refused, and run through the library to read why), the Triton kernels compiled and matched
# against the interpreter, their bandwidth against the device's copy bandwidth, captured
# decode steps (eager and inductor, plain and with the Triton provider in place) against the
# eager step, the kernels a decode layer launches, and the performance tables (ours eager and
# captured against transformers eager and compiled, interleaved, each decode against its HBM
# roofline; a Qwen3 of hidden 2048 x 16 and the Llama-2-7B shape). Prints its tables; exits 1
# if a check fails and 2, saying so, without a CUDA device. `--only SECTION,...` and `--json
# FILE` as gpu_check.py says: the whole takes more than one device call's ten minutes, so run
# `--only parity,cli,kernels,captured,counts`, then `--only perf`, then `--only perf7b`.
source "$(dirname "$0")/env.sh"
cd "$ROOT"
unset TRITON_INTERPRET  # the kernels compile for the GPU (the interpreter runs in a subprocess)
exec python scripts/gpu_check.py "$@"
