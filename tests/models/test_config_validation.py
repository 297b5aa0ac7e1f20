"""Config fields of the wrong type or range are refused once, for every architecture, naming
the field: never a traceback, never a silent misread."""

from __future__ import annotations

import copy
import json
import re
import shutil

import pytest
from checkpoints import hf_qwen3, hf_qwen3_moe

from layer_boundary.models import load_config
from layer_boundary.models.loader import CheckpointError, safetensors_files


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cfg")
    return {"qwen3": hf_qwen3(root / "qwen3"), "qwen3_moe": hf_qwen3_moe(root / "moe")}


def with_fields(src, dst, **fields):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("model,fields,message", [
    ("qwen3", {"head_dim": "64"}, "head_dim must be a positive integer, got '64'"),
    ("qwen3", {"head_dim": -8}, "head_dim must be a positive integer"),
    ("qwen3", {"rope_parameters": [1, 2]}, "rope_parameters must be an object"),
    ("qwen3", {"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ("qwen3", {"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer"),
    ("qwen3", {"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a positive number"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer"),
    ("qwen3_moe", {"mlp_only_layers": "0"}, "mlp_only_layers must be a list of integers"),
    ("qwen3_moe", {"num_experts_per_tok": 99}, "num_experts_per_tok=99 exceeds the 8 experts"),
])
def test_a_bad_field_is_named(dirs, tmp_path, model, fields, message):
    path = with_fields(dirs[model], tmp_path / "ckpt", **fields)
    with pytest.raises(CheckpointError, match=message):
        load_config(path)


def test_an_index_whose_weight_map_is_not_an_object(dirs, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(dirs["qwen3"], path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": [1, 2]}))
    with pytest.raises(CheckpointError, match="weight_map must map tensor names to file names"):
        safetensors_files(path)


def test_an_unwritable_logits_out_is_refused_before_the_run(dirs, tmp_path, capsys,
                                                            restore_logger):
    from layer_boundary.engine.cli import main

    code = main(["run", "--model", str(dirs["qwen3"]), "--tp", "1", "--dp", "1",
                 "--logits-out", str(tmp_path / "missing" / "logits.safetensors")])
    assert code == 2
    assert "--logits-out" in capsys.readouterr().err


# the shared fields' hostile values: each architecture goes through the same check, whether
# or not its model reads the field (id, fields put in, the error's text)
SHARED_HOSTILE = [
    ("theta", {"rope_theta": -1.0}, "field rope_theta must be a positive number, got -1.0"),
    ("dict-theta", {"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}},
     "rope_parameters.rope_theta must be a positive number, got -1.0"),
    ("fraction", {"partial_rotary_factor": 2.0},
     "field partial_rotary_factor must be a number in (0, 1]"),
    ("dict-fraction", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                           "partial_rotary_factor": 0}},
     "rope_parameters.partial_rotary_factor must be a number in (0, 1], got 0"),
    ("factor", {"rope_scaling": {"rope_type": "linear", "factor": -2.0}},
     "rope_scaling.factor must be a positive number, got -2.0"),
    ("rope-string", {"rope_scaling": "linear"},
     "field rope_scaling must be an object, got 'linear'"),
    ("vocab-huge", {"vocab_size": 2 ** 63},
     "field vocab_size=9223372036854775808 is beyond any model"),
    ("vocab-zero", {"vocab_size": 0}, "field vocab_size must be a positive integer, got 0"),
    ("head-dim", {"head_dim": -8}, "field head_dim must be a positive integer, got -8"),
    ("head-dim-string", {"head_dim": "64"},
     "field head_dim must be a positive integer, got '64'"),
    ("heads", {"num_attention_heads": 0},
     "field num_attention_heads must be a positive integer, got 0"),
    ("kv-heads", {"num_key_value_heads": True},
     "field num_key_value_heads must be a positive integer, got True"),
    ("head-groups", {"num_attention_heads": 6, "num_key_value_heads": 4},
     "field num_attention_heads=6 is not a multiple of num_key_value_heads=4"),
    ("positions", {"max_position_embeddings": 0},
     "field max_position_embeddings must be a positive integer, got 0"),
    ("window", {"sliding_window": -1}, "field sliding_window must be a positive integer, got -1"),
    ("window-string", {"sliding_window": "4096"},
     "field sliding_window must be a positive integer, got '4096'"),
    ("experts", {"n_routed_experts": 0}, "field n_routed_experts must be a positive integer"),
    ("local-experts", {"num_local_experts": -4},
     "field num_local_experts must be a positive integer, got -4"),
    ("top-k", {"num_experts_per_tok": 0},
     "field num_experts_per_tok must be a positive integer, got 0"),
    ("top-k-past-experts", {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
                            "num_experts_per_tok": 999},
     "field num_experts_per_tok=999 exceeds the 4 experts"),
    ("expert-size", {"moe_intermediate_size": -1},
     "field moe_intermediate_size must be a positive integer, got -1"),
    ("rms-eps", {"rms_norm_eps": -1e-6}, "field rms_norm_eps must be a positive number"),
    ("ln-eps", {"layer_norm_eps": 0}, "field layer_norm_eps must be a positive number, got 0"),
    ("ln-epsilon", {"layer_norm_epsilon": "1e-5"},
     "field layer_norm_epsilon must be a positive number, got '1e-5'"),
    ("eps-nan", {"norm_epsilon": float("nan")},
     "field norm_epsilon must be a positive number, got nan"),
    ("eps-inf", {"rms_norm_eps": float("inf")},
     "field rms_norm_eps must be a positive number, got inf"),
    ("interleave-string", {"rope_interleave": "x"},
     "field rope_interleave must be true or false, got 'x'"),
    ("topk-method-object", {"topk_method": {}}, "field topk_method must be a string, got {}"),
]


def every_architecture() -> dict:
    """model_type -> (transformers config class, tiny fields) for every registered
    architecture: tests/model_configs.py's, and the ones its construction tests leave out."""
    from checkpoints import TINY
    from checkpoints.deepseek_v2 import TINY_DS2
    from checkpoints.glm4_moe import TINY_GLM
    from checkpoints.gpt_oss import TINY_GPT_OSS
    from checkpoints.mixtral import ROTARY_DIM, TINY_MIXTRAL
    from checkpoints.olmo import TINY_OLMO
    from checkpoints.qwen3_next import TINY_35, TINY_35_MOE
    from model_configs import CONFIGS

    from layer_boundary.models.registry import model_types

    every = {**CONFIGS,
             "deepseek_v2": ("DeepseekV2Config", TINY_DS2),
             "glm4_moe": ("Glm4MoeConfig", TINY_GLM),
             "gpt_oss": ("GptOssConfig", TINY_GPT_OSS),
             "minimax_m2": ("MiniMaxM2Config", dict(TINY_MIXTRAL, rotary_dim=ROTARY_DIM)),
             "mistral": ("MistralConfig", TINY),
             "mixtral": ("MixtralConfig", TINY_MIXTRAL),
             "olmo2": ("Olmo2Config", TINY_OLMO),
             "qwen3_5": ("Qwen3_5TextConfig", TINY_35),
             "qwen3_5_moe": ("Qwen3_5MoeTextConfig", TINY_35_MOE)}
    assert set(every) == set(model_types())
    return every


def test_every_architectures_tiny_config_passes_the_checks():
    """The walk below starts from valid configs: each one's refusal is the hostile value's."""
    import transformers

    from layer_boundary.models.registry import model_class

    for model_type, (cls_name, tiny) in every_architecture().items():
        model_class(model_type).config_class.validate(getattr(transformers, cls_name)(**tiny)
                                                      .to_dict())


@pytest.mark.parametrize("fields,message", [c[1:] for c in SHARED_HOSTILE],
                         ids=[c[0] for c in SHARED_HOSTILE])
def test_every_architecture_refuses_the_shared_fields_hostile_values(fields, message):
    """Every registered architecture, from its tiny transformers config with the hostile
    value put in: the one shared check names it (glm4_moe, deepseek_v2 and
    minimax_m2 ran a negative top-level theta; every model a negative one in its rope dict)."""
    import transformers

    from layer_boundary.models.registry import model_class

    for model_type, (cls_name, tiny) in every_architecture().items():
        raw = {**getattr(transformers, cls_name)(**tiny).to_dict(), **fields}
        with pytest.raises(CheckpointError, match=re.escape(message)):
            model_class(model_type).config_class.validate(raw)


def test_every_registered_architecture_declares_only_its_own_fields():
    """The shared fields are checked in one place: a config class re-declares one only as a
    named override (Qwen3-Next's num_experts, where 0 is a dense model), never as a laxer
    copy (Llama's partial_rotary_factor accepted 2.0 once)."""
    from layer_boundary.models.config import SHARED
    from layer_boundary.models.registry import model_class, model_types

    for model_type in model_types():
        cls = model_class(model_type).config_class
        assert not set(cls.fields) & set(SHARED), (model_type, set(cls.fields) & set(SHARED))
        assert set(cls.shared_overrides) <= set(SHARED), model_type


ODD = {"null": None, "nan": float("nan"), "negative": -1, "string": "x", "list": [1],
       "object": {}}
# (architecture, field, odd value) a model reads and accepts, meaning what transformers'
# config means by it
READ_AS_TRANSFORMERS_READS = {
    ("qwen3_moe", "mlp_only_layers", "list"),  # [1]: layer 1 is dense
    # a floor on time steps, below the softplus's positive range: none (transformers' -1.0)
    ("nemotron_h", "time_step_min", "negative"),
}
# (architecture, field, odd value) a model reads and accepts otherwise: silent misreads not yet
# refused (the walk fails when one is fixed and not struck off here, or when a new one appears)
MISREAD: set = set()


@pytest.mark.parametrize("model_type", ["cohere", "cohere2"])
def test_a_rope_left_out_reads_the_theta_transformers_reads(model_type):
    """Cohere's default theta is 5e5 in transformers (its ``default_theta``), Cohere2's the
    base 1e4: a config.json without a rope (or with an empty rope dict) reads the same here."""
    import transformers

    from layer_boundary.models.registry import model_class

    hf = transformers.AutoConfig.for_model(model_type)
    base = {k: v for k, v in hf.to_dict().items() if k not in ("rope_parameters", "rope_theta")}
    config_class = model_class(model_type).config_class
    for cfg in (base, {**base, "rope_parameters": {}}):
        ours = config_class.from_dict(cfg)
        assert ours.rope_theta == hf.rope_parameters["rope_theta"], (cfg, ours.rope_theta)


def test_a_nan_time_step_floor_is_refused_by_name():
    """Nemotron-H's prefill clamps its time steps at time_step_min: a nan made every one nan."""
    import transformers

    from layer_boundary.models.registry import model_class

    cls_name, tiny = every_architecture()["nemotron_h"]
    raw = {**getattr(transformers, cls_name)(**tiny).to_dict(), "time_step_min": float("nan")}
    config_class = model_class("nemotron_h").config_class
    with pytest.raises(CheckpointError, match="^config.json field time_step_min must be a "
                                              "finite number, got nan$"):
        config_class.validate(raw)
        config_class.from_dict(raw)


def _parsed(config_class, raw):
    """The config ``raw`` builds, or None where it is refused by name."""
    try:
        config_class.validate(raw)
        return config_class.from_dict(raw)
    except CheckpointError:
        return None


@pytest.mark.parametrize("name", list(ODD))
def test_any_field_of_any_architecture_is_read_or_refused_by_name(name):
    """Each field of every architecture's config.json set to one odd value: the config is
    refused with a ``CheckpointError``, never a traceback (a null rms_norm_eps or logit_scale
    ended in float(None); a list scoring_func in an unhashable lookup), or accepted where the
    model does not read the field (the config it builds is the same, and so with another
    value) or reads the value as transformers does. A value read otherwise is a silent
    misread (DeepSeek-V3's rope_interleave "x" read as true, a nan time_step_min, V2's
    topk_method {} as greedy). Which nulls must be refused: the walk below."""
    import transformers

    from layer_boundary.models.registry import model_class

    read = set()
    for model_type, (cls_name, tiny) in every_architecture().items():
        config_class = model_class(model_type).config_class
        base = getattr(transformers, cls_name)(**tiny).to_dict()
        built = _parsed(config_class, base)
        for field, value in base.items():
            got = _parsed(config_class, {**base, field: copy.deepcopy(ODD[name])})
            if got is None or name == "null":
                continue
            other = _other(value)
            if got != built or (other is not None and _parsed(config_class, {**base, field: other})
                                not in (None, built)):
                read.add((model_type, field, name))
    expected = {case for case in READ_AS_TRANSFORMERS_READS | MISREAD if case[2] == name}
    assert read == expected, (f"accepted and read: {sorted(read - expected)}; listed, but "
                              f"refused or not read: {sorted(expected - read)}")


# (architecture, fields) whose null transformers' config refuses while another architecture's
# reads None as "none" (a derived head_dim, as many kv heads as heads, a flag's default): the
# architecture's config class must say so (``not_null``); these do not yet, and read the null
# as the field's default. The walk below fails when one is fixed and not struck off here, or
# when a new one appears.
NULL_READ_AS_DEFAULT = {
    "deepseek_v2": {"first_k_dense_replace"},
    "exaone4": {"num_key_value_heads"},
    "gemma3_text": {"head_dim", "num_key_value_heads"},
    "glm4_moe": {"first_k_dense_replace", "norm_topk_prob", "num_key_value_heads",
                 "use_qk_norm"},
    "gpt_oss": {"head_dim"},
    "inkling_text": {"head_dim", "num_experts_per_tok", "num_key_value_heads"},
    "minimax_m2": {"head_dim", "num_key_value_heads"},
    "mistral": {"num_key_value_heads"},
    "mixtral": {"num_key_value_heads"},
    "nemotron_h": {"head_dim", "norm_topk_prob", "num_key_value_heads"},
    "qwen3": {"head_dim"},
    "qwen3_5": {"num_key_value_heads"},
    "qwen3_5_moe": {"num_key_value_heads"},
    "qwen3_5_moe_text": {"num_key_value_heads"},
    "qwen3_5_text": {"num_key_value_heads"},
    "qwen3_moe": {"norm_topk_prob", "num_key_value_heads"},
    "qwen3_next": {"norm_topk_prob", "num_key_value_heads"},
}


def _other(value):
    """Another valid-looking value of a field, to see whether the model reads it."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 if value else 1
    return None


def test_a_null_transformers_refuses_is_refused_wherever_a_model_reads_the_field():
    """Each field of every architecture's config.json set to null, against transformers'
    config class. Where transformers refuses the null and the model reads the field (another
    value changes the config it builds), the null is refused by name: the reader's default
    stood in for it (Phi-3's rms_norm_eps: null ran with 1e-5; Mixtral's, Inkling's and
    DeepSeek-V4's eps, a tie_word_embeddings read as false, Inkling's sizes, DeepSeek-V4's
    hc_eps). Every name ``NOT_NULL`` refuses, transformers refuses on each architecture that
    has it, so no config transformers loads is refused for a null."""
    import transformers

    from layer_boundary.models.config import NOT_NULL
    from layer_boundary.models.registry import model_class

    def parse(config_class, raw):
        try:
            config_class.validate(raw)
            return config_class.from_dict(raw)
        except CheckpointError:
            return None

    holes, seen = {}, set()
    for model_type, (cls_name, tiny) in every_architecture().items():
        hf_class = getattr(transformers, cls_name)
        config_class = model_class(model_type).config_class
        base = hf_class(**tiny).to_dict()
        built = parse(config_class, base)

        def hf_refuses(raw):
            try:
                hf_class.from_dict(raw)
            except Exception:
                return True
            return False

        for field, value in base.items():
            raw = {**base, field: None}
            if field in NOT_NULL | config_class.not_null:
                seen.add(field)
                assert hf_refuses(raw), (model_type, field)
                continue
            other = _other(value)
            if (other is None or parse(config_class, raw) is None
                    or parse(config_class, {**base, field: other}) == built):
                continue  # refused, or not read
            if hf_refuses(raw):
                holes.setdefault(model_type, set()).add(field)
    assert seen == NOT_NULL
    assert holes == NULL_READ_AS_DEFAULT


def test_phi3s_null_rms_norm_eps_is_refused_by_name(tmp_path):
    """The reported case through config.json: transformers' Phi3Config refuses it (a strict
    float); Phi-3 read it as 1e-5."""
    import transformers

    from checkpoints import TINY

    raw = {**transformers.Phi3Config(**TINY).to_dict(), "rms_norm_eps": None}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="^config.json field rms_norm_eps is null; "
                                              "transformers reads no null there"):
        load_config(tmp_path)
