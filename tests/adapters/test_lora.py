"""LoRA adapters (``adapters/lora.py``): two PEFT adapters on a Qwen3 checkpoint, prompts split
across adapter A, adapter B and the base model in one batch.

World 1 against ``peft``'s ``PeftModel`` with each prompt's adapter (prefill logits at every
position, then cached decode steps); every row mode on gloo ranks (ar, rs, rsv, attention
DP, an empty DP rank, a pipeline, two-batch overlap) against world 1, with the ledger unchanged
by the adapters (the delta joins its base linear's partial and is reduced with it, once);
misuse, each a named error.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from distributed.checks import assert_logits_match, cli_ok
from distributed.pool import get_pool
from oracle import TOL, hf_cached_decode

from layer_boundary.engine.cli import main
from layer_boundary.adapters.tbo import TboPolicy
from layer_boundary.engine.runner import RunSpec, merge, run_rank

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2), (4, 4, 1), (60, 2, 7))
CHOICE = ("a", "b", "none", "a", "b")
STEPS = 3


def _peft_adapter(base: str, path, seed: int, **config):
    import peft
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    # init_lora_weights=False: B is random too, so every adapted module changes the output
    peft.get_peft_model(model, peft.LoraConfig(lora_dropout=0.0, init_lora_weights=False,
                                               **config)).save_pretrained(str(path))
    return str(path)


# tensors of b's file that peft loads over the base model, for every prompt: each of a
# module's own weight, under base_layer where a loaded adapter targets it (gate_proj: a
# does), a fused projection's q part, a row-parallel weight, the vocabulary-split embedding
# and head, a norm; and two that peft ignores (a module's weight under the wrong name)
BASE_LOADS = ("model.layers.0.self_attn.q_proj.base_layer.weight",
              "model.layers.1.mlp.gate_proj.base_layer.weight",
              "model.layers.1.mlp.down_proj.base_layer.weight",
              "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")
BASE_IGNORED = ("model.layers.2.self_attn.q_proj.weight",
                "model.layers.2.input_layernorm.base_layer.weight")


def _with_base_tensors(folder: str, base) -> str:
    """``folder``'s adapter file with ``BASE_LOADS`` and ``BASE_IGNORED`` added (random, of
    the checkpoint tensors' scale)."""
    from safetensors.torch import load_file, save_file

    file = f"{folder}/adapter_model.safetensors"
    ckpt = load_file(str(next(base.glob("*.safetensors"))))
    g = torch.Generator().manual_seed(5)
    extra = {}
    for key in BASE_LOADS + BASE_IGNORED:
        t = ckpt[key.replace(".base_layer", "")]
        extra[f"base_model.model.{key}"] = (t.mean() + t.std().clamp(min=0.1) *
                                            torch.randn(t.shape, generator=g))
    save_file({**load_file(file), **extra}, file)
    return folder


@pytest.fixture(scope="module")
def adapters(qwen3_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    b = _peft_adapter(str(qwen3_dir), root / "b", 2, r=2, lora_alpha=3, use_rslora=True,
                      target_modules=["q_proj", "v_proj", "down_proj"])
    return {"a": _peft_adapter(str(qwen3_dir), root / "a", 1, r=4, lora_alpha=8,
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                               "gate_proj", "up_proj", "down_proj"]),
            "b": _with_base_tensors(b, qwen3_dir)}


def spec_of(qwen3_dir, adapters, **kw) -> RunSpec:
    return RunSpec(str(qwen3_dir), prompts=PROMPTS, max_new_tokens=STEPS,
                   lora=tuple(adapters.items()), prompt_lora=CHOICE, **kw)


@pytest.fixture(scope="module")
def world1(qwen3_dir, adapters):
    return merge([run_rank(spec_of(qwen3_dir, adapters), world_size=1)])


@pytest.mark.timeout(240)
def test_world1_matches_peft_for_each_prompts_adapter(qwen3_dir, adapters, world1):
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(qwen3_dir), dtype=torch.float32, attn_implementation="eager")
    ref = peft.PeftModel.from_pretrained(base, adapters["a"], adapter_name="a").eval()
    ref.load_adapter(adapters["b"], adapter_name="b")
    plain = merge([run_rank(replace(spec_of(qwen3_dir, adapters), lora=(), prompt_lora=()),
                            world_size=1)])
    for j, (prompt, choice) in enumerate(zip(PROMPTS, CHOICE)):
        ours = torch.stack(world1.logits[j])
        if choice == "none":
            with ref.disable_adapter():
                expected = hf_cached_decode(ref, prompt, world1.generated[j][:-1])
        else:
            ref.set_adapter(choice)
            expected = hf_cached_decode(ref, prompt, world1.generated[j][:-1])
        # the adapter, or b's base-model tensors for a base-model prompt, move its numbers
        assert (ours - torch.stack(plain.logits[j])).abs().max() > 100 * TOL
        scale = expected.abs().max().item()
        assert (ours - expected[:STEPS]).abs().max().item() <= TOL * max(1.0, scale), j
        assert world1.generated[j] == expected.argmax(-1).tolist()


# (tp, attn_dp, policy, prompts, options): every row mode, attention DP with an empty DP rank,
# a pipeline and two-batch overlap
CASES = [(2, 1, "ar", 5, {}), (2, 1, "rs", 5, {}), (4, 2, "rsv", 5, {}), (4, 2, "rs", 5, {}),
         (4, 2, "rsv", 1, {}), (2, 1, "rs", 5, {"pp": 2}),
         (4, 2, "rsv", 5, {"tbo": TboPolicy.ALWAYS})]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    from checkpoints import hf_qwen3

    return str(hf_qwen3(tmp_path_factory.mktemp("lora-draft"), seed=7, num_hidden_layers=1))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dp,policy", [(1, 1, "ar"), (4, 2, "rsv")])
def test_a_drafted_run_keeps_each_prompts_adapter(qwen3_dir, adapters, world1, draft_dir, tp,
                                                   dp, policy):
    """Speculative decoding verifies with the adapted target: every emitted token and logit
    is the adapted run's (a draft that dropped the adapters gives the base model's)."""
    spec = spec_of(qwen3_dir, adapters, tp=tp, dp=dp, boundary_reduction=policy,
                   draft_model=draft_dir, speculative_steps=2)
    drafted = merge(get_pool(tp).run(run_rank, spec) if tp > 1 else [run_rank(spec, 1)])
    assert_logits_match(drafted, world1, len(PROMPTS))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,dp,policy,prompts,options", CASES, ids=[
    f"tp{t}-dp{d}-{p}-{n}" + "".join(f"-{k}" for k in o) for t, d, p, n, o in CASES])
def test_every_row_mode_matches_world1(qwen3_dir, adapters, world1, tp, dp, policy, prompts,
                                       options):
    spec = replace(spec_of(qwen3_dir, adapters, tp=tp, dp=dp, boundary_reduction=policy,
                           **options), prompts=PROMPTS[:prompts], prompt_lora=CHOICE[:prompts])
    results = get_pool(spec.world_size).run(run_rank, spec)
    reference = merge([run_rank(replace(spec, tp=1, dp=1, pp=1, tbo=TboPolicy.OFF,
                                        boundary_reduction="ar"), world_size=1)])
    assert_logits_match(merge(results), reference, prompts)
    # the deltas join their base linears' sums: the same collectives as without adapters,
    # plus, under attention DP, one gather per forward of the rows' adapter slots onto the
    # FFNs' global rows (int64, one per token of every DP rank)
    plain = get_pool(spec.world_size).run(run_rank, replace(spec, lora=(), prompt_lora=()))
    for r, p in zip(results, plain):
        def is_slots(e):
            return e.dtype == torch.int64 and e.site.endswith("ffn.compute")

        slots = [e for e in r.ledger if is_slots(e)]
        forwards = STEPS * (2 if spec.tbo is TboPolicy.ALWAYS else 1)
        assert len(slots) == (forwards if dp > 1 else 0), slots
        assert all(e.kind == "all_gather" for e in slots)
        assert [(e.site, e.kind, e.numel) for e in r.ledger if not is_slots(e)] == [
            (e.site, e.kind, e.numel) for e in p.ledger]


@pytest.mark.timeout(120)
def test_cli_run_with_two_adapters(qwen3_dir, adapters, capsys, restore_logger):
    args = ["run", "--model", str(qwen3_dir), "--tp", "4", "--dp", "2", "--max-new-tokens", "2",
            "--lora", f"a={adapters['a']}", "--lora", f"b={adapters['b']}"]
    for p, c in zip(PROMPTS[:3], CHOICE[:3]):
        args += ["--prompt-ids", ",".join(map(str, p)), "--prompt-lora", c]
    out = cli_ok(args, capsys)
    assert "parity vs world 1: PASS" in out and "(LoRA b)" in out and "(LoRA none)" in out


@pytest.fixture(scope="module")
def foreign_adapter(tmp_path_factory, adapters) -> str:
    """An adapter whose target the model lacks (a renamed module its config targets)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("foreign")
    config = json.loads(Path(adapters["a"], "adapter_config.json").read_text())
    config["target_modules"] = [*config["target_modules"], "x_proj"]
    (path / "adapter_config.json").write_text(json.dumps(config))
    tensors = {k.replace("q_proj", "x_proj"): v
               for k, v in load_file(f"{adapters['a']}/adapter_model.safetensors").items()}
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


@pytest.mark.parametrize("case,message", [
    ("unknown", "--prompt-lora c: no adapter named c (a)"),
    ("count", "--prompt-lora is given 1 times for 2 prompts"),
    ("no_adapters", "--prompt-lora needs adapters: load them with --lora NAME=DIR"),
    ("foreign", "LoRA adapter a: model.layers.0.self_attn.x_proj is a target, and the qwen3 "
                "model has no parallel linear for it"),
    ("missing", "LoRA adapter a: no such folder /nonexistent"),
    ("a-file", "LoRA adapter a: /etc/hostname is not a folder"),
    ("none-name", "LoRA adapter none: none is --prompt-lora's name for the base model; give "
                  "the adapter another name"),
    ("sp", "--sequence-parallel does not combine with --lora yet (BatchVariant.SEQUENCE_PARALLEL, "
           "attach_lora)")])
def test_bad_adapter_input_is_a_one_line_error(qwen3_dir, adapters, foreign_adapter, case,
                                               message, capsys, restore_logger):
    lora = {"foreign": f"a={foreign_adapter}", "missing": "a=/nonexistent",
            "a-file": "a=/etc/hostname", "none-name": f"none={adapters['a']}"}.get(
        case, f"a={adapters['a']}")
    args = ["run", "--model", str(qwen3_dir), "--tp", "2", "--prompt-ids", "1,2",
            "--prompt-ids", "3"]
    args += [] if case == "no_adapters" else ["--lora", lora]
    args += {"unknown": ["--prompt-lora", "c", "--prompt-lora", "none"],
             "count": ["--prompt-lora", "a"], "no_adapters": ["--prompt-lora", "a"],
             "sp": ["--sequence-parallel"]}.get(case, [])
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("layer-boundary: error:"), err
    assert message in err[0], err[0]


def test_an_adapted_linear_outside_its_exit_scope_is_refused(qwen3_dir, adapters):
    from layer_boundary.adapters.lora import attach_lora
    from layer_boundary.models import load_model
    from layer_boundary.runtime import BoundaryRuntime, ParallelDims, virtual_parallel

    model = load_model(str(qwen3_dir), BoundaryRuntime(virtual_parallel(ParallelDims())))
    attach_lora(model, [("a", adapters["a"])])
    proj = model.model.layers[0].self_attn.qkv_proj
    with pytest.raises(RuntimeError, match="^LoRA-adapted model.layers.0.self_attn.qkv_proj ran "
                                           "outside its stage's exit\\(\\) scope"):
        proj(torch.zeros(2, proj.weight.shape[1]))
