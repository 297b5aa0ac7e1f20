"""What plays the engine around the library: the runner (one rank's run of a checkpoint), the
command line (``layer-boundary run | plan | bench``), the bench, and the drivers of a
generation (greedy decoding, speculative decoding, the pipeline transport between steps).

The library core (everything outside this package, the models included) never imports it.
Importing this package imports no torch: its names load on first use.
"""

from typing import TYPE_CHECKING

from ..runtime.lazy import lazy_exports

if TYPE_CHECKING:  # what the names are, for type checkers; imported on first use
    from .cli import main
    from .features import check_spec
    from .generate import Generation, greedy_generate
    from .parity import parity, verdict_ok
    from .runner import RankResult, RunSpec, merge, run_rank
    from .speculative import SpeculativeStats, speculative_generate

_EXPORTS = {
    'main': '.cli',
    'check_spec': '.features',
    'Generation': '.generate',
    'greedy_generate': '.generate',
    'parity': '.parity',
    'verdict_ok': '.parity',
    'RankResult': '.runner',
    'RunSpec': '.runner',
    'merge': '.runner',
    'run_rank': '.runner',
    'SpeculativeStats': '.speculative',
    'speculative_generate': '.speculative',
}

__all__ = ["Generation", "RankResult", "RunSpec", "SpeculativeStats", "check_spec",
           "greedy_generate", "main", "merge", "parity", "run_rank", "speculative_generate",
           "verdict_ok"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
