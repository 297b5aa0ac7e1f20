"""Checkpoint tensors a rank reads only in part: the rows or columns its shard keeps.

The loader hands each parameter's ``weight_loader`` a ``CheckpointSlice``: the tensor's
full shape and dtype from the safetensors header, and a reader of any block of it, so a
sharded layer reads its shard and nothing else. A loader takes what it keeps with
``take(loaded, dim, start, length)``, ``read_columns(loaded, group, wants, into)`` or
``whole(loaded)``; each accepts a plain tensor as well. Every block read is checked finite
and its bytes counted, so a run can report what each rank read.

Reads are positioned reads of the file (``os.preadv``) with the kernel's read-ahead turned
off (``POSIX_FADV_RANDOM``), not safetensors' memory map: a fault in a mapped file brings
in the pages around it as well, so a tp-4 rank reading a quarter of each tensor through the
map faulted in the whole file. A row block of a row-major tensor is one contiguous range of
the file. A column block is not (a rank's columns are a short run in every row), so the
ranks that shard a tensor by columns read it together: each reads a contiguous block of
rows, and one all-to-all hands every rank its columns of all of them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os

import torch

from .collectives import all_to_all_rows

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


class TensorFile:
    """One safetensors file open for positioned reads: the byte extent of each tensor.

    The header must already have been validated (safetensors' ``safe_open`` does it: offsets
    inside the file, no overlaps, sizes that match shapes); this reads the same header for
    the offsets safetensors does not expose. The descriptor closes with the last reference
    (every ``CheckpointSlice`` holds one, so a slice a loader keeps past the walk still reads)."""

    def __init__(self, path) -> None:
        self.path, self.fd = str(path), -1
        self.fd = os.open(self.path, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):  # no read-ahead: only the pages asked for
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
            size = int.from_bytes(os.pread(self.fd, 8, 0), "little")
            header = json.loads(os.pread(self.fd, size, 8))
        except Exception:
            self.close()
            raise
        self.data_start = 8 + size
        self.entries = {name: (entry["dtype"], tuple(entry["shape"]),
                               self.data_start + entry["data_offsets"][0])
                        for name, entry in header.items() if name != "__metadata__"}

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()

    def read_bytes(self, offset: int, size: int) -> torch.Tensor:
        """``size`` bytes at ``offset`` into a new uint8 tensor in host memory (no copy through
        Python bytes); the loader copies what it keeps onto the parameter's device."""
        out = torch.empty(size, dtype=torch.uint8, device="cpu")
        view, done = out.numpy(), 0
        while done < size:
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{self.path} ended inside a tensor's data")
            done += n
        return out


class CheckpointSlice:
    """One checkpoint tensor, unread: ``shape``, ``dtype``, and ``read(index)``."""

    __slots__ = ("name", "shape", "dtype", "_file", "_offset", "_counter")

    def __init__(self, name: str, file: TensorFile, counter: ReadBytes | None = None) -> None:
        self.name, self._file, self._counter = name, file, counter
        dtype, shape, self._offset = file.entries[name]
        self.shape = torch.Size(shape)
        if dtype not in DTYPES:
            raise CheckpointError(f"checkpoint tensor {name} has dtype {dtype}, which is not "
                                  "supported")
        self.dtype = DTYPES[dtype]

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0: one contiguous range of the file. Unchecked."""
        row = math.prod(self.shape[1:]) * self.dtype.itemsize
        data = self._file.read_bytes(self._offset + start * row, (stop - start) * row)
        if self._counter is not None:
            self._counter.bytes += data.numel()
        return data.view(self.dtype).view(stop - start, *self.shape[1:])

    def read(self, index=None) -> torch.Tensor:
        """The block ``index`` (a tuple of slices; None: all of it), checked finite. Only
        the rows the index selects are read from the file."""
        first = index[0] if index else slice(None)
        if not self.shape:  # a scalar
            block = self._file.read_bytes(self._offset, self.dtype.itemsize).view(
                self.dtype).view(())
            if self._counter is not None:
                self._counter.bytes += block.element_size()
        else:
            start, stop, step = first.indices(self.shape[0])
            block = self.rows(start, max(start, stop))[::step]
            if index:
                block = block[(slice(None), *index[1:])]
        check_finite(block, self.name)
        return block


def _non_finite(block: torch.Tensor) -> bool:
    """A NaN or Inf in a floating-point block (FP8 blocks are checked once dequantized)."""
    return (block.is_floating_point() and block.dtype != torch.float8_e4m3fn
            and not bool(torch.isfinite(block).all()))


def _non_finite_error(name: str) -> CheckpointError:
    return CheckpointError(f"checkpoint tensor {name} holds non-finite values (NaN or Inf)")


def check_finite(block: torch.Tensor, name: str) -> None:
    if _non_finite(block):
        raise _non_finite_error(name)


def take(loaded, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (``dim`` 0) or columns (``dim`` 1) [start, start + length) of a checkpoint
    tensor, reading only those rows from a ``CheckpointSlice`` (a column block reads every
    row: ``read_columns`` reads it together with the other ranks that shard it)."""
    if isinstance(loaded, CheckpointSlice):
        index = [slice(None)] * len(loaded.shape)
        index[dim] = slice(start, start + length)
        return loaded.read(tuple(index))
    return loaded.narrow(dim, start, length)


def read_columns(loaded, group, wants: list[tuple[int, int]], into: torch.Tensor | None) -> None:
    """This rank's columns of a 2-d checkpoint tensor that the members of ``group`` read
    together, copied into ``into`` (None: this member keeps none, and still takes part):
    member j wants columns ``wants[j]`` = (start, length), possibly none.

    Every member must call it for the same tensor at the same point of the load (the loaders
    do: every rank of a stage walks the same checkpoint in the same order). Each reads a
    contiguous block of rows and an all-to-all hands every member its columns of every
    block, so each reads about 1/size of the tensor however it is sharded. A non-finite
    value anywhere is reported by every member: each block travels behind a flag byte that
    says whether its sender's rows were finite, so the collective that moves the columns
    carries the verdict, and no member waits on one that stopped. Inside
    ``columns_read_together()`` the copy waits for the block's end, where the group exchanges
    every tensor it read there in one all-to-all; outside, it is now.
    """
    if not _read_together(loaded, group):
        if into is not None:
            into.copy_(take(loaded, 1, *wants[group.rank]))
        return
    read = _ColumnRead(loaded, group, wants, into)
    if _PENDING is None:
        _exchange([read])
        return
    pending = _PENDING.setdefault(group.key, [])
    pending.append(read)
    if sum(r.bytes for r in pending) >= READ_BATCH_BYTES:  # the same sum on every member
        _exchange(_PENDING.pop(group.key))


# a group exchanges its pending column reads once they total this many bytes of checkpoint
# (each member holds about 1/size of them meanwhile), else at the end of the load
READ_BATCH_BYTES = 16 << 20
_PENDING: dict | None = None  # group key -> its reads waiting, inside columns_read_together()


@contextlib.contextmanager
def columns_read_together():
    """``read_columns`` inside the block is exchanged per group at its end (or whenever a
    group's reads pass ``READ_BATCH_BYTES``): one all-to-all for a checkpoint's row-parallel
    weights and experts' down projections instead of one a tensor. Groups exchange in the
    order they first read, the same on every member (every rank walks the checkpoint alike).
    A block that raises exchanges nothing (its members raise too, or a collective timeout
    ends the job, as a rank that stops mid-load always did). Nested, the outer block's end."""
    global _PENDING
    if _PENDING is not None:
        yield
        return
    _PENDING = {}
    try:
        yield
        while _PENDING:
            _exchange(_PENDING.pop(next(iter(_PENDING))))
    finally:
        _PENDING = None


def _read_together(loaded, group) -> bool:
    return isinstance(loaded, CheckpointSlice) and group.size > 1 and len(loaded.shape) == 2


class _ColumnRead:
    """One tensor of a column exchange: this member's block of its rows (read now, in the
    walk's order), whether it is finite, and where this member's columns go."""

    __slots__ = ("loaded", "group", "wants", "into", "bounds", "mine", "bad", "bytes")

    def __init__(self, loaded, group, wants, into) -> None:
        self.loaded, self.group, self.wants, self.into = loaded, group, wants, into
        rows, size = loaded.shape[0], group.size
        self.bounds = [rows * m // size for m in range(size + 1)]
        self.mine = loaded.rows(self.bounds[group.rank], self.bounds[group.rank + 1])
        self.bad = _non_finite(self.mine)
        self.bytes = math.prod(loaded.shape) * loaded.dtype.itemsize

    def block_bytes(self, sender: int, member: int) -> int:
        """The bytes ``sender``'s block carries of ``member``'s columns."""
        rows = self.bounds[sender + 1] - self.bounds[sender]
        return rows * self.wants[member][1] * self.loaded.dtype.itemsize

    def send(self, member: int, part: torch.Tensor) -> None:
        """This member's rows of ``member``'s columns written into ``part``, the bytes of the
        send buffer they take (bytes: any dtype crosses gloo)."""
        s, n = self.wants[member]
        part.view(self.mine.shape[0], -1).copy_(_as_bytes(self.mine[:, s:s + n]))

    def receive(self, sender: int, block: torch.Tensor) -> None:
        """``sender``'s rows of this member's columns (bytes) into their rows of ``into``."""
        rows = self.into[self.bounds[sender]:self.bounds[sender + 1]]
        block = block.view(rows.shape[0], -1)
        if rows.dtype == self.loaded.dtype and rows.stride(-1) == 1:
            _as_bytes(rows).copy_(block)  # no staging copy: the bytes land where they stay
        else:  # another dtype (or layout) to convert to: stage the block in the checkpoint's
            staged = torch.empty(rows.shape, dtype=self.loaded.dtype, device=block.device)
            _as_bytes(staged).copy_(block)
            rows.copy_(staged)


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """A 2-d tensor whose last dim is contiguous, viewed as its bytes (that dim scaled by the
    element size). Received blocks follow the flag bytes at any offset, which a view as a
    wider dtype would refuse; as bytes the copy needs no alignment."""
    return x.view(torch.uint8)


def _exchange(reads: list[_ColumnRead]) -> None:
    """One all-to-all of ``reads`` (of one group) over their group: each read's columns (this
    member's) copied into its ``into`` where it has one. Raises, on every member alike, for
    the first read with a non-finite block on any member, before any ``into`` is written."""
    group = reads[0].group
    me, size, k = group.rank, group.size, len(reads)
    # to each member, one part: every read's flag (its rows finite or not), then each read's
    # columns, built in place in one buffer (the parts' sizes are what the collective sends)
    send = [k + sum(r.block_bytes(me, j) for r in reads) for j in range(size)]
    recv = [k + sum(r.block_bytes(m, me) for r in reads) for m in range(size)]
    buffer = torch.empty(sum(send), dtype=torch.uint8, device=reads[0].mine.device)
    flags = torch.tensor([int(r.bad) for r in reads], dtype=torch.uint8, device=buffer.device)
    at = 0
    for j in range(size):
        buffer[at:at + k] = flags
        at += k
        for r in reads:
            n = r.block_bytes(me, j)
            if n:
                r.send(j, buffer[at:at + n])
            at += n
    for r in reads:
        r.mine = None  # sent: the rows need not outlive the exchange's buffers
    out = all_to_all_rows(buffer, group, send, recv)
    del buffer
    blocks, bad, at = [], [False] * k, 0
    for m in range(size):  # sender m's part
        bad = [b or bool(f) for b, f in zip(bad, out[at:at + k].tolist())]
        at += k
        for r in reads:
            n = r.block_bytes(m, me)
            if n and r.into is not None:  # else it keeps none (and sent its rows all the same)
                blocks.append((r, m, out[at:at + n]))
            at += n
    if any(bad):
        raise _non_finite_error(reads[bad.index(True)].loaded.name)
    for r, m, block in blocks:
        r.receive(m, block)


def whole(loaded) -> torch.Tensor:
    """All of a checkpoint tensor."""
    return loaded.read() if isinstance(loaded, CheckpointSlice) else loaded
