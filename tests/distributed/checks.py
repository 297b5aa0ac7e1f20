"""Assertions and references the multi-rank model tests share."""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import replace

from layer_boundary.adapters.tbo import TboPolicy
from layer_boundary.engine.runner import RunSpec, merge, run_rank

from .pool import get_pool


@functools.cache
def world1(spec: RunSpec):
    """The same requests on one rank: no TP, DP, EP, pipeline or fusion provider (cached per
    spec, so the cases of a module share it)."""
    return merge([run_rank(replace(spec, tp=1, dp=1, ep=1, cp=1, pp=1, pp_layers=None,
                                   split_prefill=1, tbo=TboPolicy.OFF, draft_model=None,
                                   speculative_algorithm=None, boundary_reduction="ar",
                                   fusions=None),
                           world_size=1)])


def cli(args, capsys) -> tuple[int, str]:
    """``layer-boundary`` in this process: its exit code and what rank 0 printed (the
    logger's handlers restored afterwards). What it wrote to stderr goes back to stderr, so
    a failing test shows it."""
    import sys

    from layer_boundary.engine.cli import main

    with package_logger_kept():
        code = main(args)
    captured = capsys.readouterr()
    sys.stderr.write(captured.err)
    return code, captured.out


def cli_ok(args, capsys) -> str:
    """``layer-boundary`` in this process, which must succeed; returns what it printed. A
    failure shows the command, its exit code and everything it wrote."""
    from layer_boundary.engine.cli import main

    code = main(list(args))
    captured = capsys.readouterr()
    assert code == 0, (f"layer-boundary {' '.join(map(str, args))} exited {code}:\n"
                       f"{captured.out}{captured.err}")
    return captured.out


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
    in its own compute, in the next attention's prepare, or (last layer) in the final norm
    (``final_norm.fused``: the terminal service's)."""
    owner = {f"layer{i}.ffn.compute": i for i in range(layers)}
    owner.update({f"layer{i + 1}.attn.prepare": i for i in range(layers - 1)})
    owner["final_norm"] = owner["final_norm.fused"] = layers - 1  # unfused, or the service's
    out = {i: [] for i in range(layers)}
    for e in ledger:
        if (e.step == step and e.group == "tp" and e.kind in ("all_reduce", "reduce_scatter")
                and e.site in owner):
            out[owner[e.site]].append((e.kind, e.site))
    return out


def run_matching_world1(spec: RunSpec, mode: str) -> list:
    """``spec`` on its ranks: every request's logits and tokens as world 1's, the first
    forward in row ``mode``, every stream released; with more DP ranks than requests, the idle
    ranks hold none (yet ran every collective). Returns the rank results."""
    results = get_pool(spec.world_size).run(run_rank, spec)
    n = len(spec.prompts)
    assert_logits_match(merge(results), world1(spec), n)
    for r in results:
        assert r.modes[0] == mode, (r.rank, r.modes)
        assert r.streams_released
        if r.dp_rank >= n:
            assert r.generation.request_ids == [], r.rank
    return results


ONE_SUM_A_LAYER = [("all_reduce", "embed"), ("all_reduce", "layer1.attn.prepare"),
                   ("all_reduce", "layer2.attn.prepare"), ("all_reduce", "final_norm")]


def assert_one_all_reduce_a_layer(spec: RunSpec) -> None:
    """A 3-layer parallel-block model (Cohere, GPT-NeoX) at tp 2 under ar matches world 1,
    and its prefill runs one all-reduce a layer (each attention's partial joins its MLP's
    sum; the next layer's input or the final norm completes both) plus the embedding's."""
    results = run_matching_world1(spec, "ar")
    sums = [(e.kind, e.site) for e in results[0].ledger if e.step == 0
            and e.kind in ("all_reduce", "reduce_scatter")]
    assert sums == ONE_SUM_A_LAYER, sums


@contextlib.contextmanager
def package_logger_kept():
    """``main()`` points the package logger at the current stdout; put its handlers,
    propagation and level back afterwards, so later tests do not inherit them."""
    log = logging.getLogger("layer_boundary")
    saved = log.handlers[:], log.propagate, log.level
    try:
        yield
    finally:
        log.handlers[:], log.propagate = saved[0], saved[1]
        log.setLevel(saved[2])


A2A = {"moe_a2a_backend": "all_to_all"}
# (tp, attn_dp, moe_ep, policy, other RunSpec fields, the prefill's row mode): what a MoE
# model's parallel test covers at least (TP experts, EP 2, EP 4 with attention DP 2, the
# all-to-all MoE, CP 2, PP 2)
MOE_TOPOLOGIES = [
    (2, 1, 1, "ar", {}, "ar"),
    (2, 1, 2, "rs", {}, "rs"),
    (4, 2, 4, "rsv", {}, "rsv"),
    (4, 2, 4, "rsv", A2A, "rsv"),
    (2, 1, 1, "ar", {"cp": 2}, "ar"),
    (1, 1, 1, "ar", {"pp": 2}, "ar"),
]


def topology_id(case) -> str:
    """A test id for a ``MOE_TOPOLOGIES`` entry."""
    tp, dp, ep, policy, options, _ = case
    return f"tp{tp}-dp{dp}-ep{ep}-{policy}" + "".join(f"-{k}" for k in options)


def run_moe_topology(path, case, prompts, steps: int) -> list:
    """``run_matching_world1`` on a ``MOE_TOPOLOGIES``-shaped case; under the all-to-all MoE
    every rank's ledger holds its dispatches. Returns the rank results."""
    tp, dp, ep, policy, options, mode = case
    results = run_matching_world1(RunSpec(str(path), tp=tp, dp=dp, ep=ep,
                                          boundary_reduction=policy, prompts=prompts,
                                          max_new_tokens=steps, **options), mode)
    if options.get("moe_a2a_backend") == "all_to_all":
        assert all(any(e.kind == "all_to_all" for e in r.ledger) for r in results)
    return results
