"""A run spec against the table of combination rules (``layer_boundary.capabilities``): the
features it turns on, the facts the rules read, and the check ``run_rank`` and the command
line both make before anything is built, loaded or sent."""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
import torch.distributed as dist

from ..adapters.tbo import TboPolicy
from ..capabilities import CapabilityError, Feature, Setup, check
from .fusion_providers import FUSION_PROVIDERS

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
SPECULATIVE_ALGORITHMS = ("draft", "nextn")
DEVICES = ("cpu", "cuda")


def features_of(spec) -> frozenset:
    """The features ``spec`` (a ``RunSpec`` with its checkpoints read) turns on."""
    on = {Feature.CP: spec.cp > 1,
          Feature.SEQUENCE_PARALLEL: spec.sequence_parallel,
          Feature.INPUT_SCATTERED: spec.attn_input_scattered,
          Feature.MOE_A2A: spec.moe_a2a_backend != "none",
          Feature.PIPELINE: spec.pp > 1,
          Feature.TBO: spec.tbo is not TboPolicy.OFF,
          Feature.SPLIT_PREFILL: spec.split_prefill > 1,
          Feature.COMPILE: spec.compile is not None,
          Feature.SPECULATIVE: spec.speculative,
          Feature.LORA: bool(spec.lora),
          Feature.FP8: bool(getattr(getattr(spec.checkpoint, "config", None), "fp8_block",
                                    None)),
          Feature.FUSIONS: spec.fusions is not None,
          Feature.BATCH_INVARIANT: spec.batch_invariant}
    return frozenset(f for f, yes in on.items() if yes)


def setup_of(spec) -> Setup:
    """What the rules read of ``spec``: its features, model, topology, resolved policy and
    draft."""
    target, draft = spec.checkpoint, spec.draft_checkpoint
    return Setup(features_of(spec), target.model_class, target.config, spec.dims(),
                 target.boundary_reduction(spec.boundary_reduction),
                 draft=None if draft is None else draft.model_class,
                 draft_config=None if draft is None else draft.config,
                 nextn=spec.speculative_algorithm == "nextn", folder=spec.model_dir)


def check_spec(spec) -> None:
    """Refuse ``spec`` (a ``RunSpec`` with its checkpoints read) by name if its options are
    malformed or the library does not run its combination (``capabilities.CapabilityError``):
    one line, before any rank builds, loads or sends anything.

    Args:
        spec: the run.
    """
    if spec.compile is not None and spec.compile not in COMPILE_BACKENDS:
        raise ValueError(f"compile backend {spec.compile!r} is not one of "
                         f"{', '.join(COMPILE_BACKENDS)}")
    if spec.fusions is not None and spec.fusions not in FUSION_PROVIDERS:
        raise ValueError(f"unknown fusion provider {spec.fusions!r} (known: "
                         f"{', '.join(FUSION_PROVIDERS)})")
    if spec.device not in DEVICES:
        raise ValueError(f"device {spec.device!r} is not one of {', '.join(DEVICES)}")
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible "
                         "(torch.cuda.is_available() is False)")
    algorithm = spec.speculative_algorithm
    if algorithm is not None and algorithm not in SPECULATIVE_ALGORITHMS:
        raise ValueError(f"speculative_algorithm {algorithm!r} is not one of "
                         f"{', '.join(SPECULATIVE_ALGORITHMS)}")
    if algorithm == "draft" and spec.draft_model is None:
        raise ValueError("--speculative-algorithm draft needs --draft-model")
    if algorithm == "nextn" and spec.draft_model is not None:
        raise ValueError("--speculative-algorithm nextn drafts with the target's own NextN "
                         "layer: drop --draft-model")
    if spec.speculative and spec.speculative_steps < 1:
        raise ValueError(f"--speculative-steps must be at least 1, got {spec.speculative_steps}")
    _check_triton(spec)
    _check_compiled_transport(spec)
    check(setup_of(spec))


def _installed(package: str) -> bool:
    """Whether ``package`` imports (or would), without importing it."""
    if package in sys.modules:
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


def _check_triton(spec) -> None:
    """The Triton provider's needs, before any rank imports it: the triton package. (A compiled
    forward calls its kernels as custom ops, ``runtime.kernel_ops``, so under the Triton
    interpreter on the CPU too.)"""
    if spec.fusions != "triton":
        return
    if not _installed("triton"):
        raise CapabilityError("--fusions triton needs the triton package, which is not "
                              "installed (pip install triton)")


def backend_for(device: str, ranks_here: int) -> str:
    """The ranks' backend: NCCL where each of this host's ``ranks_here`` ranks has a GPU of
    its own, else gloo (CPU tensors, or CUDA tensors of ranks that share a GPU)."""
    if device == "cuda" and torch.cuda.device_count() >= ranks_here:
        return "nccl"
    return "gloo"


def _shares_gpus(spec) -> bool:
    """Whether ``spec``'s CUDA ranks run over gloo: the backend the ranks joined with where
    they have, else the one ``backend_for`` gives the ranks on this host."""
    if dist.is_initialized():
        return dist.get_backend() == "gloo"
    return backend_for(spec.device, int(os.environ.get("LOCAL_WORLD_SIZE",
                                                       spec.world_size))) == "gloo"


def _check_compiled_transport(spec) -> None:
    """A compiled forward on CUDA tensors whose collectives run over gloo: on an H200 (torch
    2.11) ``run --device cuda --tp 2 --compile`` and ``... --dp 2 rsv --compile`` ended
    without a reason the command kept (scripts/gpu_check.py's "compiled over gloo" row runs
    it through the library, to read one); refused by name until a GPU run shows it works."""
    if spec.device != "cuda" or spec.compile is None or spec.world_size == 1:
        return
    if _shares_gpus(spec):
        raise CapabilityError(
            f"--compile with --device cuda over gloo ({spec.world_size} ranks sharing "
            f"{torch.cuda.device_count()} GPU(s)) is not run yet: its compiled collectives on "
            "CUDA tensors failed on a GPU; give each rank its own GPU (NCCL) or drop --compile")


def check_draft(target_cfg, draft_cfg, draft_cls, dims) -> None:
    """A draft checkpoint against its target: the target's vocabulary, a topology it shards
    over, a positional KV cache (the draft rules of ``capabilities.MODEL_RULES``).

    Args:
        target_cfg, draft_cfg: the two parsed configs.
        draft_cls: the draft's model class.
        dims: the ``ParallelDims`` both run on.
    """
    check(Setup(frozenset({Feature.SPECULATIVE}), config=target_cfg, dims=dims,
                draft=draft_cls, draft_config=draft_cfg))


__all__ = ["CapabilityError", "backend_for", "check_draft", "check_spec", "features_of",
           "setup_of"]
