"""Batch invariance: with ``--batch-invariant`` a request's logits are the same bits alone as
in the batch, prefill and decode, on each layout's row mode (world 1, tp 2, tp 4 with
attention DP 2 under ``rsv`` and a DP rank left empty when a prompt runs alone); without the
mode they are not, so the check means something."""

from __future__ import annotations

import json
import re

import pytest
import torch
from checkpoints import hf_qwen3
from distributed.checks import cli

from layer_boundary.capabilities import CapabilityError, Feature, pair_rule
from layer_boundary.engine import runner
from layer_boundary.engine.report import invariance_check
from layer_boundary.engine.runner import RunSpec, merge, run_rank
from layer_boundary.models.registry import model_class, model_types
from layer_boundary.runtime import invariant

pytestmark = pytest.mark.usefixtures("restore_logger")

PROMPTS = ["--prompt-ids", "5,9,2,7,1", "--prompt-ids", "3,8", "--prompt-ids", "6,4,4"]


@pytest.mark.parametrize("layout", [["--tp", "1"], ["--tp", "2"],
                                    ["--tp", "4", "--dp", "2", "--boundary-reduction", "rsv"]],
                         ids=["world1", "tp2", "tp4-dp2-rsv"])
def test_run_batch_invariant_passes_its_own_check(layout, capsys):
    code, out = cli(["run", *layout, "--batch-invariant", "--max-new-tokens", "3", "--json",
                     *PROMPTS], capsys)
    report = json.loads(out)
    assert code == 0, report
    assert report["batch_invariance"] == {"ok": True, "prompts": 3, "steps": 3,
                                          "differences": []}


def test_without_the_mode_a_batch_changes_the_bits(qwen3_dir, monkeypatch):
    """The same comparison with the mode left off: the batch's products (several rows in one
    GEMM, grouped attention) give other last bits than a request alone."""
    spec = RunSpec(str(qwen3_dir), prompts=((5, 9, 2, 7, 1), (3, 8), (6, 4, 4)),
                   max_new_tokens=3, batch_invariant=True)
    monkeypatch.setattr(runner, "batch_invariant", lambda on: invariant.batch_invariant(False))
    result = run_rank(spec)
    check = invariance_check(merge([result]), [result])
    assert not check["ok"] and check["differences"]


def test_in_the_mode_a_product_is_each_rows_own():
    """Whoever calls it (F.linear, @, addmm, an einsum's bmm), a matrix product in the mode
    gives each row the bits of its one-row product; off the mode, the one call."""
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(9, 64, generator=gen), torch.randn(48, 64, generator=gen),
               torch.randn(48, generator=gen))
    heads = torch.randn(9, 4, 64, generator=gen)
    per_head = torch.randn(4, 64, 24, generator=gen)
    with invariant.batch_invariant():
        out, plain = torch.nn.functional.linear(x, w, b), x @ w.T
        mixed = torch.einsum("thn,hnr->thr", heads, per_head)
        for i in range(9):
            assert torch.equal(out[i:i + 1], torch.nn.functional.linear(x[i:i + 1], w, b))
            assert torch.equal(plain[i:i + 1], x[i:i + 1] @ w.T)
            assert torch.equal(mixed[i:i + 1],
                               torch.einsum("thn,hnr->thr", heads[i:i + 1], per_head))
        assert torch.equal(torch.nn.functional.linear(x[2:5], w, b), out[2:5])
        with invariant.batch_invariant(False):  # nested off: the ops pass through
            assert torch.equal(x @ w.T, torch.mm(x, w.T))
    assert torch.equal(torch.nn.functional.linear(x, w, b), torch.addmm(b, x, w.T))


def test_in_the_mode_an_activation_is_each_rows_own():
    """An elementwise activation over a contiguous batch runs as one flat loop, vectorized
    but for a scalar tail: a row of width 40 sits in the tail alone and in the vectorized
    body in a batch. In the mode each row gets the bits it gets alone."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(15, 40, generator=gen)
    silu = torch.nn.functional.silu
    with invariant.batch_invariant():
        out = silu(x)
        assert torch.equal(out[:5], silu(x[:5].clone()))
        for i in range(15):
            assert torch.equal(out[i:i + 1], silu(x[i:i + 1]))
        assert torch.equal(silu(x.view(3, 5, 40)), out.view(3, 5, 40))
        in_place = x.clone()
        silu(in_place, inplace=True)  # an in-place op too, its rows written back
        assert torch.equal(in_place, out)
        assert torch.sigmoid(x[:0]).shape == (0, 40)  # an empty DP rank
    # the comparison means something: off the mode some row takes other bits in the batch
    batched = silu(x)
    assert any(not torch.equal(batched[i:i + 1], silu(x[i:i + 1])) for i in range(15))


def test_in_the_mode_a_router_is_each_rows_own():
    """A router's product, sigmoid, top-k and last-dimension sums a row at a time in the
    mode, each output of its own shape; a sum over the tokens themselves stays whole."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 64, generator=gen), torch.randn(8, 64, generator=gen)

    def router(rows):
        scores = torch.nn.functional.linear(rows, w).sigmoid()
        weights, ids = torch.topk(scores, 2, dim=-1)
        return weights / weights.sum(-1, keepdim=True), ids, scores.softmax(-1)

    with invariant.batch_invariant():
        batched = router(x)
        for i in range(7):
            for got, alone in zip(batched, router(x[i:i + 1])):
                assert torch.equal(got[i:i + 1], alone)
        assert router(x[:0])[0].shape == (0, 2)
        assert torch.equal(x.sum(0), torch.ops.aten.sum.dim_IntList(x, [0]))


# the gated MLP's activation followed the batch wherever the intermediate width a rank holds
# is not a multiple of the CPU loop's step (32 floats on AVX-512): tp 2 of the tests' Qwen3
# (96 / 2 = 48), or 40 at world 1; the mode runs it a row at a time
def test_an_intermediate_width_off_the_vector_step_stays_invariant(tmp_path):
    model = hf_qwen3(tmp_path / "qwen3", intermediate_size=40)
    spec = RunSpec(str(model), prompts=((5, 9, 2, 7, 1), (3, 8), (6, 4, 4)),
                   max_new_tokens=2, batch_invariant=True)
    result = run_rank(spec)
    check = invariance_check(merge([result]), [result])
    assert check["ok"], check["differences"]


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    from checkpoints.ds import hf_deepseek_v3
    from checkpoints.glm4_moe import hf_glm4_moe
    from checkpoints.gpt_oss import hf_gpt_oss
    from checkpoints.lc import hf_longcat_flash
    from checkpoints.nh import hf_nemotron_h
    from checkpoints.qwen3_next import hf_qwen3_next

    root = tmp_path_factory.mktemp("invariant_models")
    return {"nemotron_h": hf_nemotron_h(root / "nh"), "gpt_oss": hf_gpt_oss(root / "gpt_oss"),
            "glm4_moe": hf_glm4_moe(root / "glm4_moe"),
            "deepseek_v3": hf_deepseek_v3(root / "ds3"),
            "qwen3_next": hf_qwen3_next(root / "qnext"),
            "longcat_flash": hf_longcat_flash(root / "lc")}


# what followed the batch (1e-6 logits apart): Nemotron-H's Mamba2 in_proj (a plain GEMM),
# its softplus over [T, heads] (8 wide, off the vector step), its router (product, sigmoid
# over [T, 8], top-k); GPT-OSS's router (a decode batch's GEMM against a lone request's
# matrix-vector product) and its experts' sigmoid (16 wide at tp 2); GLM-4-MoE's DeepSeek
# router at decode; DeepSeek-V3's absorbed MLA projections (einsums over [T, heads], a bmm
# whose blocking follows T); Qwen3-Next's shared-expert gate (a plain [T, 1] product and
# sigmoid) and its DeltaNet's beta sigmoid ([T, Hv], off the vector step); LongCat's router
# (world 1: test_every_architecture_that_declares_it_passes_its_own_check)
@pytest.mark.parametrize("layout", [["--tp", "2"]], ids=["tp2"])
@pytest.mark.parametrize("model", ["nemotron_h", "gpt_oss", "glm4_moe", "deepseek_v3",
                                   "qwen3_next", "longcat_flash"])
def test_hybrid_and_sink_moe_models_pass_their_own_check(model, layout, hybrid_dirs, capsys):
    code, out = cli(["run", "--model", str(hybrid_dirs[model]), *layout, "--batch-invariant",
                     "--max-new-tokens", "2", "--json", *PROMPTS], capsys)
    report = json.loads(out)
    assert report["batch_invariance"]["ok"], report["batch_invariance"]
    assert code == 0, report


def test_the_tests_qwen3_at_tp2_passes_its_own_check(qwen3_dir, capsys):
    """The hostile probe: ``run --model <the tests' Qwen3> --tp 2 --batch-invariant``."""
    code, out = cli(["run", "--model", str(qwen3_dir), "--tp", "2", "--batch-invariant",
                     "--max-new-tokens", "2", "--json"], capsys)
    report = json.loads(out)
    assert report["batch_invariance"]["ok"], report["batch_invariance"]
    assert code == 0 and report["verdict"] == "PASS", report


def test_a_failed_invariance_check_leaves_the_parity_line_its_own_verdict(monkeypatch, capsys):
    """The run fails (exit 1) on the invariance check alone; the parity line says what the
    parity comparison found (PASS, within its tolerance), not the run's overall outcome."""
    from layer_boundary.engine import verdict

    monkeypatch.setattr(verdict, "invariance_check", lambda run, results: {
        "ok": False, "prompts": 1, "steps": 1, "differences": ["prompt 0 step 0: made up"]})
    code, out = cli(["run", "--tp", "2", "--batch-invariant", "--max-new-tokens", "1",
                     "--prompt-ids", "5,9,2", "--prompt-ids", "3,8"], capsys)
    assert code == 1
    assert "batch invariance: FAIL (prompt 0 step 0: made up)" in out
    assert "parity vs world 1: PASS (tokens match" in out
    assert "verdict: FAIL (failed: batch invariance; passed: parity, exactly once)" in out


@pytest.mark.parametrize("extra,feature", [
    (["--tbo"], Feature.TBO), (["--compile", "--compile-backend", "eager"], Feature.COMPILE),
    (["--speculative-algorithm", "draft", "--draft-model", "{model}"], Feature.SPECULATIVE)],
    ids=["tbo", "compile", "draft"])
def test_what_does_not_combine_is_refused_by_name(extra, feature, qwen3_dir, capsys):
    """The table's pair (capabilities.PAIRS), as the command line gives it."""
    extra = [arg.format(model=qwen3_dir) for arg in extra]
    code, _ = cli(["run", "--model", str(qwen3_dir), "--tp", "1", "--batch-invariant", *extra],
                  capsys)
    assert code == 2
    message = pair_rule(feature, Feature.BATCH_INVARIANT).message()
    assert "--batch-invariant" in message and feature.flag in message
    assert capsys.readouterr().err == f"layer-boundary: error: {message}\n"


# every registered architecture's test checkpoint, with widths off the CPU loop's 32-float
# step where its config has them (an activation's scalar tail then follows the batch: GELU
# with tanh, silu, sigmoid, softplus), the vocabulary too; a sliding-window ring (Mistral,
# DeepSeek-V4) beyond every cache here: its ring is the cache, of the batch's longest prompt
ODD = dict(intermediate_size=40, vocab_size=100)
ODD_MOE = dict(ODD, moe_intermediate_size=20)


def _builders() -> dict:
    """model_type -> (writer, its overrides). The nested Qwen3.5 types are their text
    classes' subclasses under another name prefix: their text checkpoint stands for them."""
    from checkpoints import hf_qwen3_moe
    from checkpoints.cohere import hf_cohere, hf_cohere2
    from checkpoints.deepseek_v2 import hf_deepseek_v2
    from checkpoints.ds import hf_deepseek_v3
    from checkpoints.ds4 import hf_deepseek_v4
    from checkpoints.exaone4 import hf_exaone4
    from checkpoints.gemma3 import hf_gemma3
    from checkpoints.glm4_moe import hf_glm4_moe
    from checkpoints.gpt_neox import hf_neox
    from checkpoints.gpt_oss import hf_gpt_oss
    from checkpoints.granite import hf_granite, hf_granitemoe
    from checkpoints.inkling import hf_inkling
    from checkpoints.lc import hf_longcat_flash
    from checkpoints.llama import hf_llama, hf_mistral
    from checkpoints.mixtral import hf_minimax_m2, hf_mixtral
    from checkpoints.nh import hf_nemotron_h
    from checkpoints.olmo import hf_olmo2, hf_olmo3
    from checkpoints.phi3 import hf_phi3
    from checkpoints.qwen3_next import hf_qwen3_next

    def qwen3_5(arch):
        return lambda path, **kw: hf_qwen3_next(path, arch, **kw)

    dense_35, moe_35 = (qwen3_5("qwen3_5"), ODD), (qwen3_5("qwen3_5_moe"),
                                                    dict(ODD_MOE, intermediate_size=None))
    return {"cohere": (hf_cohere, ODD), "cohere2": (hf_cohere2, ODD),
            "deepseek_v2": (hf_deepseek_v2, ODD_MOE), "deepseek_v3": (hf_deepseek_v3, ODD_MOE),
            "deepseek_v4": (hf_deepseek_v4, dict(moe_intermediate_size=20, vocab_size=100,
                                                 sliding_window=64)),
            "exaone4": (hf_exaone4, ODD), "gemma3_text": (hf_gemma3, ODD),
            "glm4_moe": (hf_glm4_moe, ODD_MOE),
            "gpt_neox": (hf_neox, dict(ODD, hidden_act="gelu_new")),  # GELU with tanh
            "gpt_oss": (hf_gpt_oss, ODD), "granite": (hf_granite, ODD),
            "granitemoe": (hf_granitemoe, ODD), "inkling_text": (hf_inkling, ODD_MOE),
            "llama": (hf_llama, ODD), "longcat_flash": (hf_longcat_flash, dict(vocab_size=100)),
            "minimax_m2": (hf_minimax_m2, ODD), "mixtral": (hf_mixtral, ODD),
            "mistral": (hf_mistral, dict(ODD, sliding_window=64)),
            "nemotron_h": (hf_nemotron_h, ODD_MOE),
            "olmo2": (hf_olmo2, ODD), "olmo3": (hf_olmo3, ODD), "phi3": (hf_phi3, ODD),
            "qwen3": (hf_qwen3, ODD), "qwen3_moe": (hf_qwen3_moe, ODD_MOE),
            "qwen3_next": (hf_qwen3_next, ODD_MOE), "qwen3_5": dense_35, "qwen3_5_text": dense_35,
            "qwen3_5_moe": moe_35, "qwen3_5_moe_text": moe_35}


SUPPORTED = [t for t in model_types() if model_class(t).batch_invariant_refusal is None]


def test_every_registered_architecture_has_a_checkpoint_here():
    assert set(_builders()) == set(model_types())


# what followed the batch before (1e-7 to 2e-6 apart at world 1): GraniteMoE's, MiniMax-M2's,
# Inkling's and DeepSeek-V4's routers (a GEMM over the batch, sigmoid or softplus over [T, E]),
# Inkling's shared experts (a bmm over [T, hidden]), DeepSeek-V4's grouped o_a einsum, its
# shared expert's silu and its mHC coefficients and head (a product, sigmoids over [T, N]),
# Gemma-3's and GPT-NeoX's tanh GELU over an intermediate of 40, a sliding-window ring's decode
# (the whole ring read: min(max_len, window) rows, the batch's longest prompt deciding). These
# prompts (10, 7 and 1 tokens, a prefill and a decode step: a lone prompt's cache of 3 rows)
# showed each of those on AVX-512, where other prompts left some rows' bits alike
ARCHITECTURE_PROMPTS = ((9, 18, 45, 7, 42, 27, 15, 26, 14, 13), (59, 39, 38, 35, 30, 10, 40),
                        (21,))
@pytest.mark.parametrize("model_type", SUPPORTED)
def test_every_architecture_that_declares_it_passes_its_own_check(model_type, tmp_path):
    write, overrides = _builders()[model_type]
    path = write(tmp_path / model_type, **{k: v for k, v in overrides.items() if v is not None})
    spec = RunSpec(str(path), prompts=ARCHITECTURE_PROMPTS, max_new_tokens=2,
                   batch_invariant=True)
    result = run_rank(spec)
    check = invariance_check(merge([result]), [result])
    assert check["ok"] and check["prompts"] == 3 and check["steps"] == 2, check["differences"]


def test_a_model_that_declares_it_cannot_is_refused_by_name(qwen3_dir, monkeypatch):
    """``register_model(batch_invariant="why")``: the command line, the engine API and the
    library (a model built in the mode, and one built outside it run in it) refuse it with
    the table's one line, before anything is built or sent."""
    from types import SimpleNamespace

    from layer_boundary.engine.args import build_parser
    from layer_boundary.engine.run_command import spec_from_args
    from layer_boundary.engine.runner import runtime_of, with_checkpoints
    from layer_boundary.runtime.parallel import virtual_parallel

    monkeypatch.setattr(model_class("qwen3"), "batch_invariant_refusal", "made up here")
    message = ("qwen3 cannot run --batch-invariant (runtime.invariant.batch_invariant): "
               "made up here")
    args = build_parser().parse_args(["run", "--model", str(qwen3_dir), "--batch-invariant"])
    with pytest.raises(CapabilityError) as refused:
        spec_from_args(args)
    assert str(refused.value) == message
    exactly = f"^{re.escape(message)}$"
    with pytest.raises(CapabilityError, match=exactly):
        run_rank(RunSpec(str(qwen3_dir), batch_invariant=True))
    spec = with_checkpoints(RunSpec(str(qwen3_dir)))
    runtime = runtime_of(spec, virtual_parallel(spec.dims()))
    with torch.device("meta"):
        with invariant.batch_invariant(), pytest.raises(CapabilityError, match=exactly):
            model_class("qwen3")(spec.checkpoint.config, runtime)
        model = model_class("qwen3")(spec.checkpoint.config, runtime)
    with invariant.batch_invariant(), pytest.raises(CapabilityError, match=exactly):
        model(SimpleNamespace(tbo=False))  # refused before the forward reads anything


def test_a_parallel_block_under_attention_dp_is_refused_by_name(tmp_path, capsys):
    """Cohere's and GPT-NeoX's parallel blocks add each DP rank's attention output into its
    rows of the FFN's sum over TP (LongCat-Flash its branch's), so a request's bits followed
    the DP rank a batch put it on: ``run --tp 2 --dp 2 --batch-invariant`` failed its own
    check (6e-7 to 1e-6 apart on DP rank 1). Refused by name by the command line and the
    library; without attention DP, or with sequential blocks, it runs."""
    from layer_boundary.engine.runner import runtime_of, with_checkpoints
    from layer_boundary.runtime.parallel import virtual_parallel
    from checkpoints.cohere import hf_cohere
    from checkpoints.gpt_neox import hf_neox

    cohere = hf_cohere(tmp_path / "cohere")
    capsys.readouterr()  # what writing it said
    code, _ = cli(["run", "--model", str(cohere), "--tp", "2", "--dp", "2",
                   "--batch-invariant"], capsys)
    message = ("cohere cannot run --batch-invariant (runtime.invariant.batch_invariant) with "
               "attention DP 2: its parallel block adds each DP rank's attention output into "
               "that rank's rows of the FFN's sum over TP, so where a request's attention "
               "output enters the sum, and its last bits, follow the DP rank a batch puts it on")
    assert code == 2 and capsys.readouterr().err == f"layer-boundary: error: {message}\n"
    spec = with_checkpoints(RunSpec(str(cohere), tp=2, dp=2))
    runtime = runtime_of(spec, virtual_parallel(spec.dims()))
    exactly = f"^{re.escape(message)}$"
    with torch.device("meta"):
        with invariant.batch_invariant(), pytest.raises(CapabilityError, match=exactly):
            model_class("cohere")(spec.checkpoint.config, runtime)
        model = model_class("cohere")(spec.checkpoint.config, runtime)
    with invariant.batch_invariant(), pytest.raises(CapabilityError, match=exactly):
        model(type("Batch", (), {"tbo": False})())  # built outside the mode, run in it
    from layer_boundary.engine.args import build_parser
    from layer_boundary.engine.run_command import spec_from_args

    for argv in (["--model", str(cohere), "--tp", "2"],
                 ["--model", str(hf_neox(tmp_path / "neox", use_parallel_residual=False)),
                  "--tp", "2", "--dp", "2"]):
        spec_from_args(build_parser().parse_args(["run", *argv, "--batch-invariant"]))


def test_the_library_refuses_what_the_command_line_refuses(qwen3_dir):
    """In the mode: a compiled forward, a two-batch forward (a model's, or an outside model's
    ``split_batch``) and speculative decoding, each with the table's pair message (the
    command line's)."""
    from types import SimpleNamespace

    from layer_boundary import split_batch
    from layer_boundary.engine.compiled import compile_forward
    from layer_boundary.engine.runner import runtime_of, with_checkpoints
    from layer_boundary.engine.speculative import speculative_generate
    from layer_boundary.runtime.parallel import virtual_parallel

    spec = with_checkpoints(RunSpec(str(qwen3_dir)))
    with torch.device("meta"):
        model = model_class("qwen3")(spec.checkpoint.config,
                                     runtime_of(spec, virtual_parallel(spec.dims())))
    calls = {Feature.COMPILE: lambda: compile_forward(model, "eager", padded=False),
             Feature.TBO: lambda: model(SimpleNamespace(tbo=True)),
             # an outside model's way into two microbatches, before it reads the batch
             "split_batch": lambda: split_batch(SimpleNamespace()),
             Feature.SPECULATIVE: lambda: speculative_generate(model, model, [[1]], 1, 1,
                                                               parallel=None)}
    for feature, call in calls.items():
        feature = Feature.TBO if feature == "split_batch" else feature
        message = pair_rule(feature, Feature.BATCH_INVARIANT).message()
        with invariant.batch_invariant(), pytest.raises(CapabilityError) as refused:
            call()
        assert str(refused.value) == message


@pytest.mark.timeout(120)
def test_lora_adapters_under_the_mode(qwen3_dir, tmp_path):
    """Two adapters and the base model in one batch: each adapter's delta is computed a row at
    a time in the mode (its products followed how many rows share the adapter: 1.5e-6 apart)."""
    import peft
    import transformers

    adapters = []
    for name, seed, targets in (("a", 1, ["q_proj", "v_proj", "o_proj", "gate_proj",
                                          "down_proj"]), ("b", 2, ["k_proj", "up_proj"])):
        torch.manual_seed(seed)
        base = transformers.AutoModelForCausalLM.from_pretrained(str(qwen3_dir),
                                                                 dtype=torch.float32)
        peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                  init_lora_weights=False,
                                                  target_modules=targets)
                            ).save_pretrained(str(tmp_path / name))
        adapters.append((name, str(tmp_path / name)))
    spec = RunSpec(str(qwen3_dir), prompts=((3, 1, 4, 1, 5, 9, 2), (35, 8), (9, 7, 9), (4,),
                                            (60, 2, 7)),
                   max_new_tokens=3, lora=tuple(adapters),
                   prompt_lora=("a", "b", "a", "none", "a"), batch_invariant=True)
    result = run_rank(spec)
    check = invariance_check(merge([result]), [result])
    assert check["ok"] and check["prompts"] == 5, check["differences"]


@pytest.mark.parametrize("value", ["no", 1, None, 0.0])
def test_the_mode_takes_a_real_bool(value):
    with pytest.raises(TypeError) as refused:
        invariant.batch_invariant(value)
    assert str(refused.value) == (f"batch_invariant(on={value!r}): on must be True or False, "
                                  f"not {type(value).__name__}")
    assert not invariant.BATCH_INVARIANT.on
