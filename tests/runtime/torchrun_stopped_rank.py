"""Run under torchrun by test_spawn_faults: rank 1 stops itself, rank 0 waits in a barrier
and writes when its collective gave up."""

import os
import signal
import time

import torch.distributed as dist

from layer_boundary.engine.run_command import TORCHRUN_COLLECTIVE_TIMEOUT_S
from layer_boundary.runtime.launch import init_distributed
from layer_boundary.runtime.parallel import ParallelDims, build_parallel

rank, world = init_distributed(timeout_s=TORCHRUN_COLLECTIVE_TIMEOUT_S)
par = build_parallel(ParallelDims(world_size=world, tp=world))
with open(os.environ["PIDS"] + f".{rank}", "w") as f:
    f.write(str(os.getpid()))
if rank == 1:
    with open(os.environ["PIDS"] + ".stopped", "w") as f:
        f.write(str(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)
try:
    dist.barrier(group=par.tp_group.pg)  # a subgroup's collective: it times out too
finally:
    with open(os.environ["PIDS"] + ".gave_up", "w") as f:
        f.write(str(time.time()))
