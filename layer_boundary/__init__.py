"""layer_boundary: stage boundaries for parallel transformer inference.

Models import the factories, ``StageBoundary``, ``residual.batch`` and the runtime; row
arithmetic, group selection and collective choice stay inside the package.
"""

__version__ = "0.1.0"  # the package version (pyproject reads it from here)

from typing import TYPE_CHECKING

from .runtime.lazy import lazy_exports

if TYPE_CHECKING:  # what the names are, for type checkers; imported on first use
    from .contracts import BatchVariant, Owed, ProducerReduction, StageKind
    from .exit import FfnExit, MixerExit
    from .factories import (StageDeclaration, declare_attn, declare_ffn, install_fusion,
                            make_attn_stage, make_ffn_stage, make_stages)
    from .layout import Layout, SumGroup, TokenAxis
    from .output import HandoffOutput, OutputTransform
    from .residual import StageRead, StageUpdate
    from .residual.post_norm import PostNormAdd
    from .residual.scaled import ScaledAdd
    from .residual.stream import OwedOutput, ResidualStream
    from .stage import StageBoundary, boundary_guard_filter, stage_boundaries
    from .stack import LayerStack, append_stages, layer_stack
    from .adapters import branch_input, branch_output, merge_branch
    from .adapters.cp import CpView, cp_view
    from .adapters.tbo import (TboDecision, TboPolicy, run_two_batches, split_batch,
                               tbo_decision)

# each public name -> the module that defines it: importing the package imports no torch, so
# `layer-boundary --help` answers before torch loads (PEP 562)
_EXPORTS = {
    'BatchVariant': '.contracts',
    'Owed': '.contracts',
    'ProducerReduction': '.contracts',
    'StageKind': '.contracts',
    'FfnExit': '.exit',
    'MixerExit': '.exit',
    'StageDeclaration': '.factories',
    'declare_attn': '.factories',
    'declare_ffn': '.factories',
    'make_attn_stage': '.factories',
    'make_ffn_stage': '.factories',
    'make_stages': '.factories',
    'install_fusion': '.factories',
    'Layout': '.layout',
    'SumGroup': '.layout',
    'TokenAxis': '.layout',
    'HandoffOutput': '.output',
    'OutputTransform': '.output',
    'StageRead': '.residual',
    'StageUpdate': '.residual',
    'PostNormAdd': '.residual.post_norm',
    'ScaledAdd': '.residual.scaled',
    'OwedOutput': '.residual.stream',
    'ResidualStream': '.residual.stream',
    'StageBoundary': '.stage',
    'boundary_guard_filter': '.stage',
    'stage_boundaries': '.stage',
    'LayerStack': '.stack',
    'append_stages': '.stack',
    'layer_stack': '.stack',
    'branch_input': '.adapters',
    'branch_output': '.adapters',
    'merge_branch': '.adapters',
    'CpView': '.adapters.cp',
    'cp_view': '.adapters.cp',
    'run_two_batches': '.adapters.tbo',
    'split_batch': '.adapters.tbo',
    'TboDecision': '.adapters.tbo',
    'TboPolicy': '.adapters.tbo',
    'tbo_decision': '.adapters.tbo',
}

__all__ = [
    "__version__",
    "BatchVariant", "FfnExit", "HandoffOutput", "OutputTransform", "Layout", "MixerExit", "Owed",
    "OwedOutput",
    "ProducerReduction", "ResidualStream", "StageBoundary", "StageDeclaration", "StageKind",
    "StageRead", "StageUpdate", "PostNormAdd", "ScaledAdd",
    "SumGroup", "TokenAxis", "declare_attn", "declare_ffn", "make_attn_stage",
    "make_ffn_stage", "make_stages", "install_fusion", "boundary_guard_filter",
    "stage_boundaries",
    "branch_input", "branch_output", "merge_branch", "run_two_batches", "split_batch",
    "TboDecision", "TboPolicy", "tbo_decision",
    "LayerStack", "append_stages", "layer_stack", "CpView", "cp_view",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
