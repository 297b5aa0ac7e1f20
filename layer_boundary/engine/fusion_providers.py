"""The fusion providers ``run --fusions`` can name, in one table: the parser's choices, the
combination check and the factory that installs one all read it, so a provider added here is
known to all three.

Importing this module imports neither torch nor a provider: ``--help`` reads the names before
torch loads, and the Triton provider must not load before the command line has chosen the
Triton interpreter.
"""

from __future__ import annotations

from importlib import import_module
from typing import NamedTuple


class FusionProvider(NamedTuple):
    """Where a provider's class lives (a module of ``layer_boundary.fusions``) and the
    options it is built with."""

    module: str
    cls: str
    options: tuple = ()  # (keyword, value) pairs


PROVIDERS = {
    "reference": FusionProvider("reference", "ReferenceFusions"),
    "reference-terminal": FusionProvider("reference", "ReferenceFusions",
                                         (("terminal_finalize", True),)),
    "decline": FusionProvider("reference", "ReferenceFusions", (("decline", True),)),
    # it compiles its kernels for CUDA, or runs them under the Triton interpreter on the CPU
    "triton": FusionProvider("triton_provider", "TritonFusions", (("terminal_finalize", True),)),
}

FUSION_PROVIDERS = tuple(PROVIDERS)


def make_fusions(name: str | None):
    """The fusion provider ``name`` (one of ``FUSION_PROVIDERS``) names, built; None for
    None."""
    if name is None:
        return None
    if name not in PROVIDERS:
        raise ValueError(f"unknown fusion provider {name!r} (known: "
                         f"{', '.join(FUSION_PROVIDERS)})")
    provider = PROVIDERS[name]
    cls = getattr(import_module(f"..fusions.{provider.module}", __package__), provider.cls)
    return cls(**dict(provider.options))
