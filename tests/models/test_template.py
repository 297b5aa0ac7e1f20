"""The model template stays flat: a model is a base and what differs, said in the hooks the
skeleton calls (``CausalLM``'s) and in its config's declared settings, never a chain of bases
or a copy of the skeleton's work."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from layer_boundary.models.base import CausalLM
from layer_boundary.models.config import POSITIVE_NUMBER, CheckpointError
from layer_boundary.models.registry import model_class, model_types
from layer_boundary.models.settings import PER_HEAD, DecoderConfig, Null, setting


def test_no_model_class_sits_more_than_two_levels_below_causal_lm():
    """CausalLM -> X -> Y at most (a mixin that is no CausalLM does not count): Cohere2 sat at
    four (Qwen3 -> Llama -> Cohere -> Cohere2)."""
    for model_type in model_types():
        cls = model_class(model_type)
        chain = [c.__name__ for c in cls.__mro__ if issubclass(c, CausalLM) and c is not CausalLM]
        assert len(chain) <= 2, (model_type, chain)


def test_the_skeleton_alone_builds_the_cache_and_the_two_ends():
    """Models declare their cache (``cache_layout``, ``cache_state``) and their embedding and
    head (``make_embedding``, ``make_head``); none builds a cache or swaps an end in its own
    way (there were ten ``make_kv_cache`` copies)."""
    for model_type in model_types():
        for cls in model_class(model_type).__mro__:
            if issubclass(cls, CausalLM) and cls is not CausalLM:
                assert "make_kv_cache" not in vars(cls), (model_type, cls.__name__)
                assert "__init__" not in vars(cls), (model_type, cls.__name__)


@dataclass(frozen=True)
class _Config(DecoderConfig):
    rms_norm_eps: float = setting(1e-6)
    scale: float = setting(2.0, POSITIVE_NUMBER, names=("scale", "multiplier"))
    head_dim: int = setting(derive=PER_HEAD, null=Null.REFUSE)


SIZES = dict(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=4)


def test_a_setting_reads_its_default_alias_derivation_and_null_as_declared():
    cfg = _Config.from_dict(dict(SIZES, multiplier=3))
    assert (cfg.rms_norm_eps, cfg.scale, cfg.num_key_value_heads, cfg.head_dim) == (
        1e-6, 3.0, 4, 4)
    assert _Config.fields == {"scale": POSITIVE_NUMBER, "multiplier": POSITIVE_NUMBER}
    with pytest.raises(CheckpointError, match="^config.json has no vocab_size$"):
        _Config.from_dict({**SIZES, "vocab_size": None})
    with pytest.raises(CheckpointError, match="^config.json field rms_norm_eps is null: give a "
                                              "number, or leave it out for the default 1e-06"):
        _Config.from_dict({**SIZES, "rms_norm_eps": None})
    with pytest.raises(CheckpointError, match="head_dim is null: .* hidden_size / num_attention"):
        _Config.from_dict({**SIZES, "head_dim": None})
    assert _Config.from_dict({**SIZES, "num_key_value_heads": None}).num_key_value_heads == 4
