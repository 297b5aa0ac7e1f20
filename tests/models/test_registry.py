"""Models declare themselves: each model file registers its class for a ``model_type``, and
what the command line, the runner, the loader and the draft checks need to know about an
architecture is read from that class, never from a list of names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from layer_boundary.models import boundary_reduction, model_class, model_types
from layer_boundary.models.base import CausalLM
from layer_boundary.models.config import CheckpointError

PACKAGE = Path(__file__).resolve().parents[2] / "layer_boundary"
REFERENCE = ("deepseek_v3", "deepseek_v4", "longcat_flash", "nemotron_h", "qwen3", "qwen3_moe")


def test_every_reference_architecture_registers_itself():
    assert set(REFERENCE) <= set(model_types())
    for model_type in model_types():
        cls = model_class(model_type)
        assert issubclass(cls, CausalLM) and cls.model_type == model_type
        assert cls.config_class.fields, model_type  # the config fields it reads, checked


def test_capabilities_come_from_the_model_class():
    raw = {"model_type": "qwen3"}
    assert boundary_reduction("auto", raw) == model_class("qwen3").boundary_reduction
    assert boundary_reduction("ar", raw) == "ar"
    assert not model_class("nemotron_h").positional_cache
    assert not model_class("deepseek_v4").positional_cache
    assert model_class("qwen3").positional_cache


def test_an_unknown_model_type_names_the_supported_ones():
    with pytest.raises(CheckpointError, match="model_type 'gpt_neo' is not supported "
                                              r"\(supported: .*qwen3"):
        model_class("gpt_neo")


@pytest.mark.parametrize("module", [
    *sorted(str(p.relative_to(PACKAGE)) for p in (PACKAGE / "engine").glob("*.py")
            if p.name != "bench.py"),  # the bench times one architecture on purpose
    "models/loader.py", "models/__init__.py", "models/checkpoint.py", "runtime/args.py",
    "capabilities.py", "runtime/capabilities.py"])
def test_no_shared_module_names_an_architecture(module):
    """Adding a model touches its own file: the shared modules hold no model_type string."""
    tree = ast.parse((PACKAGE / module).read_text())
    names = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
             and isinstance(node.value, str)}
    assert not names & set(model_types()), (module, names & set(model_types()))


def test_auto_resolves_by_architecture_then_model_type_then_text_config():
    from layer_boundary.models import auto_policy

    assert auto_policy({"architectures": ["Qwen3NextForCausalLM"], "model_type": "unknown"}) == (
        model_class("qwen3_next").boundary_reduction, "architectures: Qwen3NextForCausalLM")
    # an architecture no model declares: the model_type's class
    assert auto_policy({"architectures": ["SomethingElse"], "model_type": "llama"}) == (
        model_class("llama").boundary_reduction, "model_type: llama")
    # a multimodal wrapper nobody serves, around a text model somebody does
    assert auto_policy({"model_type": "wrapper", "text_config": {"model_type": "qwen3_5_text"}}
                       ) == (model_class("qwen3_5_text").boundary_reduction,
                             "text_config.model_type: qwen3_5_text")
    with pytest.raises(CheckpointError, match="^config.json model_type 'wrapper' is not "
                                              "supported"):
        auto_policy({"model_type": "wrapper"})
    for model_type in model_types():  # every model declares its own architectures
        cls = model_class(model_type)
        for name in cls.architectures:
            assert auto_policy({"architectures": [name]})[1] == f"architectures: {name}"
