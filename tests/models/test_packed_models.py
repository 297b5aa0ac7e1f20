"""Models on packed weights (runtime/packed.py): the tiny checkpoints' weights are below
``PACK_MIN``, so these tests pack every one (``min_elements=0``) and run the engine on them:
world 1 against transformers, and the ranks (TP, attention DP with rs/rsv and an idle DP
rank, a sequence-parallel batch, a MoE with EP) against an unpacked world 1. (Every model a
test loads through ``load_model`` has its wide weights stored transposed, whatever their
size: the whole suite's parity runs on that layout.)"""

from __future__ import annotations

import contextlib

import pytest
import torch
from checkpoints import hf_qwen3_moe, hf_reference
from distributed.checks import assert_logits_match, merge, world1
from distributed.pool import get_pool
from oracle import assert_decode_matches, assert_prefill_matches

from layer_boundary.engine.runner import RunSpec, run_rank
from layer_boundary.models import load_model
from layer_boundary.runtime import packed as packing
from layer_boundary.runtime.parallel import ParallelDims, build_parallel
from layer_boundary.runtime.args import BoundaryRuntime

pytestmark = [pytest.mark.models,
              pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                 reason="torch without oneDNN packs nothing")]
PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))  # dp 4 leaves a rank idle


@contextlib.contextmanager
def packing_everything():
    """Every packable weight packed by ``load_model``, and a count of the packed matmuls."""
    calls, matmul, least = [], packing._matmul, packing.PACK_MIN

    def counted(*args):
        calls.append(1)
        return matmul(*args)

    packing.PACK_MIN, packing._matmul = 0, counted
    try:
        yield calls
    finally:
        packing.PACK_MIN, packing._matmul = least, matmul


def test_world1_on_packed_weights_matches_transformers(qwen3_dir):
    with packing_everything() as calls:
        ours = load_model(qwen3_dir, BoundaryRuntime(build_parallel(ParallelDims())))
        packed = [m for m in ours.modules() if getattr(m, "packed", None) is not None]
        declared = [m for m in ours.modules() if getattr(type(m), "packs_weight", False)]
        # every layer's q/k/v, o, gate, up and down, and the LM head
        assert packed == declared and len(packed) == 5 * len(ours.model.layers) + 1
        # the wide ones (q/k/v, gate, up, the LM head) stored transposed, the rest as loaded
        assert all(m.weight.is_contiguous() == (m.weight.shape[0] <= m.weight.shape[1])
                   for m in declared)
        assert any(not m.weight.is_contiguous() for m in declared)
        ref = hf_reference(qwen3_dir)
        assert_prefill_matches(ours, ref, [list(p) for p in PROMPTS])
        assert len(calls) == len(packed)  # one forward: every linear on its packed copy
        assert_decode_matches(ours, ref, [list(p) for p in PROMPTS], steps=3)


def _packed_rank(spec: RunSpec):
    with packing_everything() as calls:
        result = run_rank(spec)
    return result, len(calls)


CASES = [  # (tp, dp, ep, policy, sequence parallel, the prefill's row mode)
    ("qwen3", 2, 1, 1, "ar", False, "ar"),
    ("qwen3", 4, 4, 1, "auto", False, "rsv"),
    ("qwen3", 4, 2, 1, "rs", True, "rs"),
    ("qwen3_moe", 4, 2, 4, "rsv", False, "rsv"),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model,tp,dp,ep,policy,sp,mode", CASES,
                         ids=[f"{c[0]}-tp{c[1]}-dp{c[2]}-ep{c[3]}-{c[4]}" + ("-sp" if c[5] else "")
                              for c in CASES])
def test_ranks_on_packed_weights_match_world1(qwen3_dir, tmp_path_factory, model, tp, dp, ep,
                                              policy, sp, mode):
    path = qwen3_dir if model == "qwen3" else hf_qwen3_moe(tmp_path_factory.mktemp("moe"))
    spec = RunSpec(str(path), tp=tp, dp=dp, ep=ep, boundary_reduction=policy,
                   sequence_parallel=sp, prompts=PROMPTS, max_new_tokens=3)
    out = get_pool(spec.world_size).run(_packed_rank, spec)
    results = [r for r, _ in out]
    assert all(n > 0 for _, n in out)  # every rank ran packed matmuls (an idle one too)
    assert_logits_match(merge(results), world1(spec), len(PROMPTS))
    assert [r.modes[0] for r in results] == [mode] * len(results)
