"""The host runtime that plays the engine's part: topology, batches, flags, layers, ledger.

It stands below the boundary library and imports nothing from it. What an engine or a test
needs to stand up a topology and run a batch is exported here; see docs/api.md ("Public runtime
API").
"""

from typing import TYPE_CHECKING

from .lazy import lazy_exports

if TYPE_CHECKING:  # what the names are, for type checkers; imported on first use
    from .args import (BOUNDARY_REDUCTIONS, BoundaryRuntime, get_runtime,
                       resolve_boundary_reduction, set_runtime)
    from .collectives import (all_reduce_rows, all_to_all_rows, broadcast_from_last_stage,
                              exchange_counts, gather_last_dim, gather_rows, gather_rows_v,
                              recv_from_prev_stage, reduce_scatter_rows,
                              reduce_scatter_rows_v, send_to_next_stage)
    from .context import NO_FLAGS, ForwardFlags, get_forward, get_parallel
    from .embedding import ParallelLMHead, VocabParallelEmbedding
    from .forward_batch import (SMALLEST_BUCKET, BatchVariant, ForwardBatch, ForwardMode,
                                LogitsRows, TwoBatch, token_bucket)
    from .ledger import (LEDGER, HOOK, Ledger, LedgerEntry, Observer, observing, summarize,
                         wire_total)
    from .linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from .modes import MODES, RunModes
    from .norm import GemmaRMSNorm, RMSNorm
    from .packed import pack_linears
    from .launch import RankError, init_distributed, launched_by_torchrun, spawn
    from .parallel import (Group, Parallel, ParallelDims, TopologyError, build_parallel,
                           built_topologies, release_parallel, virtual_parallel)

# each public name -> its module, imported on first use (PEP 562): the command line reads
# `defaults` without importing torch
_EXPORTS = {
    'BOUNDARY_REDUCTIONS': '.args',
    'BoundaryRuntime': '.args',
    'get_runtime': '.args',
    'resolve_boundary_reduction': '.args',
    'set_runtime': '.args',
    'all_reduce_rows': '.collectives',
    'all_to_all_rows': '.collectives',
    'broadcast_from_last_stage': '.collectives',
    'exchange_counts': '.collectives',
    'gather_last_dim': '.collectives',
    'gather_rows': '.collectives',
    'gather_rows_v': '.collectives',
    'recv_from_prev_stage': '.collectives',
    'reduce_scatter_rows': '.collectives',
    'reduce_scatter_rows_v': '.collectives',
    'send_to_next_stage': '.collectives',
    'NO_FLAGS': '.context',
    'ForwardFlags': '.context',
    'get_forward': '.context',
    'get_parallel': '.context',
    'ParallelLMHead': '.embedding',
    'VocabParallelEmbedding': '.embedding',
    'SMALLEST_BUCKET': '.forward_batch',
    'BatchVariant': '.forward_batch',
    'ForwardBatch': '.forward_batch',
    'ForwardMode': '.forward_batch',
    'LogitsRows': '.forward_batch',
    'TwoBatch': '.forward_batch',
    'token_bucket': '.forward_batch',
    'LEDGER': '.ledger',
    'HOOK': '.ledger',
    'Ledger': '.ledger',
    'LedgerEntry': '.ledger',
    'Observer': '.ledger',
    'observing': '.ledger',
    'summarize': '.ledger',
    'wire_total': '.ledger',
    'ColumnParallelLinear': '.linear',
    'MODES': '.modes',
    'RunModes': '.modes',
    'QKVParallelLinear': '.linear',
    'RowParallelLinear': '.linear',
    'RMSNorm': '.norm',
    'GemmaRMSNorm': '.norm',
    'pack_linears': '.packed',
    'Group': '.parallel',
    'Parallel': '.parallel',
    'ParallelDims': '.parallel',
    'RankError': '.launch',
    'TopologyError': '.parallel',
    'build_parallel': '.parallel',
    'built_topologies': '.parallel',
    'release_parallel': '.parallel',
    'init_distributed': '.launch',
    'launched_by_torchrun': '.launch',
    'spawn': '.launch',
    'virtual_parallel': '.parallel',
}

__all__ = [
    # topology and process start-up
    "ParallelDims", "TopologyError", "Group", "Parallel", "build_parallel", "built_topologies",
    "release_parallel", "virtual_parallel",
    "init_distributed", "launched_by_torchrun", "spawn", "RankError",
    # what boundary construction reads
    "BoundaryRuntime", "resolve_boundary_reduction", "set_runtime", "get_runtime",
    "BOUNDARY_REDUCTIONS",
    # a batch and the flags compute reads
    "ForwardBatch", "ForwardMode", "TwoBatch", "BatchVariant", "LogitsRows", "ForwardFlags",
    "NO_FLAGS", "get_forward",
    "get_parallel", "token_bucket", "SMALLEST_BUCKET",
    # collectives (row contracts in collectives.py)
    "all_reduce_rows", "reduce_scatter_rows", "reduce_scatter_rows_v", "gather_rows",
    "gather_rows_v", "gather_last_dim", "exchange_counts", "all_to_all_rows",
    "send_to_next_stage", "recv_from_prev_stage",
    "broadcast_from_last_stage",
    # layers that honour the flags
    "ColumnParallelLinear", "QKVParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "ParallelLMHead", "RMSNorm", "GemmaRMSNorm", "pack_linears",
    # observing a forward
    "LEDGER", "Ledger", "LedgerEntry", "Observer", "HOOK", "observing", "summarize",
    "wire_total",
    # the run-wide modes (batch invariance, the agreement check, the observer), one object
    "MODES", "RunModes",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
