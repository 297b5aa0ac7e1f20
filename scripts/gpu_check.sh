#!/usr/bin/env bash
# The checks that need an NVIDIA GPU (scripts/gpu_check.py says which): world 1 against
# transformers on CUDA, multi-rank parity with --device cuda (NCCL with a GPU per rank, else
# gloo on a shared one), the Triton kernels compiled and matched against the interpreter,
# their bandwidth against the device's copy bandwidth, a captured decode step against eager,
# run's CUDA graphs (captured decode, inductor's, off over gloo), the kernels a decode layer
# launches, and the performance table (ours eager and captured against transformers eager
# and compiled, each decode against its HBM roofline). Prints its tables; exits 1 if a check
# fails and 2, saying so, without a CUDA device. `--only SECTION,...` and `--json FILE` as
# gpu_check.py says. Not part of the suite: about 8 minutes on one H200.
source "$(dirname "$0")/env.sh"
cd "$ROOT"
unset TRITON_INTERPRET  # the kernels compile for the GPU (the interpreter runs in a subprocess)
exec python scripts/gpu_check.py "$@"
