"""qkv_latent_func: in an input-scattered batch an attention's latent projection runs on the
read's rows before any gather, so under a scattered residual only the (narrower) latent
crosses ranks; in an ordinary batch the normalized input is gathered and the latent runs on
the compute rows. Both give the same latent."""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, ToyLayer, batch, runtime

from layer_boundary import declare_attn, declare_ffn, make_stages
from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime import BatchVariant
from layer_boundary.runtime.ledger import LEDGER

LATENT = 3
W = torch.randn(HIDDEN, LATENT, generator=torch.Generator().manual_seed(4))


def latent(x):
    return x @ W


def run(tp: int, policy: str, variant: str = "ordinary") -> dict:
    variant = BatchVariant(variant)
    rt = runtime(tp, boundary_reduction=policy,
                 batch_variants=(BatchVariant.ORDINARY, BatchVariant.INPUT_SCATTERED))
    first = ToyLayer(rt, 0, 2)
    attn, _ = make_stages((declare_attn(), first.attn_norm, {"qkv_latent_func": latent}),
                          (declare_ffn(), first.ffn_norm), previous=declare_ffn(),
                          runtime=rt, name="layer1")
    fb = batch(5)
    fb.variant = variant
    residual_batch.start(fb)
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(8))
    h = first.forward_layer(h, fb)
    with LEDGER.recording() as ledger:
        got = attn.prepare(h, fb)
    return {"latent": got, "mode": fb.rows.mode.value,
            "gathers": [(e.group, e.numel) for e in ledger if e.kind == "all_gather"]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", ["ordinary", "input-scattered"])
@pytest.mark.parametrize("policy", ["ar", "rs"])
def test_the_latent_moves_in_an_input_scattered_batch(policy, variant):
    ref = run(1, "ar")["latent"]
    assert ref.shape == (5, LATENT)
    for r in get_pool(2).run(run, 2, policy, variant):
        torch.testing.assert_close(r["latent"], ref, atol=1e-5, rtol=0)
        if policy == "rs":  # 5 rows padded to 6, 3 per rank: the latent, or the input, moves
            width = LATENT if variant == "input-scattered" else HIDDEN
            assert r["mode"] == "rs" and r["gathers"] == [("attn_tp", 6 * width)]
        else:  # attention's rows are the residual's: nothing to gather either way
            assert r["gathers"] == []
