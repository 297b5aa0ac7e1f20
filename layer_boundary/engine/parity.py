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


def verdict_ok(verdict: dict, dtype: str, run: Generation, reference: Generation,
               quantized: bool = False):
    """(PASS or not, how it was judged). Non-finite logits on either side always fail. The
    verdict's ``tolerance`` (and ``tolerance_kind``) is set to what judged it.

    Args:
        verdict: ``parity()``'s record.
        dtype: the run's dtype ("float32" or "bfloat16").
        run, reference: the run and its world-1 reference.
        quantized: the model reads FP8-quantized inputs (an FP8 checkpoint's activations).
    """
    if verdict["non_finite"]:
        return False, f"non-finite logits in the {' and the '.join(verdict['non_finite'])}"
    if dtype == "float32" and not quantized:
        verdict["tolerance_kind"] = "absolute"
        ok = verdict["tokens_match"] and verdict["max_abs_diff"] <= verdict["tolerance"]
        return ok, (f"tolerance {verdict['tolerance']:.2g} = {FP32_RELATIVE_TOLERANCE:.0e} x "
                    f"logit scale {max(1.0, verdict['logit_scale']):.3g}")
    verdict["tolerance_kind"] = "prefill_relative"  # of each request's prefill logit scale
    if dtype == "float32":
        # FP8 reads: a sum's last bit, which the reduction order sets, may round an input
        # element to the next e4m3 step; the tokens still agree, the logits move by a small
        # fraction of their scale (docs/cli.md)
        ok, worst = prefill_within_bound(run, reference, FP8_PREFILL_BOUND)
        verdict["tolerance"] = FP8_PREFILL_BOUND
        return ok and verdict["tokens_match"], (
            f"FP8 reads: tokens compared, prefill within {worst:.3g} of the logit scale, "
            f"bound {FP8_PREFILL_BOUND}")
    # bf16: greedy tokens may part at near-ties; the prefill logits are the check
    ok, worst = prefill_within_bound(run, reference, BF16_PREFILL_BOUND)
    verdict["tolerance"] = BF16_PREFILL_BOUND
    return ok, f"bf16: prefill within {worst:.3g} of the logit scale, bound {BF16_PREFILL_BOUND}"


# bf16 runs: prefill logits stay within this fraction of the reference's largest logit
# (measured: up to about 0.027 on the tiny models, multi-rank bf16 against fp32 world 1);
# greedy tokens may part at near-ties, after which decode logits are not comparable.
BF16_PREFILL_BOUND = 2.0 ** -4
# fp32 runs of an FP8 checkpoint (quantized reads): one e4m3 step on an input element moves
# the prefill logits by a small fraction of their scale (measured on the tiny Qwen3: a 1e-7
# relative change of the embedding moved them by up to 0.2%; tp 4 against world 1 by 0.02%)
FP8_PREFILL_BOUND = 2.0 ** -6


def bf16_prefill_within_bound(run: Generation, reference: Generation) -> tuple[bool, float]:
    """(whether every request's prefill logits are within the bf16 bound, the worst ratio)."""
    return prefill_within_bound(run, reference, BF16_PREFILL_BOUND)


def prefill_within_bound(run: Generation, reference: Generation,
                         bound: float) -> tuple[bool, float]:
    """(whether every request's prefill logits are within ``bound`` of its reference prefill
    logit scale, the worst ratio)."""
    worst = 0.0
    for la, lb in zip(run.logits, reference.logits):
        scale = float(lb[0].float().abs().max()) or 1.0
        ratio = float((la[0].float() - lb[0].float()).abs().max()) / scale
        if ratio != ratio or ratio == float("inf"):  # a NaN or infinite logit: never within
            return False, float("nan")
        worst = max(worst, ratio)
    return worst <= bound, worst
