"""What each rank reads from the checkpoint, and its peak memory, at tp 4 against world 1:
`python benchmarks/load_bytes.py [--model-impl transformers]` (the latter: the same
checkpoint through the Transformers backend, ``models/generic``).

A hidden-1024, 8-layer Qwen3 (transformers save_pretrained, random weights). Each rank
loads its model through the sharded loader and reports the bytes it asked for, the bytes it
keeps and its peak RSS; the same ranks then load once more reading whole tensors (the loader
before slices), each load in a fresh process, so the two peaks compare.

Measured from outside the library as well: each rank loads from its own copy of the files
(the page cache is shared, so one copy could not tell the ranks apart), evicted from the
page cache before each load (fsync, then ``POSIX_FADV_DONTNEED``); each rank reports what
the kernel fetched from storage for it (``read_bytes`` of ``/proc/self/io``), and after the
load the parent counts each copy's pages resident in the page cache (``mincore``): what
that rank touched. Prints one JSON line per world size.
"""

import ctypes
import json
import mmap
import os
import resource
import shutil
import sys
import tempfile
from pathlib import Path

import torch

CONFIG = dict(vocab_size=4096, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=8, head_dim=64)


def checkpoint(path: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG)).save_pretrained(path)
    return path


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def evict(model_dir: str) -> None:
    """Drop the checkpoint's pages from the page cache (written back first)."""
    for f in Path(model_dir).glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(model_dir: str) -> int:
    """Bytes of the checkpoint's files now in the page cache (``mincore`` over a map)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page, total = os.sysconf("SC_PAGE_SIZE"), 0
    for f in Path(model_dir).glob("*.safetensors"):
        size = f.stat().st_size
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {f}")
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {f}")
            libc.munmap(addr, size)
            total += sum(v & 1 for v in vec) * page
        finally:
            os.close(fd)
    return total


def _storage_bytes() -> int:
    """What the kernel has fetched from storage for this process (0 where not accounted)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def load_rank(model_dirs: list[str], tp: int, lazy: bool, impl: str = "auto") -> dict:
    """Rank r loads from ``model_dirs[r]`` (a copy of its own, so the page cache shows what
    this rank alone touched; any one entry when they are all the same folder), through the
    implementation ``impl`` serves."""
    from layer_boundary.models.checkpoint import open_checkpoint
    from layer_boundary.models.loader import iter_weights
    from layer_boundary.engine.runner import RunSpec, make_runtime
    from layer_boundary.runtime.shards import ReadBytes

    import torch.distributed as dist

    runtime = make_runtime(RunSpec(model_dirs[0], tp=tp))
    model_dir = model_dirs[dist.get_rank() if dist.is_initialized() else 0]
    checkpoint = open_checkpoint(model_dir, impl)
    model = checkpoint.model_class(checkpoint.config, runtime)
    before = _peak_mb()
    read = ReadBytes()
    weights = iter_weights(model_dir, lazy=lazy, read=read)
    if not lazy:  # count what the whole tensors held
        weights = ((n, t) for n, t in weights if not setattr(read, "bytes", read.bytes
                                                              + t.numel() * t.element_size()))
    fetched = _storage_bytes()
    model.load_weights(weights)
    fetched = _storage_bytes() - fetched
    kept = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"read_mb": read.bytes / 2 ** 20, "kept_mb": kept / 2 ** 20,
            "storage_mb": fetched / 2 ** 20,
            "peak_before_mb": before, "peak_after_mb": _peak_mb()}


def copies(model_dir: str, n: int) -> list[str]:
    """``n`` copies of the checkpoint folder (real copies: a hard link shares page cache)."""
    out = []
    for r in range(n):
        target = f"{model_dir}.rank{r}"
        shutil.copytree(model_dir, target)
        out.append(target)
    return out


def measure(model_dir: str, tp: int, impl: str = "auto") -> dict:
    """Each rank loads from its own copy with the page cache evicted, sliced and then whole;
    ``resident_mb``: the pages of each rank's copy in the page cache after its load."""
    from layer_boundary.runtime.launch import spawn

    dirs = copies(model_dir, tp)
    rows = {}
    for lazy in (True, False):
        for d in dirs:
            evict(d)
        ranks = spawn(load_rank, tp, dirs, tp, lazy, impl)
        rows[lazy] = [dict(r, resident_mb=resident_bytes(d) / 2 ** 20)
                      for r, d in zip(ranks, dirs)]
    for d in dirs:
        shutil.rmtree(d)
    sliced, whole = rows[True], rows[False]
    size = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / 2 ** 20
    return {
        "tp": tp, "impl": impl, "checkpoint_mb": round(size, 1),
        "read_mb": [round(r["read_mb"], 1) for r in sliced],
        "kept_mb": [round(r["kept_mb"], 1) for r in sliced],
        "resident_mb": [round(r["resident_mb"], 1) for r in sliced],
        "resident_vs_kept": max(r["resident_mb"] / r["kept_mb"] for r in sliced),
        "storage_mb": [round(r["storage_mb"], 1) for r in sliced],
        "whole_tensors_read_mb": [round(r["read_mb"], 1) for r in whole],
        "whole_tensors_resident_vs_kept": max(r["resident_mb"] / r["kept_mb"] for r in whole),
        "peak_rss_mb": [round(r["peak_after_mb"]) for r in sliced],
        "whole_tensors_peak_rss_mb": [round(r["peak_after_mb"]) for r in whole],
        "peak_before_load_mb": [round(r["peak_before_mb"]) for r in sliced]}


if __name__ == "__main__":
    impl = sys.argv[sys.argv.index("--model-impl") + 1] if "--model-impl" in sys.argv else "auto"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(checkpoint(Path(tmp) / "qwen3_1024x8"))
        for tp in (1, 4):
            print(json.dumps(measure(model_dir, tp, impl)), flush=True)
    sys.exit(0)
