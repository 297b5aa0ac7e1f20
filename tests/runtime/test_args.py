"""--boundary-reduction is resolved once, before construction, per architecture."""

import pytest

from layer_boundary.runtime.args import (AUTO_BOUNDARY_REDUCTION, BoundaryRuntime,
                                         resolve_boundary_reduction)
from layer_boundary.runtime.parallel import ParallelDims, build_parallel


def test_auto_resolves_per_architecture_and_a_draft_resolves_its_own():
    target = resolve_boundary_reduction("auto", "qwen3")
    assert target == AUTO_BOUNDARY_REDUCTION["qwen3"]
    # a draft checkpoint of another architecture (or none listed) gets its own answer
    assert resolve_boundary_reduction("auto", "some_draft_arch") == "ar"
    for explicit in ("ar", "rs", "rsv", "rs+rsv"):
        assert resolve_boundary_reduction(explicit, "qwen3") == explicit


def test_bad_policy_names_the_value():
    with pytest.raises(ValueError, match="boundary_reduction must be one of .*'rsx'"):
        resolve_boundary_reduction("rsx", "qwen3")
    with pytest.raises(ValueError, match="must be resolved"):
        BoundaryRuntime(build_parallel(ParallelDims()), boundary_reduction="auto")
