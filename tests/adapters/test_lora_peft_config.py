"""A PEFT LoRA folder means here what it means to peft (``adapters/lora_config.py``).

World 1 against ``peft``'s ``PeftModel`` for the config fields that choose what is applied
(a missing ``lora_alpha``, ``target_modules`` as names, a regex, ``all-linear`` or absent,
``exclude_modules``, ``layers_to_transform``/``layers_pattern``, ``rank_pattern``/
``alpha_pattern``), on weight files that also hold tensors peft does not apply; and every
adapter peft refuses, or that cannot mean anything, refused as one line naming the adapter,
the module or the file, and what is wrong, before anything is attached.
"""

from __future__ import annotations

import json
from dataclasses import replace
import logging
import re
import struct
from pathlib import Path

import pytest
import torch
from oracle import TOL, hf_cached_decode

from layer_boundary.engine.cli import main
from layer_boundary.engine.runner import RunSpec, merge, run_rank

PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WEIGHTS = "adapter_model.safetensors"


def _peft_adapter(base: str, path: Path, seed: int, **config) -> Path:
    import peft
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    # init_lora_weights=False: B is random too, so every adapted module changes the output
    peft.get_peft_model(model, peft.LoraConfig(lora_dropout=0.0, init_lora_weights=False,
                                               **config)).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def saved(qwen3_dir, tmp_path_factory) -> dict[str, Path]:
    """Two adapters saved by peft: every linear of every layer (r 4, alpha 8), and one with
    per-module ranks and alphas."""
    root = tmp_path_factory.mktemp("peft-config")
    return {"full": _peft_adapter(str(qwen3_dir), root / "full", 3, r=4, lora_alpha=8,
                                  target_modules=ALL),
            "patterned": _peft_adapter(str(qwen3_dir), root / "patterned", 4, r=4,
                                       lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                     "down_proj"],
                                       rank_pattern={"q_proj": 2},
                                       alpha_pattern={"down_proj": 2})}


def variant(src: Path, dst: Path, config=None, tensors=None) -> Path:
    """``src`` with its config's fields replaced (``config``: field -> value, None deletes)
    and its tensors transformed (``tensors``: the {name: tensor} dict -> a new one)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    cfg = json.loads((src / "adapter_config.json").read_text())
    for key, value in (config or {}).items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    weights = load_file(str(src / WEIGHTS))
    save_file(tensors(weights) if tensors else weights, str(dst / WEIGHTS))
    return dst


def _unprefixed(w):
    """Beside each tensor, a tenfold copy without peft's ``base_model.model.`` prefix (which
    peft does not load)."""
    return {**w, **{k.removeprefix("base_model.model."): 10 * v for k, v in w.items()}}


def _base_tensors(**shapes):
    """Adds tensors peft may load over the base model (key after peft's prefix -> shape),
    random around one (a norm's scale) or zero."""
    def edit(w):
        g = torch.Generator().manual_seed(len(w))
        for key, shape in shapes.items():
            centre = 1.0 if len(shape) == 1 else 0.0
            w[f"base_model.model.{key.replace('__', '.')}"] = (
                centre + 0.2 * torch.randn(shape, generator=g))
        return w
    return edit


# (id, source adapter, config fields, tensors' transform): the full adapter's file holds every
# linear of every layer, so each config below leaves some of its tensors unapplied
NUMERIC = [
    ("no-lora-alpha", "full", {"lora_alpha": None}, None),  # peft's default 8, not r
    ("target-names", "full", {"target_modules": ["q_proj", "mlp.down_proj"]}, None),
    ("target-regex", "full", {"target_modules": r".*\.1\.self_attn\.(q|v)_proj"}, None),
    ("all-linear", "full", {"target_modules": "all-linear"}, None),
    ("default-targets", "full", {"target_modules": None}, None),  # qwen3: q_proj, v_proj
    ("exclude", "full", {"exclude_modules": ["up_proj", "layers.2.self_attn.o_proj"]}, None),
    ("layers", "full", {"layers_to_transform": [0, 2], "layers_pattern": "layers"}, None),
    ("one-layer", "full", {"layers_to_transform": 1}, None),
    ("patterns", "patterned", {}, None),
    ("unprefixed", "full", {"target_modules": ["q_proj"]}, _unprefixed),
    # a target without weights in the file: peft's default init leaves its B zero
    ("unsaved-target", "full", {"init_lora_weights": True},
     lambda w: {k: v for k, v in w.items() if "layers.1.self_attn.q_proj" not in k}),
    # loaded: a target's own weight under base_layer, an untargeted linear's, the embedding,
    # the head, a norm; ignored: an untargeted module's under base_layer, a target's without
    ("base-tensors", "full", {"target_modules": ["q_proj", "v_proj"]}, _base_tensors(
        **{"model__layers__0__self_attn__q_proj__base_layer__weight": (128, 64),
           "model__layers__1__mlp__gate_proj__weight": (96, 64),
           "model__embed_tokens__weight": (96, 64), "lm_head__weight": (96, 64),
           "model__layers__2__post_attention_layernorm__weight": (64,),
           "model__layers__0__self_attn__k_proj__base_layer__weight": (32, 64),
           "model__layers__1__self_attn__v_proj__weight": (32, 64)})),
    # all-linear wraps every linear (o_proj's own name is ignored), not the embedding or norms
    ("base-all-linear", "full", {"target_modules": "all-linear"}, _base_tensors(
        **{"model__layers__2__self_attn__o_proj__base_layer__weight": (64, 128),
           "model__layers__0__self_attn__o_proj__weight": (64, 128),
           "model__embed_tokens__weight": (96, 64), "model__norm__weight": (64,)})),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source,config,tensors", [c[1:] for c in NUMERIC],
                         ids=[c[0] for c in NUMERIC])
def test_world1_matches_peft(qwen3_dir, saved, tmp_path, source, config, tensors):
    import peft
    import transformers

    folder = str(variant(saved[source], tmp_path / "adapter", config, tensors))
    spec = RunSpec(str(qwen3_dir), prompts=(PROMPT,), max_new_tokens=1,
                   lora=(("x", folder),), prompt_lora=("x",))
    ours = merge([run_rank(spec, world_size=1)]).logits[0][0]
    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(qwen3_dir), dtype=torch.float32, attn_implementation="eager")
    ref = peft.PeftModel.from_pretrained(base, folder).eval()
    expected = hf_cached_decode(ref, PROMPT, [])[0]
    scale = expected.abs().max().item()
    assert (ours - expected).abs().max().item() <= TOL * max(1.0, scale)


def _meta_model(qwen3_dir):
    from layer_boundary.models import open_checkpoint
    from layer_boundary.runtime import BoundaryRuntime, ParallelDims, virtual_parallel

    checkpoint = open_checkpoint(str(qwen3_dir))
    with torch.device("meta"):
        return checkpoint.model_class(checkpoint.config,
                                      BoundaryRuntime(virtual_parallel(ParallelDims())))


# not loaded by peft: a target's own weight without base_layer, a module that no adapter
# targets under base_layer (layer 1's q_proj: only layer 0's is adapted), a tensor the base
# model does not have
IGNORED = ("model.layers.0.self_attn.q_proj.weight",
           "model.layers.1.self_attn.q_proj.base_layer.weight", "model.layers.7.norm.weight")


def test_what_peft_ignores_is_named_in_a_warning(qwen3_dir, saved, tmp_path,
                                                             caplog):
    from layer_boundary.adapters.lora import attach_lora

    folder = variant(saved["full"], tmp_path / "a", {"target_modules": ["q_proj"],
                                                     "layers_to_transform": [0],
                                                     "a_later_field": 1},
                     lambda w: {**w, "lm_head.lora_A.weight": torch.zeros(4, 64),
                                **{f"base_model.model.{k}": torch.ones(64) for k in IGNORED}})
    with caplog.at_level(logging.WARNING, logger="layer_boundary.adapters.lora"):
        attach_lora(_meta_model(qwen3_dir), [("a", str(folder))], str(qwen3_dir))
    dropped = sorted(f"model.layers.{i}.{m}" for i in range(3) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
        if (i, m) != (0, "self_attn.q_proj"))
    assert [r.getMessage() for r in caplog.records] == [
        "LoRA adapter a: adapter_config.json fields peft does not know, ignored as peft ignores "
        "them: a_later_field",
        "LoRA adapter a: not applied, as peft does not apply them: the weights of 20 modules "
        f"adapter_config.json does not target: {', '.join(dropped)}",
        "LoRA adapter a: not applied, as peft does not load them: 1 tensors without peft's "
        "base_model.model. prefix: lm_head.lora_A.weight",
        "LoRA adapter a: not applied, as peft does not load them: 2 tensors named as no "
        "parameter of peft's model (a targeted module's own weight is saved under base_layer, "
        "any other module's without): " + ", ".join(f"base_model.model.{k}"
                                                    for k in IGNORED[:2]),
        "LoRA adapter a: not applied, as peft does not load them: 1 tensors the base model "
        f"does not have: base_model.model.{IGNORED[2]}"]


def _set(key, fn):
    def edit(w):
        w[f"base_model.model.{key}"] = fn(w[f"base_model.model.{key}"])
        return w
    return edit


def _other_base(w):
    """The tensors of an adapter for a hidden-32 model."""
    return {k: (v[:, :32] if "lora_A" in k and not k.endswith(("o_proj.lora_A.weight",
                                                              "down_proj.lora_A.weight"))
                else v[:32] if k.endswith(("o_proj.lora_B.weight", "down_proj.lora_B.weight"))
                else v).contiguous() for k, v in w.items()}


Q0, V0, D1 = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", \
    "model.layers.1.mlp.down_proj"

# (id, config fields, tensors' transform, message): the folder is {dir}, its weights {file}
CONFIG_REFUSALS = [
    ("rank", {"r": 8}, None,
     "model.layers.0.mlp.down_proj lora_A has rank 4, and adapter_config.json gives it r=8"),
    ("nan-alpha", {"lora_alpha": float("nan")}, None, "lora_alpha must be a finite number, "
                                                      "got nan"),
    ("str-alpha", {"lora_alpha": "8"}, None, "lora_alpha must be a finite number, got '8'"),
    ("zero-r", {"r": 0}, None, "r must be a positive integer, got 0"),
    # JSON's integers are unbounded: one no float holds is not finite (it was an
    # OverflowError traceback), and a finite alpha whose scaling overflows B is refused
    ("alpha-bigint", {"lora_alpha": 10 ** 400}, None,
     f"lora_alpha must be a finite number, got {10 ** 400!r}"),
    ("alpha-overflow", {"lora_alpha": 1e300}, None,
     "model.layers.0.mlp.down_proj lora_B times its scaling 2.5e+299 (lora_alpha / r) "
     "overflows a float"),
    # targeted, no weights in the file, and peft's init_lora_weights=False draws them at
    # random: the adapter's output would be a draw (it ran as if the module had no adapter)
    ("random-init", {}, lambda w: {k: v for k, v in w.items() if "layers.1.self_attn.q_proj"
                                   not in k},
     "adapter_config.json targets model.layers.1.self_attn.q_proj (1 modules in all), and "
     "{file} holds no weights for it: peft initializes them at random "
     "(init_lora_weights=False), so its output would be a draw, not the adapter's"),
    # peft's LoraConfig takes them; its model refuses them building torch.nn.Dropout
    ("dropout-1.5", {"lora_dropout": 1.5}, None, "lora_dropout must be a probability between "
                                                 "0 and 1 (peft builds a torch.nn.Dropout of "
                                                 "it), got 1.5"),
    ("dropout-str", {"lora_dropout": "x"}, None, "lora_dropout must be a probability between "
                                                 "0 and 1 (peft builds a torch.nn.Dropout of "
                                                 "it), got 'x'"),
    ("regex-layers", {"target_modules": ".*q_proj", "layers_to_transform": [0]}, None,
     "layers_to_transform cannot be used when target_modules is a str"),
    ("pattern-alone", {"layers_pattern": "layers"}, None,
     "layers_pattern is set, and layers_to_transform is not"),
    ("bad-regex", {"target_modules": "(q_proj"}, None,
     "target_modules holds an invalid regex (missing ), unterminated subpattern at position 0)"),
    # exponential backtracking on each module name: peft hangs on it; refused by name
    ("redos", {"target_modules": "(.|.)*Z"}, None,
     "target_modules regex '(.|.)*Z' repeats a part that itself alternates or repeats, which "
     "can take exponential time to match a module name (peft would hang on it): write it "
     "without the nested repetition"),
    ("pissa", {"init_lora_weights": "pissa"}, None,
     "init_lora_weights='pissa' is not supported (peft redoes that initialization from the "
     "base weights when it loads the adapter)"),
    ("dora", {"use_dora": True}, None, "use_dora=True is not supported"),
    ("no-target", {"target_modules": ["gate"]}, None,
     "adapter_config.json targets none of the modules whose weights {file} holds"),
    ("no-peft-type", {"peft_type": None}, None,
     "{dir}/adapter_config.json has no peft_type (peft reads the adapter type there)"),
    # a tensor peft loads over the base model's: its shape must be the checkpoint's (peft's
    # load_state_dict refuses a size mismatch); here also floating point and finite
    ("base-shape", {}, lambda w: {**w, f"base_model.model.{Q0}.base_layer.weight":
                                  torch.zeros(64, 64)},
     f"tensor base_model.model.{Q0}.base_layer.weight has shape [64, 64], and the base "
     f"model's {Q0}.weight has [128, 64] (peft refuses it: size mismatch)"),
    ("base-vocab", {}, lambda w: {**w, "base_model.model.model.embed_tokens.weight":
                                  torch.zeros(99, 64)},
     "tensor base_model.model.model.embed_tokens.weight has shape [99, 64], and the base "
     "model's model.embed_tokens.weight has [96, 64] (peft refuses it: size mismatch)"),
    ("base-int", {}, lambda w: {**w, "base_model.model.model.norm.weight":
                                torch.ones(64, dtype=torch.int32)},
     "tensor base_model.model.model.norm.weight is I32; base-model tensors must be floating "
     "point (F16, BF16, F32, F64)"),
    ("base-nan", {}, lambda w: {**w, "base_model.model.model.norm.weight":
                                torch.full((64,), float("nan"))},
     "tensor base_model.model.model.norm.weight holds NaN or Inf values"),
    ("int32", {}, _set(f"{Q0}.lora_A.weight", lambda t: (t * 100).to(torch.int32)),
     f"{Q0} lora_A is I32; LoRA weights must be floating point (F16, BF16, F32, F64)"),
    ("nan", {}, _set(f"{D1}.lora_B.weight", lambda t: t.index_fill(0, torch.tensor([3]),
                                                                   float("nan"))),
     f"{D1} lora_B holds NaN or Inf values"),
    ("inf", {}, _set(f"{Q0}.lora_A.weight", lambda t: t.index_fill(1, torch.tensor([0]),
                                                                   float("inf"))),
     f"{Q0} lora_A holds NaN or Inf values"),
    ("other-base", {}, _other_base,
     "model.layers.0.mlp.down_proj lora_B gives 32 output features, and the model's "
     "down_proj gives 64 (an adapter for another base model?)"),
    ("a-width", {}, _set(f"{Q0}.lora_A.weight", lambda t: torch.cat([t, t], 1)),
     f"{Q0} lora_A takes 128 input features, and the model's q_proj takes 64 (an adapter for "
     "another base model?)"),
    ("b-rows", {}, _set(f"{V0}.lora_B.weight", lambda t: torch.cat([t, t])),
     f"{V0} lora_B gives 64 output features, and the model's v_proj gives 32 (an adapter for "
     "another base model?)"),
]


def _raw(folder: Path, name: str, data: bytes) -> None:
    (folder / name).write_bytes(data)


def _lying_header(folder: Path) -> None:
    """A header that claims twice the data the file holds."""
    data = (folder / WEIGHTS).read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    key = next(k for k in header if k != "__metadata__")
    header[key]["shape"] = [2 * header[key]["shape"][0], *header[key]["shape"][1:]]
    text = json.dumps(header).encode()
    _raw(folder, WEIGHTS, struct.pack("<Q", len(text)) + text + data[8 + size:])


# (id, how the folder is broken, message)
FILE_REFUSALS = [
    ("truncated", lambda d: _raw(d, WEIGHTS, (d / WEIGHTS).read_bytes()[:-100]),
     "{file} is not a readable safetensors file (Error while deserializing header: "
     "incomplete metadata, file not fully covered)"),
    ("zero-bytes", lambda d: _raw(d, WEIGHTS, b""),
     "{file} is not a readable safetensors file (Error while deserializing header: "
     "header too small)"),
    ("pickle", lambda d: torch.save({"x": torch.zeros(2)}, d / WEIGHTS),
     "{file} is not a readable safetensors file (Error while deserializing header: "
     "header too large)"),
    ("lying-header", _lying_header,
     "{file} is not a readable safetensors file (Error while deserializing header: "
     "invalid shape, data type, or offset for tensor)"),
    ("not-json", lambda d: _raw(d, "adapter_config.json", b'{"r": 4,'),
     "{dir}/adapter_config.json is not JSON (Expecting property name enclosed in double "
     "quotes at line 1 column 9)"),
    ("not-an-object", lambda d: _raw(d, "adapter_config.json", b'["LORA"]'),
     "{dir}/adapter_config.json is a JSON list, not an object"),
]


@pytest.mark.parametrize("config,tensors,message", [c[1:] for c in CONFIG_REFUSALS],
                         ids=[c[0] for c in CONFIG_REFUSALS])
def test_a_bad_adapter_is_a_one_line_error(qwen3_dir, saved, tmp_path, config, tensors,
                                           message, capsys, restore_logger):
    folder = variant(saved["full"], tmp_path / "a", config, tensors)
    _refused(qwen3_dir, folder, message, capsys)


@pytest.mark.parametrize("breaks,message", [c[1:] for c in FILE_REFUSALS],
                         ids=[c[0] for c in FILE_REFUSALS])
def test_a_broken_adapter_file_is_a_one_line_error(qwen3_dir, saved, tmp_path, breaks,
                                                   message, capsys, restore_logger):
    folder = variant(saved["full"], tmp_path / "a")
    breaks(folder)
    _refused(qwen3_dir, folder, message, capsys)


def _refused(qwen3_dir, folder: Path, message: str, capsys) -> None:
    """``run`` with ``folder`` as adapter a exits 2 with one line: the adapter's error."""
    args = ["run", "--model", str(qwen3_dir), "--prompt-ids", "1,2", "--lora", f"a={folder}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    text = message.format(dir=folder, file=folder / WEIGHTS)
    assert err == [f"layer-boundary: error: LoRA adapter a: {text}"]


def test_a_refused_adapter_leaves_the_model_unadapted(qwen3_dir, saved, tmp_path):
    """Every adapter is read and checked before any is attached."""
    from layer_boundary.adapters.lora import LoraError, attach_lora
    from layer_boundary.runtime.linear import ColumnParallelLinear, RowParallelLinear

    bad = variant(saved["full"], tmp_path / "b",
                  tensors=_set(f"{D1}.lora_B.weight", lambda t: t * float("inf")))
    model = _meta_model(qwen3_dir)
    with pytest.raises(LoraError, match=f"^LoRA adapter b: {D1} lora_B holds NaN or Inf"):
        attach_lora(model, [("a", str(saved["full"])), ("b", str(bad))])
    assert all(m.lora is None for m in model.modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear)))


@pytest.mark.parametrize("make,target,why", [
    ("checkpoints.ds:hf_deepseek_v3", "kv_b_proj",
     "absorbs it into its attention (the cache holds the latent)"),
    ("checkpoints.ds4:hf_deepseek_v4", "o_a_proj",
     "applies its weight group by group in one product")], ids=["v3-kv_b", "v4-o_a"])
def test_an_adapter_on_an_absorbed_projection_is_refused_by_name(tmp_path, make, target, why):
    """A linear whose weight the model applies other than as the linear: DeepSeek-V3's MLA
    absorbs kv_b_proj into its queries and output (its cache holds the latent), DeepSeek-V4
    runs o_a_proj's groups in one product. peft can adapt them, this model cannot (V4's
    adapter was accepted and never applied), and says so before attaching anything."""
    import importlib

    from layer_boundary.adapters.lora import LoraError, attach_lora
    from layer_boundary.models import load_model
    from layer_boundary.runtime.args import BoundaryRuntime
    from layer_boundary.runtime.parallel import ParallelDims, build_parallel

    module, fn = make.split(":")
    base = getattr(importlib.import_module(module), fn)(tmp_path / "base")
    folder = _peft_adapter(str(base), tmp_path / "a", 5, r=2, lora_alpha=4,
                           target_modules=["q_b_proj" if "v4" in fn else "q_proj", target])
    model = load_model(base, BoundaryRuntime(build_parallel(ParallelDims(world_size=1))))
    kind = "deepseek_v4" if "v4" in fn else "deepseek_v3"
    with pytest.raises(LoraError, match=rf"{target} is a target, and the {kind} model "
                                        rf"{re.escape(why)}, so the linear never runs"):
        attach_lora(model, [("a", str(folder))])
    assert not [m for m in model.modules() if getattr(m, "lora", None) is not None]


@pytest.mark.timeout(180)
def test_a_tied_head_loads_over_the_embedding_as_in_peft(qwen3_tied_dir, tmp_path):
    """A tied model's ``lm_head.weight`` is its embedding: peft loads an adapter's head over
    it, after the embedding's own; world 1 and a pipeline whose last stage reads the
    embedding as its head both give peft's numbers."""
    import peft
    import transformers
    from distributed.checks import assert_logits_match
    from distributed.pool import get_pool

    src = _peft_adapter(str(qwen3_tied_dir), tmp_path / "src", 6, r=2, target_modules=["q_proj"])
    folder = str(variant(src, tmp_path / "a", tensors=_base_tensors(
        model__embed_tokens__weight=(96, 64), lm_head__weight=(96, 64))))
    spec = RunSpec(str(qwen3_tied_dir), prompts=(PROMPT, PROMPT[:3]), max_new_tokens=2,
                   lora=(("x", folder),), prompt_lora=("x", "none"))
    ours = merge([run_rank(spec, world_size=1)])
    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(qwen3_tied_dir), dtype=torch.float32, attn_implementation="eager")
    ref = peft.PeftModel.from_pretrained(base, folder).eval()
    for j, prompt in enumerate(spec.prompts):
        if j:
            with ref.disable_adapter():
                expected = hf_cached_decode(ref, prompt, ours.generated[j][:-1])
        else:
            expected = hf_cached_decode(ref, prompt, ours.generated[j][:-1])
        got = torch.stack(ours.logits[j])
        scale = expected.abs().max().item()
        assert (got - expected[:2]).abs().max().item() <= TOL * max(1.0, scale), j
    assert_logits_match(merge(get_pool(2).run(run_rank, replace(spec, pp=2))), ours, 2)


def test_a_refused_adapter_leaves_the_base_weights_as_loaded(qwen3_dir, saved, tmp_path):
    """Every adapter is checked before any base-model tensor is loaded; without the base
    checkpoint to check them against, an adapter holding them is refused by name."""
    from layer_boundary.adapters.lora import LoraError, attach_lora
    from layer_boundary.models import load_model
    from layer_boundary.runtime.args import BoundaryRuntime
    from layer_boundary.runtime.packed import pack_linears
    from layer_boundary.runtime.parallel import ParallelDims, build_parallel

    good = variant(saved["full"], tmp_path / "a", tensors=_base_tensors(
        model__norm__weight=(64,),
        model__layers__0__self_attn__q_proj__base_layer__weight=(128, 64)))
    bad = variant(saved["full"], tmp_path / "b",
                  tensors=_set(f"{D1}.lora_B.weight", lambda t: t * float("inf")))
    model = load_model(qwen3_dir, BoundaryRuntime(build_parallel(ParallelDims(world_size=1))))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LoraError, match=f"^LoRA adapter b: {D1} lora_B holds NaN or Inf"):
        attach_lora(model, [("a", str(good)), ("b", str(bad))], str(qwen3_dir))
    with pytest.raises(LoraError, match=r"^LoRA adapter a: holds base-model tensors "
                                        r"\(base_model\.model\.model\.\S+\), which peft "
                                        r"loads over the base model's: attach_lora needs the "
                                        r"base checkpoint"):
        attach_lora(model, [("a", str(good))])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    pack_linears(model, 0)
    attach_lora(model, [("a", str(good))], str(qwen3_dir))
    assert not torch.equal(before["model.norm.weight"], model.model.norm.weight)
    # the rewritten projection's packed copy is the new weight's (else it runs unpacked)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert not torch.equal(before["model.layers.0.self_attn.qkv_proj.weight"], qkv.weight)
    assert (qkv.packed is not None and qkv.packed.version == qkv.weight._version
            and qkv.packed.data_ptr == qkv.weight.data_ptr())


def test_an_adapter_on_an_fp8_checkpoint_is_refused_by_name(qwen3_dir, saved, tmp_path,
                                                            capsys, restore_logger):
    """An FP8 checkpoint's stages read their inputs quantized; peft's adapter beside an FP8
    linear reads the unquantized input (its delta moved the logits by 1.5% of their scale)."""
    from checkpoints.fp8 import fp8_checkpoint

    fp8 = fp8_checkpoint(qwen3_dir, tmp_path / "fp8")
    assert main(["run", "--model", str(fp8), "--lora", f"a={saved['full']}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "layer-boundary: error: --lora does not combine with an FP8 checkpoint yet "
        "(attach_lora, config.json quantization_config): an FP8 checkpoint's stages read their "
        "inputs quantized, and peft's adapter beside an FP8 linear reads the unquantized input"]


def test_a_base_tensor_over_a_tensor_that_is_not_float_is_refused(qwen3_dir, saved, tmp_path):
    """A checkpoint's integer tensor (a hash router's table) is no weight to load a float
    over."""
    import shutil

    from safetensors.torch import load_file, save_file

    from layer_boundary.adapters.lora import LoraError, attach_lora

    base = tmp_path / "base"
    shutil.copytree(qwen3_dir, base)
    tensors = load_file(str(base / "model.safetensors"))
    save_file({**tensors, "model.table.weight": torch.zeros(4, 4, dtype=torch.int64)},
              str(base / "model.safetensors"))
    folder = variant(saved["full"], tmp_path / "a", tensors=_base_tensors(
        model__table__weight=(4, 4)))
    with pytest.raises(LoraError, match=r"^LoRA adapter a: tensor base_model\.model\.model\."
                                        r"table\.weight would replace the checkpoint's model\."
                                        r"table\.weight, which is I64, not a float weight: not "
                                        r"supported$"):
        attach_lora(_meta_model(base), [("a", str(folder))], str(base))


def test_a_tied_head_without_one_embedding_to_load_over_is_refused(qwen3_tied_dir, tmp_path):
    """Which tensor a tied head's ``lm_head.weight`` replaces is the checkpoint's one input
    embedding; where the checkpoint holds two, the adapter is refused rather than guessed."""
    import shutil

    from safetensors.torch import load_file, save_file

    from layer_boundary.adapters.lora import LoraError, attach_lora

    base = tmp_path / "base"
    shutil.copytree(qwen3_tied_dir, base)
    weights = base / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({**tensors, "mtp.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()},
              str(weights))
    src = _peft_adapter(str(qwen3_tied_dir), tmp_path / "src", 6, r=2, target_modules=["q_proj"])
    folder = variant(src, tmp_path / "a", tensors=_base_tensors(lm_head__weight=(96, 64)))
    with pytest.raises(LoraError, match=r"^LoRA adapter a: tensor base_model\.model\.lm_head\."
                                        r"weight is the model's tied head, which is its "
                                        r"embedding, and the checkpoint holds no one embedding "
                                        r"to load it over: not supported$"):
        attach_lora(_meta_model(base), [("a", str(folder))], str(base))


def test_an_adapter_on_a_model_that_renames_its_checkpoint_matches_peft(tmp_path):
    """GPT-NeoX's checkpoint (and peft's module names) say gpt_neox.layers.*, the model
    model.layers.*: every targeted module is found under either name (the check for targets
    without weights refused a complete adapter once)."""
    import peft
    import transformers
    from checkpoints.gpt_neox import hf_neox

    base = hf_neox(tmp_path / "neox")
    folder = _peft_adapter(str(base), tmp_path / "a", 8, r=2,
                           target_modules=["dense_h_to_4h", "dense"])
    spec = RunSpec(str(base), prompts=(PROMPT,), max_new_tokens=1, lora=(("x", str(folder)),),
                   prompt_lora=("x",))
    ours = merge([run_rank(spec, world_size=1)]).logits[0][0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(base), dtype=torch.float32, attn_implementation="eager")
    expected = hf_cached_decode(peft.PeftModel.from_pretrained(hf, str(folder)).eval(),
                                PROMPT, [])[0]
    assert (ours - expected).abs().max().item() <= TOL * max(1.0, expected.abs().max().item())
