"""The parity verdict of a run against its world-1 reference: tokens, the largest logit
difference against a tolerance scaled by the reference's logits (fp32), or the prefill bound
(bf16)."""

from __future__ import annotations

import torch

from .generate import Generation


# fp32 parity: logits within this much per unit of the reference's logit scale (the largest
# |logit|, at least 1): summation order alone moves a logit by a few ulps of the sums behind
# it, which grow with the scale, so a fixed absolute bound would fail legitimate large-logit
# checkpoints; a real divergence (a wrong shard, a missing sum) moves logits by a fraction of
# the scale itself, orders of magnitude above this
FP32_RELATIVE_TOLERANCE = 1e-5


def _all_finite(gen: Generation) -> bool:
    return all(bool(torch.isfinite(x).all()) for steps in gen.logits for x in steps)


def parity(run: Generation, reference: Generation) -> dict:
    """Tokens, the largest logit difference (NaN if any logit is not finite), which side has
    non-finite logits, the reference's logit scale and the fp32 tolerance it implies."""
    finite = {"run": _all_finite(run), "reference": _all_finite(reference)}
    diffs = [float((a.float() - b.float()).abs().max())
             for la, lb in zip(run.logits, reference.logits) for a, b in zip(la, lb)]
    scale = max((float(x.float().abs().max()) for steps in reference.logits for x in steps
                 if x.numel() and bool(torch.isfinite(x).all())), default=0.0)
    worst = float("nan") if not all(finite.values()) else max(diffs, default=0.0)
    return {"tokens_match": run.generated == reference.generated, "max_abs_diff": worst,
            "non_finite": [side for side, ok in finite.items() if not ok],
            "logit_scale": scale,
            "tolerance": FP32_RELATIVE_TOLERANCE * max(1.0, scale)}


def verdict_ok(verdict: dict, dtype: str, run: Generation, reference: Generation):
    """(PASS or not, how it was judged). Non-finite logits on either side always fail."""
    if verdict["non_finite"]:
        return False, f"non-finite logits in the {' and the '.join(verdict['non_finite'])}"
    if dtype == "float32":
        ok = verdict["tokens_match"] and verdict["max_abs_diff"] <= verdict["tolerance"]
        return ok, (f"tolerance {verdict['tolerance']:.2g} = {FP32_RELATIVE_TOLERANCE:.0e} x "
                    f"logit scale {max(1.0, verdict['logit_scale']):.3g}")
    # bf16: greedy tokens may part at near-ties; the prefill logits are the check
    ok, worst = bf16_prefill_within_bound(run, reference)
    return ok, f"bf16: prefill within {worst:.3g} of the logit scale, bound {BF16_PREFILL_BOUND}"


# bf16 runs: prefill logits stay within this fraction of the reference's largest logit
# (measured: up to about 0.027 on the tiny models, multi-rank bf16 against fp32 world 1);
# greedy tokens may part at near-ties, after which decode logits are not comparable.
BF16_PREFILL_BOUND = 2.0 ** -4


def bf16_prefill_within_bound(run: Generation, reference: Generation) -> tuple[bool, float]:
    """(whether every request's prefill logits are within the bf16 bound, the worst ratio)."""
    worst = 0.0
    for la, lb in zip(run.logits, reference.logits):
        scale = float(lb[0].float().abs().max()) or 1.0
        ratio = float((la[0].float() - lb[0].float()).abs().max()) / scale
        if ratio != ratio or ratio == float("inf"):  # a NaN or infinite logit: never within
            return False, float("nan")
        worst = max(worst, ratio)
    return worst <= BF16_PREFILL_BOUND, worst
