#!/usr/bin/env bash
# The checks that need an NVIDIA GPU (scripts/gpu_check.py says which): world 1 against
# transformers on CUDA, multi-rank parity with --device cuda (NCCL with a GPU per rank, else
# gloo on a shared one), the Triton kernels compiled and matched against the interpreter,
# their bandwidth against the device's copy bandwidth, and a captured decode step against
# eager. Prints one table; exits 1 if a check fails and 2, saying so, without a CUDA device.
# Not part of the suite: under 10 minutes on one GPU.
source "$(dirname "$0")/env.sh"
cd "$ROOT"
unset TRITON_INTERPRET  # the kernels compile for the GPU (the interpreter runs in a subprocess)
exec python scripts/gpu_check.py "$@"
