"""The model-facing ``StageBoundary``: prepare a stage's input, publish its output."""

from __future__ import annotations

import torch

from .construction import build_plan
from .contracts import ProducerReduction, StageKind
from .exit import FfnExit, MixerExit
from .layout import Rows
from .residual.stream import IN_COMPUTE, OwedOutput, StreamState
from .runtime.args import get_runtime
from .runtime.ledger import LEDGER

START_FIRST = "start the layer stack before entering a stage"
BRANCH_ENTRY = "a prepared branch must enter through branch_input, not prepare"


class _Fp32Norm:
    """Adapter for a norm without an fp32 entry point: rounds the fp32 sum, then normalises."""

    def __init__(self, norm) -> None:
        self.norm = norm

    def __call__(self, x):
        return self.norm(x)

    def normalize_fp32(self, x32, out_dtype):
        return self.norm(x32.to(out_dtype))


def stream_of(forward_batch):
    stream = forward_batch.residual_stream
    if stream is None:
        raise RuntimeError(START_FIRST)
    return stream


class StageBoundary:
    """One stage's boundary: its own norm, its prebuilt plan, no forward tensors."""

    def __init__(self, declaration, norm, *, following=None, runtime=None, name=None,
                 fusions=None, qkv_latent_func=None) -> None:
        runtime = runtime if runtime is not None else get_runtime()
        self.declaration = declaration
        self.following = following
        self.name = name or declaration.kind.value
        self.norm = norm if hasattr(norm, "normalize_fp32") else _Fp32Norm(norm)
        self.fusions = fusions
        self.qkv_latent_func = qkv_latent_func
        self.plan = build_plan(self.name, declaration, self.norm, following, runtime,
                               qkv_latent_func=qkv_latent_func, fusions=fusions)
        self._update = declaration.residual.update
        self._prepare_site = f"{self.name}.prepare"
        self._compute_site = f"{self.name}.compute"
        self._finish_site = f"{self.name}.finish"
        self._is_partial = declaration.reduction is ProducerReduction.PARTIAL
        self._exit_cls = FfnExit if declaration.kind is StageKind.FFN else MixerExit

    def __repr__(self) -> str:
        return f"StageBoundary({self.name}: {self.declaration.describe()})"

    def prepare(self, hidden_states, forward_batch, *, capture_output=None):
        """Complete what the previous producer owes, apply its update, read this stage's input."""
        if self.declaration.prepared_from is not None:
            raise RuntimeError(BRANCH_ENTRY)
        if capture_output is not None and self.declaration.kind is not StageKind.ATTN:
            raise TypeError("FFN prepare() does not accept capture_output")
        stream = stream_of(forward_batch)
        path, rows = self.plan.select(forward_batch)
        LEDGER.site = self._prepare_site
        if capture_output is not None and stream.state is StreamState.INITIAL:
            capture_output(hidden_states, owned=False)  # stack entry: the input, before enter
            capture_output = None
        compute_input = path.entry.run(stream, hidden_states, rows)
        if capture_output is not None:
            # the updated residual, back on the producer's (local) rows
            if stream.residual_rows is Rows.LOCAL:
                capture_output(stream.residual, owned=False)
            else:
                capture_output(rows.scattered_to_local(stream.residual), owned=True)
        if LEDGER.traces is not None:
            LEDGER.trace(self._prepare_site, stream, rows)
        LEDGER.site = self._compute_site
        return compute_input

    def finish(self, hidden_states, forward_batch):
        """Publish a PARTIAL attention's contribution; returns the handle to pass on."""
        if not self._is_partial:
            raise RuntimeError(f"stage {self.name} is {self.declaration.reduction.value}: "
                               "publish its output through exit(), not finish()")
        stream = stream_of(forward_batch)
        if stream.handle is not IN_COMPUTE:
            raise RuntimeError(f"finish() on stage {self.name} without its prepare()")
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"finish() takes the compute output tensor, got {type(hidden_states).__name__}")
        path, rows = self.plan.select(forward_batch)
        LEDGER.site = self._finish_site
        handle = stream.leave(hidden_states, path.exit.default.owed, self._update, Rows.LOCAL)
        if LEDGER.traces is not None:
            LEDGER.trace(self._finish_site, stream, rows)
        return handle

    def exit(self, forward_batch):
        """Scope for an FFN's or mixer's compute; call the returned object's finish() once."""
        if self._is_partial:
            raise RuntimeError(f"stage {self.name} is PARTIAL: publish its output with finish()")
        stream = stream_of(forward_batch)
        if stream.handle is not IN_COMPUTE:
            raise RuntimeError(f"exit() on stage {self.name} without its prepare()")
        path, _ = self.plan.select(forward_batch)
        return self._exit_cls(stream, path.exit, forward_batch, self._update, self._compute_site,
                              self._finish_site)

    def describe(self, mode=None) -> dict:
        """This stage's paths in row mode ``mode`` (default: all-reduce) as a table row."""
        return self.plan.describe() if mode is None else self.plan.describe(mode)


__all__ = ["StageBoundary", "OwedOutput", "START_FIRST", "BRANCH_ENTRY"]
