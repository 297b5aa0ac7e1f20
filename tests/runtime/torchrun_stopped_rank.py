"""Run under torchrun by test_spawn_faults: rank 1 stops itself, rank 0 waits in a barrier."""

import os
import signal

import torch.distributed as dist

from layer_boundary.cli import TORCHRUN_COLLECTIVE_TIMEOUT_S
from layer_boundary.runtime.parallel import build_parallel, init_distributed, ParallelDims

rank, world = init_distributed(timeout_s=TORCHRUN_COLLECTIVE_TIMEOUT_S)
par = build_parallel(ParallelDims(world_size=world, tp=world))
with open(os.environ["PIDS"] + f".{rank}", "w") as f:
    f.write(str(os.getpid()))
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
dist.barrier(group=par.tp.pg)  # a subgroup's collective: it times out too
