"""Runtime arguments a model's boundaries are built with, resolved before construction."""

from __future__ import annotations

from dataclasses import dataclass

from .arguments import flag
from .capabilities import check_runtime
from .defaults import BOUNDARY_REDUCTIONS  # noqa: F401 - the choices, stated once there
from .forward_batch import BatchVariant
from .parallel import Parallel

# how a MoE reaches its experts: "none" (every TP rank holds every DP rank's rows, gathered by
# the boundary) or "all_to_all" (the MoE stays on the attention rows and dispatches each
# routed token to its experts' ranks itself)
MOE_A2A_BACKENDS = ("none", "all_to_all")

def resolve_boundary_reduction(value: str, auto: str = "ar") -> str:
    """Resolve ``--boundary-reduction`` once, before construction.

    Args:
        value: ar | rs | rsv | rs+rsv | auto.
        auto: what ``auto`` resolves to: the architecture's own policy, which its model class
            declares (``boundary_reduction``); the all-reduce path, always correct, by default.
            A separate draft checkpoint resolves its own (spec:
            ``speculative_boundary_reduction``).
    """
    if value not in BOUNDARY_REDUCTIONS:
        raise ValueError(
            f"boundary_reduction must be one of {', '.join(BOUNDARY_REDUCTIONS)}, got {value!r}")
    if auto not in BOUNDARY_REDUCTIONS[:-1]:
        raise ValueError(f"an architecture's boundary_reduction must be one of "
                         f"{', '.join(BOUNDARY_REDUCTIONS[:-1])}, got {auto!r}")
    return auto if value == "auto" else value


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
    # MOE_A2A_BACKENDS: "all_to_all" builds MoE stages that compute on the residual's rows
    # (declare_ffn(dispatches=True)); with attention TP > 1 those are the scattered rows, so
    # such a runtime has no ar path
    moe_a2a_backend: str = "none"
    # ``auto`` as asked: each batch takes a scattered path only where it sends fewer rows
    # than ar (row_modes.select_mode); False: the policy's own preference, always
    choose_by_bytes: bool = False

    def __post_init__(self) -> None:
        for name in ("allreduce_fusion", "rs_padding", "choose_by_bytes"):
            flag("BoundaryRuntime", name, getattr(self, name))  # "no" would read as on
        if not (isinstance(self.batch_variants, tuple) and self.batch_variants
                and all(isinstance(v, BatchVariant) for v in self.batch_variants)):
            # a string ("ordinary") matched no variant: no stage built a path for it
            raise TypeError(f"BoundaryRuntime(batch_variants={self.batch_variants!r}): "
                            "batch_variants must be a non-empty tuple of BatchVariant")
        if self.pp_layers is not None and not (
                isinstance(self.pp_layers, tuple) and all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 1
                    for n in self.pp_layers)):
            raise TypeError(f"BoundaryRuntime(pp_layers={self.pp_layers!r}): pp_layers must be "
                            "a tuple of positive layer counts, one per pipeline stage, or None")
        if self.moe_a2a_backend not in MOE_A2A_BACKENDS:
            raise ValueError(f"BoundaryRuntime.moe_a2a_backend must be one of "
                             f"{', '.join(MOE_A2A_BACKENDS)}, got {self.moe_a2a_backend!r}")
        if self.boundary_reduction not in BOUNDARY_REDUCTIONS[:-1]:
            raise ValueError(
                "BoundaryRuntime.boundary_reduction must be resolved (ar, rs, rsv or rs+rsv), "
                f"got {self.boundary_reduction!r}; call resolve_boundary_reduction() first")
        check_runtime(self)  # its features against each other, its layout and its policy

    @property
    def dispatches_moe(self) -> bool:
        return self.moe_a2a_backend != "none"

    @property
    def allows_rs(self) -> bool:
        return self.boundary_reduction in ("rs", "rs+rsv")

    @property
    def allows_rsv(self) -> bool:
        return self.boundary_reduction in ("rsv", "rs+rsv")


_RUNTIME: list[BoundaryRuntime] = []


def set_runtime(runtime: BoundaryRuntime) -> None:
    """Make ``runtime`` the engine's default: what a stage built without ``runtime=`` outside
    a layer stack is built on (construction only; a forward never reads it)."""
    _RUNTIME[:] = [runtime]


def get_runtime() -> BoundaryRuntime:
    """The engine's default runtime (``set_runtime``), or the error saying none is set."""
    if not _RUNTIME:
        raise RuntimeError("no boundary runtime is set; pass runtime= or call set_runtime() first")
    return _RUNTIME[0]
