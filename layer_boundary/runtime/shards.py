"""Checkpoint tensors a rank reads only in part: the rows or columns its shard keeps.

The loader hands each parameter's ``weight_loader`` a ``CheckpointSlice``: the tensor's
full shape and dtype from the safetensors header, and a reader of any block of it
(safetensors' ``get_slice``), so a sharded layer reads its shard and nothing else. A loader
takes what it keeps with ``take(loaded, dim, start, length)`` (or ``whole(loaded)``); both
accept a plain tensor as well. Every block read is checked finite and its bytes counted,
so a run can report what each rank read.
"""

from __future__ import annotations

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64,
          "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class CheckpointError(ValueError):
    """A missing, malformed or mismatched checkpoint; the message names the file or tensor."""


class ReadBytes:
    """What one load read from the checkpoint, in bytes."""

    def __init__(self) -> None:
        self.bytes = 0


class CheckpointSlice:
    """One checkpoint tensor, unread: ``shape``, ``dtype``, and ``read(index)``."""

    __slots__ = ("name", "shape", "dtype", "_slice", "_counter")

    def __init__(self, name: str, part, counter: ReadBytes | None = None) -> None:
        self.name, self._slice, self._counter = name, part, counter
        self.shape = torch.Size(part.get_shape())
        dtype = part.get_dtype()
        if dtype not in DTYPES:
            raise CheckpointError(f"checkpoint tensor {name} has dtype {dtype}, which is not "
                                  "supported")
        self.dtype = DTYPES[dtype]

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def read(self, index=None) -> torch.Tensor:
        """The block ``index`` (a tuple of slices; None: all of it), checked finite."""
        block = self._slice[index] if index is not None else self._slice[:]
        if self._counter is not None:
            self._counter.bytes += block.numel() * block.element_size()
        if block.is_floating_point() and block.dtype != torch.float8_e4m3fn and not bool(
                torch.isfinite(block).all()):
            raise CheckpointError(f"checkpoint tensor {self.name} holds non-finite values "
                                  "(NaN or Inf)")
        return block


def take(loaded, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (``dim`` 0) or columns (``dim`` 1) [start, start + length) of a checkpoint
    tensor, reading only those from a ``CheckpointSlice``."""
    if isinstance(loaded, CheckpointSlice):
        index = [slice(None)] * len(loaded.shape)
        index[dim] = slice(start, start + length)
        return loaded.read(tuple(index))
    return loaded.narrow(dim, start, length)


def whole(loaded) -> torch.Tensor:
    """All of a checkpoint tensor."""
    return loaded.read() if isinstance(loaded, CheckpointSlice) else loaded
