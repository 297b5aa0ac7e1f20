"""layer_boundary: stage boundaries for parallel transformer inference.

Models import the factories, ``StageBoundary``, ``residual.batch`` and the runtime; row
arithmetic, group selection and collective choice stay inside the package.
"""

__version__ = "0.1.0"  # the package version (pyproject reads it from here)

from .contracts import BatchVariant, Owed, ProducerReduction, StageKind
from .exit import FfnExit, MixerExit
from .factories import (StageDeclaration, declare_attn, declare_ffn, make_attn_stage,
                        make_ffn_stage, make_stages)
from .layout import Layout, SumGroup, TokenAxis
from .output import HandoffOutput, OutputTransform
from .residual.stream import OwedOutput, ResidualStream
from .stage import StageBoundary, boundary_guard_filter, stage_boundaries
from .stack import LayerStack, append_stages, layer_stack
from .adapters import branch_input, branch_output, merge_branch
from .adapters.cp import CpView, cp_view
from .adapters.tbo import run_two_batches, split_batch

__all__ = [
    "__version__",
    "BatchVariant", "FfnExit", "HandoffOutput", "OutputTransform", "Layout", "MixerExit", "Owed", "OwedOutput",
    "ProducerReduction", "ResidualStream", "StageBoundary", "StageDeclaration", "StageKind",
    "SumGroup", "TokenAxis", "declare_attn", "declare_ffn", "make_attn_stage",
    "make_ffn_stage", "make_stages", "boundary_guard_filter", "stage_boundaries",
    "branch_input", "branch_output", "merge_branch", "run_two_batches", "split_batch",
    "LayerStack", "append_stages", "layer_stack", "CpView", "cp_view",
]
