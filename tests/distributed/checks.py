"""Assertions the multi-rank model tests share."""

from __future__ import annotations


def assert_logits_match(run, ref, n_requests: int, tol: float = 1e-5) -> None:
    """Every request's logits at every step within ``tol`` of the world-1 run; same tokens."""
    assert run.request_ids == list(range(n_requests))
    for j in range(n_requests):
        for step, (a, b) in enumerate(zip(run.logits[j], ref.logits[j])):
            diff = (a - b).abs().max().item()
            phase = "prefill" if step == 0 else f"decode {step}"
            assert diff <= tol, f"request {j} {phase}: max abs diff {diff}"
    assert run.generated == ref.generated


def sums_of_ffn_outputs(ledger, layers: int, step: int) -> dict[int, list]:
    """TP-group sums (all-reduce or reduce-scatter) of each layer's FFN output, by layer:
    in its own compute, in the next attention's prepare, or (last layer) in the final norm."""
    owner = {f"layer{i}.ffn.compute": i for i in range(layers)}
    owner.update({f"layer{i + 1}.attn.prepare": i for i in range(layers - 1)})
    owner["final_norm"] = layers - 1
    out = {i: [] for i in range(layers)}
    for e in ledger:
        if (e.step == step and e.group == "tp" and e.kind in ("all_reduce", "reduce_scatter")
                and e.site in owner):
            out[owner[e.site]].append((e.kind, e.site))
    return out
