"""LoRA adapters named as transformers names the model's parameters (``runtime.hf_names``, the
models' ``transformers_names``; ``adapters/lora_base.py``, ``adapters/lora.py``).

peft matches an adapter file's tensors to its ``PeftModel``'s names, which are transformers'
(Mixtral's experts stacked into ``mlp.experts.gate_up_proj``, GraniteMoE's router
``router.weight``, GPT-NeoX's head ``lm_head``), not the checkpoint's. Each case's adapter file
holds base-model tensors under transformers' names (peft loads them: a stacked experts tensor
is split into the checkpoint's per-expert tensors) and under the checkpoint's (peft ignores
them), and LoRA on fused projections as peft targets them (GPT-NeoX's ``query_key_value``,
heads-major, as peft's default; Phi-3's ``qkv_proj`` and ``gate_up_proj``, blocks): world 1
against ``peft.PeftModel`` within fp32 rounding, and at tp 2 against world 1. A GPT-NeoX
checkpoint holding ``embed_out`` and a stray ``lm_head`` runs ``embed_out``, as transformers
does. The map itself is held against transformers' parameters (names, shapes, which are
``nn.Linear``) on every case's model.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from distributed.checks import assert_logits_match
from distributed.pool import get_pool
from oracle import TOL, hf_cached_decode

from layer_boundary.engine.runner import RunSpec, merge, run_rank

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6), (7, 5, 3))
CHOICE = ("x", "none")
STEPS = 2


@dataclass(frozen=True)
class Case:
    """A checkpoint and an adapter on it: its LoRA targets (None: peft's default for the model
    type, adapter_config.json without target_modules) and the base-model tensors its file
    holds, under transformers' names (peft loads them; ``base_layer`` where the module is a
    target) and under the checkpoint's (peft ignores them)."""

    make: str  # "module:function" of tests/checkpoints
    targets: tuple | None
    loaded: tuple
    ignored: tuple


CASES = {
    "qwen3": Case("checkpoints:hf_qwen3", ("q_proj", "v_proj"),
                  ("model.layers.0.mlp.gate_proj.weight",
                   "model.layers.1.self_attn.q_proj.base_layer.weight"),
                  ("model.layers.1.self_attn.v_proj.weight",)),
    "mixtral": Case("checkpoints.mixtral:hf_mixtral", ("q_proj", "v_proj"),
                    ("model.layers.0.mlp.experts.gate_up_proj",
                     "model.layers.1.mlp.experts.down_proj", "model.layers.2.mlp.gate.weight"),
                    ("model.layers.1.block_sparse_moe.experts.0.w1.weight",
                     "model.layers.2.block_sparse_moe.gate.weight")),
    "granitemoe": Case("checkpoints.granite:hf_granitemoe", ("q_proj", "o_proj"),
                       ("model.layers.0.block_sparse_moe.experts.gate_up_proj",
                        "model.layers.1.block_sparse_moe.experts.down_proj",
                        "model.layers.1.block_sparse_moe.router.weight"),
                       ("model.layers.2.block_sparse_moe.input_linear.weight",
                        "model.layers.0.block_sparse_moe.router.layer.weight")),
    "glm4_moe": Case("checkpoints.glm4_moe:hf_glm4_moe", ("q_proj", "v_proj"),
                     ("model.layers.1.mlp.experts.gate_up_proj",
                      "model.layers.2.mlp.experts.down_proj"),
                     ("model.layers.2.mlp.experts.0.gate_proj.weight",)),
    "gpt_neox": Case("checkpoints.gpt_neox:hf_neox", None,
                     ("lm_head.weight",
                      "gpt_neox.layers.0.attention.query_key_value.base_layer.weight",
                      "gpt_neox.layers.1.mlp.dense_h_to_4h.weight"),
                     ("embed_out.weight",)),
    # the NextN layer stored after the stack is no module of transformers' (peft ignores its
    # tensors; the map named its linears, so the sweep's adapter targeted them, refused)
    "deepseek_v3_nextn": Case("checkpoints.ds:hf_deepseek_v3_nextn", ("o_proj",),
                              ("model.layers.1.mlp.experts.gate_up_proj",),
                              ("model.layers.3.enorm.weight",
                               "model.layers.3.self_attn.o_proj.base_layer.weight")),
    # each layer's two attentions published without an exit scope: an adapted o_proj found
    # no adapter rows (a RuntimeError mid-forward); its stacked experts count identity ones
    "longcat": Case("checkpoints.lc:hf_longcat_flash", ("o_proj",),
                    ("model.layers.0.mlp.experts.gate_up_proj",
                     "model.layers.0.self_attn.1.o_proj.base_layer.weight"),
                    ("model.layers.0.mlp.experts.1.up_proj.weight",)),
    "phi3": Case("checkpoints.phi3:hf_phi3", ("qkv_proj", "gate_up_proj", "o_proj"),
                 ("model.layers.0.mlp.gate_up_proj.base_layer.weight",
                  "model.layers.1.self_attn.qkv_proj.base_layer.weight"),
                 ("model.layers.2.mlp.gate_up_proj.weight",)),
}
PREFIX = "base_model.model."


def _transformers(path):
    """The checkpoint as the oracle runs it (fp32, eager attention, eager experts)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager")
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model.eval()


def _adapter(path: Path, folder: Path, case: Case) -> Path:
    """peft's adapter on the checkpoint (random A and B), its file given ``case``'s base
    tensors: around transformers' values where peft loads them, far off where it must not."""
    import peft
    from safetensors.torch import load_file, save_file

    torch.manual_seed(3)
    model = _transformers(path)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    config = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, init_lora_weights=False,
                             target_modules=list(case.targets) if case.targets else None)
    peft.get_peft_model(model, config).save_pretrained(str(folder))
    if case.targets is None:  # peft's default for the model type, read as peft reads it
        cfg = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": None}))
    stored = load_file(str(next(path.glob("*.safetensors"))))
    g = torch.Generator().manual_seed(4)
    extra = {}
    for keys, source, scale in ((case.loaded, params, 1.0), (case.ignored, stored, 3.0)):
        for key in keys:
            t = source[key.replace(".base_layer", "")]
            # (some checkpoints' stacked experts keep transformers' small init: 0.2 at least)
            noise = scale * t.std().clamp(min=0.2)
            extra[PREFIX + key] = t + noise * torch.randn(t.shape, generator=g)
    file = folder / "adapter_model.safetensors"
    save_file({**load_file(str(file)), **extra}, str(file))
    return folder


@pytest.fixture(scope="module", params=list(CASES))
def ran(request, tmp_path_factory):
    """(case name, checkpoint, adapter folder, spec, world-1 result)."""
    case = CASES[request.param]
    root = tmp_path_factory.mktemp(f"names-{request.param}")
    module, fn = case.make.split(":")
    path = getattr(importlib.import_module(module), fn)(root / "ckpt")
    folder = _adapter(path, root / "adapter", case)
    spec = RunSpec(str(path), prompts=PROMPTS, max_new_tokens=STEPS,
                   lora=(("x", str(folder)),), prompt_lora=CHOICE)
    return request.param, path, folder, spec, merge([run_rank(spec, world_size=1)])


@pytest.mark.timeout(120)
def test_world1_matches_peft(ran):
    """Each prompt's logits as peft's (the adapter's, and the base model's with the adapter
    disabled: the loaded base tensors apply to both); the base tensors did move them."""
    import peft

    name, path, folder, _, ours = ran
    hf = _transformers(path)
    plain = hf_cached_decode(hf, PROMPTS[1], ours.generated[1][:-1])
    ref = peft.PeftModel.from_pretrained(hf, str(folder)).eval()
    for j, prompt in enumerate(PROMPTS):
        with ref.disable_adapter() if CHOICE[j] == "none" else contextlib.nullcontext():
            expected = hf_cached_decode(ref, prompt, ours.generated[j][:-1])
        got = torch.stack(ours.logits[j])
        scale = max(1.0, expected.abs().max().item())
        assert (got - expected[:STEPS]).abs().max().item() <= TOL * scale, (name, j)
        assert ours.generated[j] == expected.argmax(-1).tolist(), (name, j)
        if CHOICE[j] == "none":
            assert (expected - plain).abs().max().item() > 100 * TOL, name


@pytest.mark.timeout(120)
def test_the_name_map_is_transformers(ran):
    """The model's declared names are transformers' parameters (and persistent buffers):
    the same names, shapes, and which are nn.Linear weights (peft's all-linear)."""
    from layer_boundary.adapters.lora_base import transformers_names
    from layer_boundary.models import open_checkpoint

    name, path, *_ = ran
    hf = _transformers(path)
    checkpoint = open_checkpoint(str(path))
    ours = transformers_names(checkpoint.tensor_facts(), _meta_model(checkpoint))
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if checkpoint.config.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert {k: v.shape for k, v in ours.items()} == theirs, name
    linear = {f"{m}.weight" for m, x in hf.named_modules()
              if isinstance(x, torch.nn.Linear) and m != "lm_head"}
    assert {k for k, v in ours.items() if v.linear} == linear, name


def _meta_model(checkpoint):
    from layer_boundary.runtime import BoundaryRuntime, ParallelDims, virtual_parallel

    with torch.device("meta"):
        return checkpoint.model_class(checkpoint.config,
                                      BoundaryRuntime(virtual_parallel(ParallelDims())))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ran", ["gpt_neox", "phi3", "mixtral"], indirect=True)
def test_tp2_matches_world1(ran):
    """The fused targets' B rows and the split experts tensors shard as their base weights'
    rows do: tp 2 (GPT-NeoX's heads-major q/k/v, Phi-3's blocks, Mixtral's stacked experts)
    against world 1."""
    _, _, _, spec, ours = ran
    assert_logits_match(merge(get_pool(2).run(run_rank, replace(spec, tp=2))), ours,
                        len(PROMPTS))


def test_what_transformers_names_otherwise_is_named_in_a_warning(tmp_path, caplog):
    """A tensor under the checkpoint's name, which transformers renames, is not loaded (peft
    has no such parameter), and the warning gives transformers' name for it."""
    from layer_boundary.adapters.lora import attach_lora
    from layer_boundary.models import open_checkpoint
    from checkpoints.mixtral import hf_mixtral

    path = hf_mixtral(tmp_path / "ckpt", num_hidden_layers=1)
    folder = _adapter(path, tmp_path / "a", Case(
        "", ("q_proj",), (), ("model.layers.0.block_sparse_moe.experts.1.w3.weight",)))
    checkpoint = open_checkpoint(str(path))
    with caplog.at_level(logging.WARNING, logger="layer_boundary.adapters.lora"):
        attach_lora(_meta_model(checkpoint), [("a", str(folder))], checkpoint)
    assert caplog.messages == [
        "LoRA adapter a: not applied, as peft does not load them: 1 tensors named as the "
        "checkpoint names them, and transformers' model (whose names peft matches) names them "
        "otherwise: base_model.model.model.layers.0.block_sparse_moe.experts.1.w3.weight "
        "(transformers' model.layers.0.mlp.experts.gate_up_proj)"]


def test_a_base_tensor_of_another_shape_than_transformers_is_refused(tmp_path):
    """peft refuses a size mismatch against its parameter: a stacked experts tensor is
    checked against transformers' stacked shape, not a checkpoint tensor's."""
    from safetensors.torch import load_file, save_file

    from layer_boundary.adapters.lora import LoraError, attach_lora
    from layer_boundary.models import open_checkpoint
    from checkpoints.mixtral import hf_mixtral

    path = hf_mixtral(tmp_path / "ckpt", num_hidden_layers=1)
    folder = _adapter(path, tmp_path / "a", Case("", ("q_proj",), (), ()))
    file = folder / "adapter_model.safetensors"
    key = PREFIX + "model.layers.0.mlp.experts.gate_up_proj"
    save_file({**load_file(str(file)), key: torch.zeros(4, 32, 32)}, str(file))
    checkpoint = open_checkpoint(str(path))
    with pytest.raises(LoraError, match=rf"^LoRA adapter a: tensor {key} has shape \[4, 32, "
                                        r"32\], and the base model's model\.layers\.0\.mlp\."
                                        r"experts\.gate_up_proj has \[4, 64, 32\] \(peft "
                                        r"refuses it: size mismatch\)$"):
        attach_lora(_meta_model(checkpoint), [("a", str(folder))], checkpoint)


def test_gpt_neox_runs_embed_out_over_a_stray_lm_head_as_transformers(tmp_path):
    """transformers reads GPT-NeoX's ``embed_out`` as its ``lm_head``, and where a checkpoint
    holds both, ``embed_out`` (the first of its order); with a tied config, that head against
    the embedding decides the untie."""
    from safetensors.torch import load_file, save_file
    from checkpoints.gpt_neox import hf_neox

    prompt = PROMPTS[0]
    for tie in (False, True):
        path = hf_neox(tmp_path / f"tie{tie}")
        tensors = load_file(str(path / "model.safetensors"))
        g = torch.Generator().manual_seed(5)
        tensors["lm_head.weight"] = torch.randn(tensors["embed_out.weight"].shape, generator=g)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        if tie:
            cfg = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
        ours = merge([run_rank(RunSpec(str(path), prompts=(prompt,), max_new_tokens=1),
                               world_size=1)]).logits[0][0]
        expected = hf_cached_decode(_transformers(path), prompt, [])[0]
        scale = max(1.0, expected.abs().max().item())
        assert (ours - expected).abs().max().item() <= TOL * scale, tie


@pytest.mark.timeout(120)
def test_lora_tensors_under_the_checkpoints_names_load_as_peft_renames_them(tmp_path):
    """peft renames an adapter's LoRA tensors by the model's checkpoint conversion before it
    matches them to its targets: DeepSeek-V4's original ``attn.wo_b`` is ``self_attn.o_b_proj``
    (an adapter targeting o_b_proj applies them; they were dropped as untargeted)."""
    import peft
    from safetensors.torch import load_file, save_file
    from checkpoints.ds4 import hf_deepseek_v4

    path = hf_deepseek_v4(tmp_path / "ckpt")
    folder = _adapter(path, tmp_path / "a", Case("", ("o_b_proj",), (), ()))
    file = folder / "adapter_model.safetensors"
    save_file({k.replace(".self_attn.o_b_proj.", ".attn.wo_b."): v
               for k, v in load_file(str(file)).items()}, str(file))
    spec = RunSpec(str(path), prompts=PROMPTS[:1], max_new_tokens=1, lora=(("x", str(folder)),),
                   prompt_lora=("x",))
    ours = merge([run_rank(spec, world_size=1)]).logits[0][0]
    hf = _transformers(path)
    plain = hf_cached_decode(hf, PROMPTS[0], [])[0]
    expected = hf_cached_decode(peft.PeftModel.from_pretrained(hf, str(folder)).eval(),
                                PROMPTS[0], [])[0]
    scale = max(1.0, expected.abs().max().item())
    assert (ours - expected).abs().max().item() <= TOL * scale
    assert (expected - plain).abs().max().item() > 100 * TOL


@pytest.mark.parametrize("targets,named", [
    (["q_proj", "gate_proj", "up_proj"], "gate_proj"),
    ("all-linear", "all-linear"),
    (r".*\.q_proj|model\.layers\.0\.mlp\.(gate|up)_proj", "model.layers.0.mlp.gate_proj")])
def test_targets_peft_turns_into_expert_parameters_are_refused(qwen3_moe_dir, tmp_path,
                                                                targets, named):
    """On a Qwen3-MoE (as on Mixtral and the other MoE models peft converts) peft makes a
    target naming an expert projection a LoRA on transformers' stacked experts
    (target_parameters), and no longer adapts a dense layer's module of that name."""
    from layer_boundary.adapters.lora import LoraError, attach_lora
    from layer_boundary.models import open_checkpoint

    folder = _adapter(qwen3_moe_dir, tmp_path / "a", Case("", ("q_proj",), (), ()))
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": targets}))
    checkpoint = open_checkpoint(str(qwen3_moe_dir))
    with pytest.raises(LoraError, match=rf"^LoRA adapter a: target_modules names '{named}', "
                                        r"which peft \(0\.21, on transformers 5\) turns on a "
                                        r"qwen3_moe model into a LoRA on the stacked experts'"):
        attach_lora(_meta_model(checkpoint), [("a", str(folder))], checkpoint)
