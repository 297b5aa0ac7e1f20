"""A rank's forward under ``torch.compile(fullgraph=True)``: one graph per token bucket where
the cache serves padded batches, and the count of graphs dynamo built."""

from __future__ import annotations

import torch

from .. import boundary_guard_filter
from ..capabilities import Feature, check_model
from .features import COMPILE_BACKENDS  # noqa: F401 - the backends, stated once there

# one graph per token bucket: a doubling per graph reaches 16 x 2^31 rows before the limit
RECOMPILE_LIMIT = 32


def compile_forward(model, backend: str, padded: bool, cuda_graphs: bool = False):
    """``model``'s forward under ``torch.compile(fullgraph=True)``.

    ``padded``: each forward is padded to its token bucket (``greedy_generate(bucket=)``), so
    shapes are static and a graph is one bucket's; automatic dynamic shapes would only trace
    the boundary's per-batch Python over symbolic sizes. Otherwise (a cache that cannot serve
    padded batches) dynamo's defaults apply, and a new request pattern is a new graph. The
    recompile limit admits one graph per bucket.

    A model whose runtime's features, or adapters, do not combine with compiling is refused
    (``capabilities.check_model``), before any tracing.

    What is compiled is the model's bound ``forward``, called as ``compiled(forward_batch)``:
    ``torch.compile(model)`` would wrap it in an ``OptimizedModule``, whose call runs module
    hooks outside the graph at the cost of about a dozen Python calls a forward (our models
    register none; a hook registered on the model does not run here).

    ``cuda_graphs`` (``graphs.decide_graphs`` said ``Graphs.INDUCTOR``: a CUDA device, every
    collective capturable): an inductor graph of a padded bucket also runs as a captured CUDA
    graph (what ``mode="reduce-overhead"`` asks; the two cannot both be passed)."""
    stack, config = getattr(model, "stack", None), getattr(model, "config", None)
    if stack is not None and config is not None:
        adapted = any(getattr(m, "lora", None) is not None for m in model.modules())
        check_model(type(model), config, stack.runtime,
                    {Feature.COMPILE} | ({Feature.LORA} if adapted else set()))
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               RECOMPILE_LIMIT)
    options = {"guard_filter_fn": boundary_guard_filter(model)}
    if cuda_graphs and backend == "inductor" and padded:
        # mode="reduce-overhead": each bucket's graph is captured as a CUDA graph and
        # replayed (static shapes per bucket; nothing in a forward syncs with the host)
        options["triton.cudagraphs"] = True
    return torch.compile(model.forward, fullgraph=True, backend=backend,
                         dynamic=False if padded else None, options=options)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (``torch._dynamo`` counters)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
