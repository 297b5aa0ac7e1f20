"""Every pair of features (``capabilities.Feature``) through the command line and the library.

For each pair: a tiny checkpoint whose model runs each feature alone, the ``run`` flags that
turn both on and the ``RunSpec`` an engine would write for the same run (built by hand, not
from the flags). The command line (``spec_from_args``: every check ``run`` makes before any
rank starts), the library API (``run_rank``, which checks first) and, where the library can
see both features while it builds (a runtime's variants, backend and topology, a model's FP8
config, ``attach_lora``, ``compile_forward``), construction on a virtual topology must give
the same verdict: both accept, or both refuse with the table's message for that pair.

Every pair the table supports is shown to run: on gloo ranks against world 1, with evidence
from the ranks that both features were really on (a forward of the variant, an all-to-all in
the ledger, compiled graphs, verification forwards, a microbatch split, a layer segment, a
LoRA delta), or by the existing test named in ``COVERED``, which this module checks exists.
"""

from __future__ import annotations

import ast
import itertools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from distributed.pool import get_pool

from layer_boundary.adapters.tbo import TboPolicy
from layer_boundary.capabilities import CapabilityError, Feature, pair_rule
from layer_boundary.engine.args import UsageError, build_parser
from layer_boundary.engine.features import check_spec
from layer_boundary.engine.parity import parity
from layer_boundary.engine.run_command import spec_from_args
from layer_boundary.engine.runner import RunSpec, merge, run_rank, with_checkpoints
from layer_boundary.runtime.forward_batch import BatchVariant
from layer_boundary.runtime.ledger import LEDGER

F = Feature
PAIRS = list(itertools.combinations(Feature, 2))
TESTS = Path(__file__).resolve().parent
# prompts of several lengths; FP8 runs are compared at 1e-5 too, so these are prompts whose
# dynamic FP8 activations round alike at world 1 and on 2 ranks (a sum order can move an
# activation across a rounding boundary: tests/models/test_fp8.py says the same of its own)
PROMPTS = ((3, 1, 4, 1, 5, 9, 2), (35, 8), (9, 7, 9, 3, 2))
STEPS = 2  # a prefill and a decode step; a compiled run without a draft stops at the prefill
# (each new batch shape is a graph to trace, and the prefill already shows both features on)
# what the library can see while it builds (the rest is the driver's: run_rank sees it)
BUILT = {F.CP, F.SEQUENCE_PARALLEL, F.INPUT_SCATTERED, F.MOE_A2A, F.PIPELINE, F.LORA, F.FP8,
         F.COMPILE, F.BATCH_INVARIANT}
# supported pairs an existing test runs (with both features on, against world 1)
COVERED = {
    (F.CP, F.FUSIONS): "distributed/test_cp_models.py::test_cp_with_deferred_finalize_and_an_"
                       "empty_dp_rank",
    (F.SEQUENCE_PARALLEL, F.COMPILE): "test_compile.py::test_fullgraph_scattered_variants",
    (F.INPUT_SCATTERED, F.COMPILE): "test_compile.py::test_fullgraph_scattered_variants",
    (F.MOE_A2A, F.PIPELINE): "distributed/test_moe_a2a.py::test_all_to_all_moe_with_tbo_and_pp",
    (F.MOE_A2A, F.TBO): "distributed/test_moe_a2a.py::test_all_to_all_moe_with_tbo_and_pp",
    (F.PIPELINE, F.SPLIT_PREFILL): "distributed/test_pipeline_models.py::test_pipeline_matches_"
                                   "world1_and_transformers",
    (F.PIPELINE, F.LORA): "adapters/test_lora.py::test_every_row_mode_matches_world1",
    (F.TBO, F.LORA): "adapters/test_lora.py::test_every_row_mode_matches_world1",
    (F.SPECULATIVE, F.LORA): "adapters/test_lora.py::test_a_drafted_run_keeps_each_prompts_"
                             "adapter",
    (F.FP8, F.FUSIONS): "models/test_fp8.py::test_fused_add_norm_candidates_never_stand_in_"
                        "for_the_quantized_read",
}


def _name(pair) -> str:
    return "+".join(f.short for f in pair)


def _adapter(base: str, path: Path, targets: list[str]) -> str:
    import peft
    import transformers

    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft.get_peft_model(model, peft.LoraConfig(lora_dropout=0.0, init_lora_weights=False, r=4,
                                               lora_alpha=8, target_modules=targets)
                        ).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def dirs(qwen3_dir, qwen3_moe_dir, tmp_path_factory) -> dict[str, str]:
    """One checkpoint per model a pair needs (its FP8 copy too), a one-layer draft of their
    vocabulary, and a LoRA adapter of each (on linears the model shards)."""
    from checkpoints import hf_qwen3
    from checkpoints.ds import hf_deepseek_v3
    from checkpoints.fp8 import fp8_checkpoint

    root = tmp_path_factory.mktemp("combinations")
    out = {"qwen3": str(qwen3_dir), "qwen3_moe": str(qwen3_moe_dir),
           "deepseek_v3": str(hf_deepseek_v3(root / "deepseek_v3")),
           "draft": str(hf_qwen3(root / "draft", seed=7, num_hidden_layers=1))}
    for name in ("qwen3", "qwen3_moe", "deepseek_v3"):
        out[f"{name}_fp8"] = str(fp8_checkpoint(Path(out[name]), root / f"{name}_fp8"))
    targets = {"qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"],
               "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"], "deepseek_v3": ["o_proj"]}
    for name, modules in targets.items():
        out[f"lora_{name}"] = _adapter(out[name], root / f"lora_{name}", modules)
    return out


def case(pair, dirs) -> tuple[list[str], RunSpec]:
    """The ``run`` flags turning both features on, and the ``RunSpec`` of the same run."""
    on = set(pair)
    model = ("deepseek_v3" if F.INPUT_SCATTERED in on else "qwen3_moe" if F.MOE_A2A in on
             else "qwen3")
    path = dirs[f"{model}_fp8" if F.FP8 in on else model]
    tp, dp, cp, ep, pp = 2, 1, 1, 1, 1
    policy = "rs" if on & {F.SEQUENCE_PARALLEL, F.INPUT_SCATTERED, F.MOE_A2A} else "auto"
    kw, flags = {}, []
    if F.CP in on:
        cp, flags = 2, flags + ["--cp", "2"]
    if F.SEQUENCE_PARALLEL in on:
        kw["sequence_parallel"], flags = True, flags + ["--sequence-parallel"]
    if F.INPUT_SCATTERED in on:
        kw["attn_input_scattered"], flags = True, flags + ["--attn-input-scattered"]
    if F.MOE_A2A in on:
        ep, kw["moe_a2a_backend"] = 2, "all_to_all"
        flags += ["--ep", "2", "--moe-a2a-backend", "all_to_all"]
    if F.PIPELINE in on:
        pp, flags = 2, flags + ["--pp", "2"]
    if F.TBO in on:
        dp = 1 if cp > 1 else 2
        kw["tbo"], flags = TboPolicy.ALWAYS, flags + ["--tbo", "always"]
    if F.SPLIT_PREFILL in on:
        kw["split_prefill"], flags = 2, flags + ["--split-prefill", "2"]
    if F.COMPILE in on:
        kw["compile"], flags = "eager", flags + ["--compile-backend", "eager"]
    if F.SPECULATIVE in on:
        kw["draft_model"], kw["speculative_algorithm"] = dirs["draft"], "draft"
        flags += ["--draft-model", dirs["draft"]]
    if F.LORA in on:
        kw["lora"], kw["prompt_lora"] = (("a", dirs[f"lora_{model}"]),), ("a", "none", "a")
        flags += ["--lora", f"a={dirs[f'lora_{model}']}"]
        flags += [x for choice in kw["prompt_lora"] for x in ("--prompt-lora", choice)]
    if F.FUSIONS in on:
        kw["fusions"], flags = "reference", flags + ["--fusion-provider", "reference"]
    if F.BATCH_INVARIANT in on:
        kw["batch_invariant"], flags = True, flags + ["--batch-invariant"]
    steps = 1 if F.COMPILE in on and F.SPECULATIVE not in on else STEPS
    flags = ["run", "--model", path, "--tp", str(tp), "--dp", str(dp),
             "--boundary-reduction", policy, "--max-new-tokens", str(steps), *flags]
    flags += [x for p in PROMPTS for x in ("--prompt-ids", ",".join(map(str, p)))]
    return flags, RunSpec(path, tp=tp, dp=dp, cp=cp, ep=ep, pp=pp, boundary_reduction=policy,
                          prompts=PROMPTS, max_new_tokens=steps, **kw)


def verdict(call) -> str | None:
    """None where ``call`` accepts; the one-line message where it refuses."""
    try:
        call()
    except (CapabilityError, UsageError) as exc:
        assert "\n" not in str(exc), str(exc)
        return str(exc)
    return None


def construction_verdict(spec: RunSpec) -> str | None:
    """What the library says while it builds ``spec``'s model on a virtual topology (meta
    tensors: no weights): the runtime, the model, its adapters, its compiled form."""
    from layer_boundary.adapters.lora import attach_lora
    from layer_boundary.engine.compiled import compile_forward
    from layer_boundary.engine.runner import runtime_of
    from layer_boundary.runtime.invariant import batch_invariant
    from layer_boundary.runtime.parallel import virtual_parallel

    spec = with_checkpoints(spec)

    @batch_invariant(spec.batch_invariant)  # the mode is on while an engine builds in it
    def build():
        runtime = runtime_of(spec, virtual_parallel(spec.dims()))
        with torch.device("meta"):
            model = spec.checkpoint.model_class(spec.checkpoint.config, runtime)
        if spec.lora:
            attach_lora(model, spec.lora)
        if spec.compile:
            compile_forward(model, spec.compile, padded=False)  # lazy: nothing traced here

    return verdict(build)


@pytest.mark.parametrize("pair", PAIRS, ids=_name)
def test_the_command_line_and_the_library_agree(pair, dirs, restore_logger):
    flags, spec = case(pair, dirs)
    rule = pair_rule(*pair)
    expected = None if rule is None else rule.message()
    cli = verdict(lambda: spec_from_args(build_parser().parse_args(flags)))
    if rule is None:  # what run_rank asks first (test_each_supported_pair_runs runs it)
        library = verdict(lambda: check_spec(with_checkpoints(spec)))
    else:  # run_rank in this process: refused before any group is built (a spec of 2 or
        # more ranks would need them), any model loaded or any collective recorded
        with LEDGER.recording() as entries:
            library = verdict(lambda: run_rank(spec))
        assert not entries
    assert cli == library == expected, (cli, library)
    if set(pair) <= BUILT:
        assert construction_verdict(spec) == expected
    else:  # the driver's feature: construction cannot see it, run_rank refused it above
        assert construction_verdict(spec) is None


def _on(feature: Feature, results, spec: RunSpec, base) -> bool:
    """Whether the ranks' results show ``feature`` was really on (``base``: world 1 without
    the adapters, for LoRA)."""
    calls = [c for r in results for c in r.calls]
    if feature in (F.CP, F.SEQUENCE_PARALLEL, F.INPUT_SCATTERED):
        variant = {F.CP: BatchVariant.CP, F.SEQUENCE_PARALLEL: BatchVariant.SEQUENCE_PARALLEL,
                   F.INPUT_SCATTERED: BatchVariant.INPUT_SCATTERED}[feature]
        return any(c.variant is variant for c in calls)
    if feature is F.MOE_A2A:
        return any(e.kind.startswith("all_to_all") for r in results for e in r.ledger)
    if feature is F.PIPELINE:
        return {r.pp_rank for r in results} == {0, 1} and all(r.layers for r in results)
    if feature is F.TBO:
        return any(c.tbo for c in calls)
    if feature is F.SPLIT_PREFILL:
        return any(c.segment is not None for c in calls)
    if feature is F.COMPILE:
        return all(r.compiled_graphs > 0 for r in results)
    if feature is F.SPECULATIVE:
        return all(r.speculative["target_forwards"] > 0 for r in results)
    if feature is F.LORA:
        run = merge(results)
        return max(float((a - b).abs().max()) for la, lb in zip(run.logits, base.logits)
                   for a, b in zip(la, lb)) > 1e-3
    if feature is F.FP8:  # the quantized read is the checkpoint's (its weight blocks)
        from layer_boundary.models import load_config

        return load_config(spec.model_dir).fp8_block is not None
    if feature is F.FUSIONS:  # a provider fuses only where a path offers a candidate
        return spec.fusions is not None
    if feature is F.BATCH_INVARIANT:  # each prompt alone, the same bits as in the batch
        from layer_boundary.engine.report import invariance_check

        check = invariance_check(merge(results), results)
        return check["ok"] and check["prompts"] == len(spec.prompts)
    raise AssertionError(feature)


def _world1(spec: RunSpec, **changes):
    return merge([run_rank(replace(spec, tp=1, dp=1, ep=1, cp=1, pp=1, split_prefill=1,
                                   tbo=TboPolicy.OFF, compile=None, draft_model=None,
                                   speculative_algorithm=None, sequence_parallel=False,
                                   attn_input_scattered=False, moe_a2a_backend="none",
                                   fusions=None, boundary_reduction="ar", **changes),
                           world_size=1)])


RUN = [p for p in PAIRS if pair_rule(*p) is None and p not in COVERED]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("pair", RUN, ids=_name)
def test_each_supported_pair_runs(pair, dirs):
    _, spec = case(pair, dirs)
    results = get_pool(spec.world_size).run(run_rank, spec, timeout=200)
    verdict_ = parity(merge(results), _world1(spec))
    assert verdict_["tokens_match"] and verdict_["max_abs_diff"] <= verdict_["tolerance"], \
        verdict_
    base = _world1(spec, lora=(), prompt_lora=()) if F.LORA in pair else None
    for feature in pair:
        assert _on(feature, results, spec, base), f"{feature.short} was not on"


def test_every_supported_pair_is_run_here_or_by_the_test_it_names():
    supported = {p for p in PAIRS if pair_rule(*p) is None}
    assert supported == set(RUN) | set(COVERED) and not set(RUN) & set(COVERED)
    assert all(pair_rule(*p) is None for p in COVERED)
    for pair, where in COVERED.items():
        file, test = where.split("::")
        names = {node.name for node in ast.walk(ast.parse((TESTS / file).read_text()))
                 if isinstance(node, ast.FunctionDef)}
        assert test in names, f"{_name(pair)}: {where} does not exist"
