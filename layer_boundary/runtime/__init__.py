"""The host runtime that plays the engine's part: topology, batches, flags, layers, ledger.

It stands below the boundary library and imports nothing from it. What an engine or a test
needs to stand up a topology and run a batch is exported here; see README ("Public runtime
API").
"""

from .args import (BOUNDARY_REDUCTIONS, BoundaryRuntime, get_runtime, resolve_boundary_reduction,
                   set_runtime)
from .collectives import (all_reduce_rows, all_to_all_rows, broadcast_from_last_stage,
                          exchange_counts, gather_last_dim, gather_rows, gather_rows_v, recv_from_prev_stage, reduce_scatter_rows,
                          reduce_scatter_rows_v, send_to_next_stage)
from .context import NO_FLAGS, ForwardFlags, get_forward, get_parallel
from .embedding import ParallelLMHead, VocabParallelEmbedding
from .forward_batch import SMALLEST_BUCKET, BatchVariant, ForwardBatch, ForwardMode, token_bucket
from .ledger import LEDGER, HOOK, Ledger, LedgerEntry, Observer, observing, summarize
from .linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from .norm import RMSNorm
from .parallel import (Group, Parallel, ParallelDims, RankError, TopologyError, build_parallel,
                       init_distributed, launched_by_torchrun, spawn, virtual_parallel)

__all__ = [
    # topology and process start-up
    "ParallelDims", "TopologyError", "Group", "Parallel", "build_parallel", "virtual_parallel",
    "init_distributed", "launched_by_torchrun", "spawn", "RankError",
    # what boundary construction reads
    "BoundaryRuntime", "resolve_boundary_reduction", "set_runtime", "get_runtime",
    "BOUNDARY_REDUCTIONS",
    # a batch and the flags compute reads
    "ForwardBatch", "ForwardMode", "BatchVariant", "ForwardFlags", "NO_FLAGS", "get_forward",
    "get_parallel", "token_bucket", "SMALLEST_BUCKET",
    # collectives (row contracts in collectives.py)
    "all_reduce_rows", "reduce_scatter_rows", "reduce_scatter_rows_v", "gather_rows",
    "gather_rows_v", "gather_last_dim", "exchange_counts", "all_to_all_rows",
    "send_to_next_stage", "recv_from_prev_stage",
    "broadcast_from_last_stage",
    # layers that honour the flags
    "ColumnParallelLinear", "QKVParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "ParallelLMHead", "RMSNorm",
    # observing a forward
    "LEDGER", "Ledger", "LedgerEntry", "Observer", "HOOK", "observing", "summarize",
]
