"""A run's verdict: each check it made (parity against world 1, batch invariance, the
exactly-once audit, required fusions) and the one verdict they give, which the text report,
``--json`` and the exit status all say."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Status(str, enum.Enum):
    """What one check of a run found (its JSON value is the word)."""

    PASS = "PASS"
    FAIL = "FAIL"
    NOT_CHECKED = "NOT_CHECKED"


@dataclass(frozen=True)
class Check:
    """One thing a run compared or counted: its name as the report says it, what it found,
    and why (what was compared, what differed, or why nothing was)."""

    name: str
    status: Status
    reason: str

    def record(self) -> dict:
        return {"name": self.name, "verdict": self.status.value, "reason": self.reason}


# the checks that compare the run's numbers with another run's (the audit and the fusion
# requirement count what ran; alone they prove no number)
COMPARISONS = ("parity", "batch invariance")


def overall(checks: list[Check]) -> Status:
    """The run's one verdict: FAIL where any check failed, PASS where a comparison passed and
    nothing failed, else NOT_CHECKED (nothing compared). The exit status follows it."""
    if any(c.status is Status.FAIL for c in checks):
        return Status.FAIL
    if any(c.status is Status.PASS and c.name in COMPARISONS for c in checks):
        return Status.PASS
    return Status.NOT_CHECKED


def verdict_line(checks: list[Check]) -> str:
    """The text report's last word on the checks: ``verdict: FAIL (failed: batch invariance;
    passed: parity, exactly once)``."""
    groups = [(word, [c.name for c in checks if c.status is status])
              for word, status in (("failed", Status.FAIL), ("passed", Status.PASS),
                                   ("not checked", Status.NOT_CHECKED))]
    return (f"verdict: {overall(checks).value} ("
            + "; ".join(f"{word}: {', '.join(names)}" for word, names in groups if names) + ")")


def overall_reason(checks: list[Check]) -> str:
    """Each check's finding, the failed ones first, then the others in the run's order:
    ``parity PASS: tokens match, ...; exactly once PASS: ...``."""
    return "; ".join(f"{c.name} {c.status.value}: {c.reason}"
                     for c in sorted(checks, key=lambda c: c.status is not Status.FAIL))


@dataclass
class Outcome:
    """What the report says of a run, judged once: the merged generation, the parity verdict
    against the reference (None: not checked) and how it was judged, the batch-invariance
    check, the exactly-once audit, each check's finding, and the one verdict they give."""

    run: object
    verdict: dict | None
    how: str
    invariance: dict | None
    audited: dict
    checks: list

    @property
    def status(self) -> Status:
        return overall(self.checks)

    @property
    def ok(self) -> bool:
        return self.status is not Status.FAIL

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)


def reads_quantized(spec) -> bool:
    """Whether ``spec``'s model reads FP8-quantized inputs (an FP8 checkpoint)."""
    checkpoint = spec.checkpoint
    return checkpoint is not None and getattr(checkpoint.config, "fp8_block", None) is not None


def judge(spec, results, reference, why_unchecked: str = "no reference run",
          require_fusions: bool = False) -> Outcome:
    """Every check of the run, judged once.

    Args:
        spec: the run.
        results: every rank's ``RankResult``.
        reference: the world-1 run (None: parity not checked).
        why_unchecked: why there is no reference (said where parity is not checked).
        require_fusions: ``--require-fusions``: a declined or absent fusion fails the run.
    """
    from .parity import parity, verdict_ok
    from .runner import merge

    run = merge(results)
    verdict = parity(run, reference) if reference is not None else None
    if verdict is None:
        checks = [Check("parity", Status.NOT_CHECKED, f"{why_unchecked}: nothing compared")]
        how = ""
    else:
        parity_ok, how = verdict_ok(verdict, spec.dtype, run, reference,
                                    quantized=reads_quantized(spec))
        checks = [Check("parity", Status.PASS if parity_ok else Status.FAIL,
                        f"tokens {'match' if verdict['tokens_match'] else 'differ'}, max "
                        f"|logit diff| {verdict['max_abs_diff']:.3g}, {how}")]
    invariance = invariance_check(run, results) if spec.batch_invariant else None
    if invariance is not None:
        checks.append(Check("batch invariance", Status.PASS if invariance["ok"] else
                            Status.FAIL, invariance_reason(invariance)))
    audited = audit_summary(results)
    checks.append(Check("exactly once", Status.NOT_CHECKED if not audited["audited"] else
                        Status.FAIL if audited["violations"] else Status.PASS,
                        audit_reason(audited)))
    if require_fusions:
        problem = required_problem(results)
        checks.append(Check("required fusions", Status.FAIL if problem else Status.PASS,
                            problem or "every stage asked applied its candidates, none "
                                       "declined"))
    return Outcome(run, verdict, how, invariance, audited, checks)


def audit_summary(results) -> dict:
    """The exactly-once audit over every rank (``engine.audit``): ``audited`` (False with
    ``why`` where the run's forwards are not audited) and each violation, by rank."""
    why = results[0].unaudited
    if why is not None:
        return {"audited": False, "why": why, "violations": []}
    return {"audited": True, "ranks": len(results),
            "violations": [f"rank {r.rank}: {v}" for r in results for v in r.audit]}


def audit_reason(audited: dict) -> str:
    if not audited["audited"]:
        return f"not audited: {audited['why']}"
    if not audited["violations"]:
        return ("every declared contribution summed once, over its declared group, on each "
                f"of {audited['ranks']} ranks")
    return "; ".join(audited["violations"][:6]) + (
        f"; {len(audited['violations']) - 6} more" if len(audited["violations"]) > 6 else "")


def audit_line(audited: dict) -> str:
    if not audited["audited"]:
        return f"exactly once: not audited ({audited['why']})"
    return (f"exactly once: {'FAIL' if audited['violations'] else 'PASS'} "
            f"({audit_reason(audited)})")


def invariance_check(run, results) -> dict:
    """``--batch-invariant``: each prompt generated alone against its request in the batch
    (``run``, merged): the same tokens and the same logits, bit for bit, at every step."""
    alone = next(r.alone for r in results if r.alone is not None)
    differences, steps = [], 0
    for i, lone in enumerate(alone):
        batched = run.logits[run.request_ids.index(i)]
        steps = max(steps, len(batched))
        for j, (a, b) in enumerate(zip(lone.logits[0], batched)):
            if not torch_equal(a, b):
                differences.append(f"prompt {i} step {j}: max |logit diff| "
                                   f"{(a.float() - b.float()).abs().max().item():.3g}")
        if lone.generated[0] != run.generated[run.request_ids.index(i)]:
            differences.append(f"prompt {i}: tokens {lone.generated[0]} alone, "
                               f"{run.generated[run.request_ids.index(i)]} in the batch")
    return {"ok": not differences, "prompts": len(alone), "steps": steps,
            "differences": differences}


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


def invariance_reason(invariance: dict) -> str:
    if invariance["ok"]:
        return (f"each of {invariance['prompts']} prompts alone against the batch, "
                f"{invariance['steps']} steps: the same logits bit for bit")
    return "; ".join(invariance["differences"][:8]) + (
        f"; {len(invariance['differences']) - 8} more" if len(invariance["differences"]) > 8
        else "")


def invariance_line(invariance: dict) -> str:
    return (f"batch invariance: {'PASS' if invariance['ok'] else 'FAIL'} "
            f"({invariance_reason(invariance)})")


def required_declines(results) -> list[str]:
    """Every (rank, stage) where a candidate declined, in words (``--require-fusions``)."""
    out = []
    for r in results:
        for stage, outcome in r.fusion_outcomes.items():
            for why, n in outcome["declined"].items():
                out.append(f"rank {r.rank} {stage} declined {n}x: {why}")
    return out


def required_problem(results) -> str | None:
    """What fails ``--require-fusions`` on ``results``: each (rank, stage) where a candidate
    declined, or that no stage applied one; None where every stage asked applied its
    candidates."""
    declines = required_declines(results)
    if declines:
        return "a fusion candidate declined: " + "; ".join(declines)
    if not any(outcome["applied"] for r in results for outcome in r.fusion_outcomes.values()):
        # nothing declined because nothing was offered, or asked: nothing was fused either
        return ("no stage applied a fusion candidate (none was offered, or none asked: the "
                "model's boundaries leave the provider nothing to complete), so nothing was "
                "fused")
    return None
