"""--boundary-reduction is resolved once, before construction, per architecture."""

import pytest

from layer_boundary.runtime.args import BoundaryRuntime, resolve_boundary_reduction
from layer_boundary.runtime.parallel import ParallelDims, build_parallel


def test_auto_resolves_per_architecture_and_a_draft_resolves_its_own():
    """``auto`` is what the architecture declares (its model class: see
    tests/models/test_registry.py); an architecture that declares none gets the all-reduce
    path; an explicit policy stands."""
    assert resolve_boundary_reduction("auto", "rs+rsv") == "rs+rsv"
    assert resolve_boundary_reduction("auto") == "ar"
    for explicit in ("ar", "rs", "rsv", "rs+rsv"):
        assert resolve_boundary_reduction(explicit, "rs+rsv") == explicit
    with pytest.raises(ValueError, match="an architecture's boundary_reduction must be one of"):
        resolve_boundary_reduction("auto", "qwen3")


def test_bad_policy_names_the_value():
    with pytest.raises(ValueError, match="boundary_reduction must be one of .*'rsx'"):
        resolve_boundary_reduction("rsx")
    with pytest.raises(ValueError, match="must be resolved"):
        BoundaryRuntime(build_parallel(ParallelDims()), boundary_reduction="auto")
