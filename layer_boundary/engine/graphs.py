"""CUDA graphs for a run's decode steps: where they run (decided once, at construction, from
what every rank has), and the captured decode forward, one graph per token bucket.

Engines serve decode from CUDA graphs by default (SGLang, vLLM): a graph replays every kernel
of a step without the Python that launched it. ``run --device cuda`` does the same: each decode
bucket's padded batch is captured with ``torch.cuda.CUDAGraph`` on its first step and replayed
after; the prefill runs eagerly. Under ``--compile`` inductor captures its own graphs instead
(``triton.cudagraphs``). Either way a graph holds only what it can replay: NCCL collectives,
never gloo's (gloo runs a collective on host threads a replay never calls).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

import torch

from ..capabilities import graph_blocker
from ..runtime.forward_batch import ForwardMode
from ..runtime.ledger import LEDGER
from .features import features_of

log = logging.getLogger("layer_boundary")

DISABLE_FLAG = "--disable-cuda-graph"

# forwards a bucket runs before its capture (on a side stream, as torch's docs ask: lazy
# initialisation and the allocator's first blocks happen outside the graph)
WARMUPS = 2
# the largest padded decode batch captured (SGLang's default ceiling is of this order); a
# larger decode step runs eagerly
MAX_CAPTURED_ROWS = 256


class Graphs(enum.Enum):
    """Where a run's forwards run from CUDA graphs."""

    OFF = "off"
    CAPTURED = "captured"  # each decode bucket captured with torch.cuda.CUDAGraph (ours)
    INDUCTOR = "inductor"  # inductor's graphs of each compiled bucket (``triton.cudagraphs``)


@dataclass(frozen=True)
class GraphDecision:
    """A run's CUDA-graph decision and why (the report prints ``why``)."""

    graphs: Graphs
    why: str


def decide_graphs(spec, parallel, pads: bool) -> GraphDecision:
    """Whether and how ``spec``'s forwards run from CUDA graphs on ``parallel``'s groups.

    Args:
        spec: the run (``RunSpec``): its device, ``cuda_graph`` (False: ``--disable-cuda-graph``),
            compile backend and modes.
        parallel: this rank's topology; every rank's has the same backends, so every rank
            decides alike.
        pads: the model's cache serves padded batches (``takes_padded_batches``): a graph
            needs one batch shape per bucket.
    """
    if spec.device != "cuda":
        return GraphDecision(Graphs.OFF, "CUDA graphs run on --device cuda only")
    if not spec.cuda_graph:
        return GraphDecision(Graphs.OFF, f"{DISABLE_FLAG} (or --enforce-eager) asked")
    blocker = parallel.uncapturable_group()
    if blocker is not None:
        return GraphDecision(Graphs.OFF, f"the {blocker.name} group's collectives run on "
                                         f"{blocker.backend}, which a CUDA graph cannot hold "
                                         "(ranks sharing a GPU); NCCL's can")
    refusal = _mode_refusal(spec, pads)
    if refusal is not None:
        return GraphDecision(Graphs.OFF, refusal)
    if spec.compile is not None:
        if spec.compile != "inductor":
            return GraphDecision(Graphs.OFF, f"the {spec.compile} compile backend captures "
                                             "no graphs (inductor does)")
        return GraphDecision(Graphs.INDUCTOR, "inductor captures each token bucket's "
                                              "compiled graph")
    return GraphDecision(Graphs.CAPTURED, "each decode bucket is captured on its first step "
                                          "and replayed after; the prefill runs eagerly")


def _mode_refusal(spec, pads: bool) -> str | None:
    """Why ``spec``'s forwards cannot be one static batch shape per bucket, or None: the
    combination table's graph rules (``capabilities.GRAPH_RULES``), then what is not a
    feature."""
    if not pads:
        return "the model's cache cannot serve padded batches (a graph is one batch shape)"
    blocker = graph_blocker(features_of(spec))
    if blocker is None and spec.trace:
        blocker = "tracing the residual stream runs Python each forward"
    return blocker


@dataclass
class _Captured:
    """One bucket's graph: the batch it was captured on (its tensors are the graph's inputs),
    the output it writes, and what the capture recorded in the ledger."""

    graph: object
    batch: object
    out: torch.Tensor
    entries: list = field(default_factory=list)

    def replay(self, batch) -> torch.Tensor:
        static = self.batch
        static.input_ids.copy_(batch.input_ids)
        static.positions.copy_(batch.positions)
        static.token_slots.copy_(batch.token_slots)
        self.graph.replay()
        batch.boundary = static.boundary  # the row facts the capture placed (the report's)
        LEDGER.repeat(self.entries)
        return self.out


class CudaCapture:
    """How ``CapturedDecode`` makes a graph: warm-up forwards on a side stream, then
    ``torch.cuda.CUDAGraph`` capture, every graph of a run in one memory pool (they never run
    at once)."""

    def __init__(self) -> None:
        self.pool = None

    def warm_up(self, forward) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUPS):
                forward()
        torch.cuda.current_stream().wait_stream(side)

    def record(self, forward):
        """(graph, the output tensor it writes) of ``forward()`` captured; nothing ran."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        self.pool = graph.pool()
        return graph, out

    def recover(self) -> None:
        torch.cuda.synchronize()


class CapturedDecode:
    """``model``'s forward with each padded decode step replayed from its bucket's CUDA graph
    (``Graphs.CAPTURED``); every other forward (prefills, an unpadded batch, a step over
    ``MAX_CAPTURED_ROWS`` rows) runs the model eagerly.

    The graph of a bucket is captured on its first step, after ``WARMUPS`` eager forwards of
    that same batch (each writes the step's own keys and values, so they change nothing a
    replay would not); a replay copies the step's token ids, positions and cache slots into
    the captured batch's tensors. The output is the graph's own tensor, overwritten by the
    next replay: the caller reads it before the next step. A capture that fails (a forward
    that syncs with the host) turns the graphs off for the run, and ``failed`` says why.

    Args:
        model: the model (``model(batch, pp_input)``): what every step not replayed runs.
        step: what each graph holds (default ``model``): the decode step compiled by
            inductor (``decode_step``), whose kernels are fewer (18 a decode layer on an
            H200 against the eager step's 44), or the eager step.
        capture: how graphs are made (``CudaCapture``).
        step_name: how the report names ``step`` (``decode_step``'s name for it).
    """

    def __init__(self, model, step=None, capture=None, step_name: str = "eager") -> None:
        self.model, self.step = model, step if step is not None else model
        self.step_name = step_name
        self.capture = capture or CudaCapture()
        self.graphs: dict[int, _Captured] = {}
        self.failed: str | None = None
        self.replays = 0

    def __call__(self, batch, pp_input=None):
        rows = batch.num_tokens
        if (self.failed is None and batch.forward_mode is ForwardMode.DECODE
                and batch.token_slots is not None and rows <= MAX_CAPTURED_ROWS):
            captured = self.graphs.get(rows)
            if captured is not None:
                self.replays += 1
                return captured.replay(batch)
            out = self._capture(batch)
            if out is not None:
                return out
        return self.model(batch, pp_input)

    def __getattr__(self, name):  # the rest is the model's (its cache, device, stage)
        return getattr(self.model, name)

    @property
    def buckets(self) -> list[int]:
        return sorted(self.graphs)

    def _capture(self, batch):
        first = len(LEDGER.entries)
        try:
            with LEDGER.paused():  # the first warm-up of a compiled step compiles it
                self.capture.warm_up(lambda: self.step(batch))
            graph, out = self.capture.record(lambda: self.step(batch))
        except RuntimeError as exc:
            self.failed = (f"capturing the {batch.num_tokens}-row decode bucket failed "
                           f"({str(exc).splitlines()[0][:160]}); decode ran eagerly")
            log.warning("CUDA graphs off: %s", self.failed)
            self.capture.recover()
            return None
        # what the capture's Python recorded is this step's (and each replay's) collectives
        captured = _Captured(graph, batch, out,
                             LEDGER.entries[first:] if LEDGER.enabled else [])
        self.graphs[batch.num_tokens] = captured
        graph.replay()  # the capture ran nothing: this step's numbers come from the replay
        return out


def decode_step(spec, model):
    """(what ``spec``'s captured decode graphs hold, its name): the step compiled by inductor
    (one graph per token bucket, fullgraph, no graphs of inductor's own), or the eager step
    where ``spec.captured_decode`` asks for it or the model's forward does not compile (the
    name says why)."""
    from ..capabilities import CapabilityError
    from .compiled import compile_forward

    if spec.captured_decode == "eager":
        return model, "eager"
    try:
        return compile_forward(model, "inductor", padded=True), "inductor"
    except CapabilityError as exc:
        return model, f"eager ({exc})"


class InductorSkips:
    """Inductor's reasons for running a compiled graph without its CUDA graph (its
    ``cudagraphs`` log: "skipping cudagraphs due to ..."), collected while installed."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self._handler = None

    def __enter__(self) -> InductorSkips:
        from torch._inductor import cudagraph_utils

        skips = self

        class _Collect(logging.Handler):
            def emit(self, record) -> None:
                message = record.getMessage()
                if "skipping cudagraphs" in message:
                    skips.reasons.append(message.splitlines()[0])

        self._logger = cudagraph_utils.cudagraphs_log
        self._handler = _Collect()
        self._logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc) -> None:
        self._logger.removeHandler(self._handler)
