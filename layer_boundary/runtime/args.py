"""Runtime arguments a model's boundaries are built with, resolved before construction."""

from __future__ import annotations

from dataclasses import dataclass

from .forward_batch import BatchVariant
from .parallel import Parallel

BOUNDARY_REDUCTIONS = ("ar", "rs", "rsv", "rs+rsv", "auto")

# Per-architecture resolution of ``auto`` (model_type -> policy). Architectures not listed
# resolve to the all-reduce path, which is always correct.
AUTO_BOUNDARY_REDUCTION: dict[str, str] = {
    "qwen3": "rs+rsv",
    "qwen3_moe": "rs+rsv",
    "deepseek_v3": "rs+rsv",
    "nemotron_h": "rs+rsv",
    "longcat_flash": "rs+rsv",
    "deepseek_v4": "rs+rsv",
}


def resolve_boundary_reduction(value: str, model_type: str) -> str:
    """Resolve ``--boundary-reduction`` once, before construction; ``auto`` by architecture.

    A separate draft checkpoint resolves its own value by calling this with its own
    ``model_type`` (spec: ``speculative_boundary_reduction``).
    """
    if value not in BOUNDARY_REDUCTIONS:
        raise ValueError(
            f"boundary_reduction must be one of {', '.join(BOUNDARY_REDUCTIONS)}, got {value!r}")
    if value == "auto":
        return AUTO_BOUNDARY_REDUCTION.get(model_type, "ar")
    return value


@dataclass(frozen=True)
class BoundaryRuntime:
    """What boundary construction reads from the engine: topology and resolved policies."""

    parallel: Parallel
    boundary_reduction: str = "ar"  # resolved: ar | rs | rsv | rs+rsv
    # Permit a producer to leave a single all-reduce to the next stage's input, where it can
    # join the consumer's add+norm (spec: reduction fusion has its own enablement).
    allreduce_fusion: bool = True
    # Permit fixed-size reduce-scatter to pad DP segments to a multiple of attention TP.
    rs_padding: bool = True
    # The batch variants the engine will run: every stage builds a path for each, or is
    # rejected at construction.
    batch_variants: tuple = (BatchVariant.ORDINARY,)
    # Layers per pipeline stage (``--pp-layers``); None: an even split, remainder first.
    pp_layers: tuple | None = None

    def __post_init__(self) -> None:
        if self.boundary_reduction not in BOUNDARY_REDUCTIONS[:-1]:
            raise ValueError(
                "BoundaryRuntime.boundary_reduction must be resolved (ar, rs, rsv or rs+rsv), "
                f"got {self.boundary_reduction!r}; call resolve_boundary_reduction() first")

    @property
    def allows_rs(self) -> bool:
        return self.boundary_reduction in ("rs", "rs+rsv")

    @property
    def allows_rsv(self) -> bool:
        return self.boundary_reduction in ("rsv", "rs+rsv")


_RUNTIME: list[BoundaryRuntime] = []


def set_runtime(runtime: BoundaryRuntime) -> None:
    _RUNTIME[:] = [runtime]


def get_runtime() -> BoundaryRuntime:
    if not _RUNTIME:
        raise RuntimeError("no boundary runtime is set; pass runtime= or call set_runtime() first")
    return _RUNTIME[0]
