"""Which model class serves a checkpoint's ``model_type``: each model file registers its own.

A model declares itself in its own file, on its class, with ``@register_model``:

    @register_model
    class LlamaForCausalLM(CausalLM):
        model_type = "llama"            # config.json's model_type
        config_class = LlamaConfig      # from_dict(raw) and the fields it reads (``fields``)
        boundary_reduction = "rs+rsv"   # what ``--boundary-reduction auto`` resolves to
        positional_cache = True         # a draft may use it: rejected tokens are overwritten

The command line, the runner, the loader and the draft checks read these facts here; none
of them names an architecture. The registry fills itself by importing every module of this
package once, on first use, so a new model file is found without being listed anywhere.
"""

from __future__ import annotations

import importlib
import pkgutil

from .config import CheckpointError

_MODELS: dict[str, type] = {}
_DISCOVERED = False


def register_model(cls: type) -> type:
    """Class decorator: ``cls`` serves checkpoints whose config.json has ``cls.model_type``."""
    model_type = getattr(cls, "model_type", None)
    if not isinstance(model_type, str) or getattr(cls, "config_class", None) is None:
        raise TypeError(f"{cls.__name__} must declare model_type and config_class to register")
    known = _MODELS.get(model_type)
    if known is not None and known is not cls:
        raise TypeError(f"model_type {model_type!r} is served by {known.__name__} already")
    _MODELS[model_type] = cls
    return cls


def _discover() -> None:
    global _DISCOVERED
    if _DISCOVERED:
        return
    for info in pkgutil.iter_modules(_package_path()):
        importlib.import_module(f"{__package__}.{info.name}")
    _DISCOVERED = True


def _package_path():
    return importlib.import_module(__package__).__path__


def model_types() -> list[str]:
    """Every registered ``model_type``, sorted."""
    _discover()
    return sorted(_MODELS)


def model_class(model_type) -> type:
    """The class serving ``model_type``, or the checkpoint error naming the supported ones."""
    _discover()
    cls = _MODELS.get(model_type)
    if cls is None:
        raise CheckpointError(f"config.json model_type {model_type!r} is not supported "
                              f"(supported: {', '.join(sorted(_MODELS))})")
    return cls
