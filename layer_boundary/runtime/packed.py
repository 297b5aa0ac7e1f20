"""Linear weights laid out once, at load, for the CPU's matmul kernels.

A CPU matmul through ``F.linear`` (MKL) re-packs the weight panel on every call; at the row
counts of decoding and of short prefills that packing costs as much as the product, and the
weights stream from memory twice. Engines that serve on CPUs pack each weight once in the
layout the matmul kernel reads (oneDNN's reordered weights, as inductor's freezing pass and
the CPU backends of serving engines do); a packed linear ran faster at each row count
measured, 16 to 256 (docs/benchmarks.md, "Figures behind the runtime's choices").

A single row is a matrix-vector product, which the layout laid out for 16 rows serves no
better than MKL. There the lever is the plain weight's own layout: MKL reads a weight stored
[in, out] row-major (``weight.t()`` contiguous) as a plain product and streams it, where the
usual [out, in] storage takes its transposed path. For a wide weight (more outputs than
inputs) the transposed storage ran a one-row step's matmuls faster, from memory and from
cache alike; for a narrow weight (fewer outputs, such as ``down_proj``) it was slower, so
those stay as they are. oneDNN's product on the plain weight, tried before, was no better at
one row overall (the figures: docs/benchmarks.md).

Decided at construction: ``pack_linears(model)`` (called by ``models.load_model`` once the
weights are in), for each tensor-parallel linear and LM head whose weight lives on the CPU in
float32 or bfloat16, (1) stores a wide weight's elements transposed, in place: the parameter
keeps its [out, in] shape and values (a strided view; no extra memory), and (2) gives a
weight of more than ``PACK_MIN`` elements a packed copy, when torch's oneDNN is available.
Selected at forward by ``linear``, in eager inference: several rows run on the packed copy,
one row through ``F.linear`` on the (re-laid) plain weight. ``F.linear`` runs everywhere
else: a compiled graph (its backend chooses its own kernels, on the same strided weight),
autograd, a mismatched input dtype, a weight reassigned or rewritten in place since it was
packed (which the copy would not reflect). The packed copy costs one more copy of each packed
weight in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .invariant import BATCH_INVARIANT

ROWS_HINT = 16  # the row count oneDNN lays the weight out for; any row count runs on it
# oneDNN's fixed work per call is about what MKL's whole product costs for a small weight
# (docs/benchmarks.md): only weights of more than this many elements are packed
PACK_MIN = 1 << 16
PACKED_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class PackedWeight:
    """A weight's copy in oneDNN's blocked layout, with what identifies the weight it copies."""

    tensor: torch.Tensor  # opaque (mkldnn layout); only ``linear`` reads it
    data_ptr: int  # the weight's storage when packed: a reassigned weight no longer matches
    version: int  # the weight's version counter when packed: an in-place write moves it


def packable(weight: torch.Tensor, min_elements: int | None = None) -> bool:
    """Whether ``weight`` [out, in] gets a packed copy: a CPU float32/bfloat16 matrix of more
    than ``min_elements`` elements (None: ``PACK_MIN``), with torch's oneDNN available. Not an
    inference tensor (made under ``torch.inference_mode``): it keeps no version counter, so a
    write into it could not be told from the copy."""
    least = PACK_MIN if min_elements is None else min_elements
    return _host_weight(weight) and _worth_packing(weight, least)


def _host_weight(weight: torch.Tensor) -> bool:
    # a CPU weight whose writes and reassignments can be seen: not an inference tensor
    return weight.device.type == "cpu" and not weight.is_inference()


def _float_matrix(weight: torch.Tensor) -> bool:
    return weight.dtype in PACKED_DTYPES and weight.dim() == 2


def _worth_packing(weight: torch.Tensor, least: int) -> bool:
    # what packing asks of a weight wherever it was built (``packed_bytes`` reads meta ones)
    return (_float_matrix(weight) and weight.numel() > max(least, 0)
            and torch.backends.mkldnn.is_available())


def pack(weight: torch.Tensor, min_elements: int | None = None) -> PackedWeight | None:
    """``weight``'s packed copy, or None where it is not ``packable`` (``min_elements`` None:
    ``PACK_MIN``)."""
    if not packable(weight, min_elements):
        return None
    w = weight.detach()
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w, ROWS_HINT), w.data_ptr(),
                        w._version)


def stores_transposed(weight: torch.Tensor) -> bool:
    """Whether ``pack_linears`` stores ``weight`` [out, in] transposed: a CPU float32/bfloat16
    matrix with more outputs than inputs, stored contiguously (once re-laid it no longer is,
    so a second call leaves it), not an inference tensor (its storage cannot be swapped)."""
    return (_host_weight(weight) and _float_matrix(weight)
            and weight.shape[0] > weight.shape[1] and weight.is_contiguous())


def store_transposed(weight: torch.nn.Parameter) -> None:
    """Re-lay ``weight``'s elements as [in, out] row-major, in place: same shape, values and
    parameter object (anything holding it, a tied embedding too, sees the new storage); the
    old storage is freed once nothing else holds it."""
    weight.data = weight.detach().t().contiguous().t()


def pack_linears(model: torch.nn.Module, min_elements: int | None = None) -> int:
    """Lay out the weight of every module of ``model`` that declares ``packs_weight`` (the
    tensor-parallel linears, the LM head) for the CPU's kernels: a wide one stored transposed
    (``stores_transposed``), and a packed copy, replacing any earlier one. Call it again after
    rewriting weights in place through ``.data``.

    Args:
        model: the loaded model (or any module holding such layers).
        min_elements: pack weights of more elements than this (None: ``PACK_MIN``, where
            packing pays; 0 packs every one, as the tests do to run tiny models on it).

    Returns:
        How many weights were packed.
    """
    count = 0
    for module in model.modules():
        if getattr(type(module), "packs_weight", False):
            if stores_transposed(module.weight):
                store_transposed(module.weight)
            module.packed = pack(module.weight, min_elements)
            count += module.packed is not None
    return count


def refresh_packed(model: torch.nn.Module) -> int:
    """Pack again each packed weight of ``model`` written since it was packed (``pack_linears``
    packed it, so it qualifies whatever its size); returns how many. A stale copy is never
    read (``linear`` checks), but the weight's matmuls run unpacked until this runs."""
    count = 0
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if packed is not None and getattr(type(module), "packs_weight", False):
            weight = module.weight
            if packed.data_ptr != weight.data_ptr() or packed.version != weight._version:
                module.packed = pack(weight, 0)
                count += 1
    return count


def packed_bytes(model: torch.nn.Module) -> int:
    """The bytes ``pack_linears`` (at ``PACK_MIN``) would add on the CPU for ``model`` (built
    anywhere, the meta device included): one copy of each weight it packs, each shared one
    once."""
    seen, total = set(), 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (getattr(type(module), "packs_weight", False) and weight is not None
                and id(weight) not in seen and _worth_packing(weight, PACK_MIN)):
            seen.add(id(weight))
            total += weight.numel() * weight.element_size()
    return total


def linear(module: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear(x, module.weight, bias)``, on the module's packed copy where it applies (the
    module docstring). A compiled graph never reads the packed copy (it is not traced)."""
    weight = module.weight
    if torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    if BATCH_INVARIANT.on:  # the plain product, which the mode runs a row at a time
        return F.linear(x, weight, bias)
    packed = module.packed
    if (packed is None or x.dtype != weight.dtype or x.requires_grad
            or packed.data_ptr != weight.data_ptr() or packed.version != weight._version):
        return F.linear(x, weight, bias)
    if x.numel() == x.shape[-1]:  # one row: a matrix-vector product, on the plain weight
        return F.linear(x, weight, bias)
    return _matmul(x, packed.tensor, bias)


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # oneDNN's linear on the packed (mkldnn-layout) copy
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
