"""What a checkpoint's config.json asks each rank to allocate, known before anything is.

A config.json is only a promise about the tensors beside it: one that says ``vocab_size:
160000000`` next to a 300-row embedding, or a million layers next to two, would have every
rank allocate (or build for minutes) before loading finds the mismatch. So before a model is
built for real:

1. the layers config.json asks for are checked against the layers the safetensors headers
   hold (building is linear in the layer count; this bounds it by the checkpoint);
2. the model is built once on the meta device (no memory) at world 1, and its parameters'
   elements are checked against the checkpoint's tensors' (every parameter is loaded from a
   checkpoint tensor, so a model far larger than its checkpoint is a config that lies; one
   a little larger is left to the loader, which names the tensor that does not fit);
3. each pipeline stage's rank model is built on the meta device of a virtual topology, which
   gives each rank's parameter bytes exactly; its KV cache is measured on a one- and a
   two-position cache (the cache classes are linear in positions) and extrapolated; the
   activations are bounded from the widest row a rank computes and the logits.

``check_fits`` refuses by name what exceeds the machine's available memory. The figures are
an estimate for a refusal and for ``plan``, not an accounting of the allocator.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass

import torch

from ..runtime.packed import packed_bytes
from ..runtime.shards import CheckpointError

GB = 2 ** 30
# scales are not parameters: each dequantizes its weight at load
_NOT_PARAMETERS = ("_scale_inv", ".inv_freq")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def size(n: int) -> str:
    """Bytes for a reader: GB, MB or KB with two significant decimals."""
    for unit, scale in (("GB", GB), ("MB", 2 ** 20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1024:.1f} KB"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank of a pipeline stage holds (the largest stage's), and the job's total on
    this machine.

    Args:
        parameters: the rank's parameters (meta-built, exact).
        packed: the CPU copies of its linears' weights packed for oneDNN (``runtime.packed``;
            0 on a GPU, or loaded with ``pack=False``).
        kv_cache: its KV cache for the run's requests and positions.
        activations: a bound on one forward's transient tensors (the widest computed rows and
            the gathered logits of every token of the prefill).
        processes: how many model copies run on this machine (the ranks, plus the world-1
            reference where the run checks parity).
        reference: the world-1 reference's bytes (0 without one).
    """

    parameters: int
    kv_cache: int
    activations: int
    processes: int
    reference: int = 0
    packed: int = 0

    @property
    def per_rank(self) -> int:
        return self.parameters + self.packed + self.kv_cache + self.activations

    @property
    def total(self) -> int:
        return self.per_rank * self.processes + self.reference

    def describe(self) -> str:
        return (f"{size(self.per_rank)} per rank (parameters {size(self.parameters)}, "
                + (f"their packed copies {size(self.packed)}, " if self.packed else "") +
                f"KV cache {size(self.kv_cache)}, activations {size(self.activations)}); "
                f"{size(self.total)} for the job's {self.processes} ranks"
                + (" and its world-1 reference" if self.reference else ""))

    def as_dict(self) -> dict:
        return {"parameters": self.parameters, "packed": self.packed, "kv_cache": self.kv_cache,
                "activations": self.activations, "per_rank": self.per_rank,
                "ranks": self.processes, "reference": self.reference, "total": self.total}


def checkpoint_layers(facts: dict) -> int | None:
    """How many decoder layers the checkpoint's tensor names hold (the largest index + 1), or
    None where no name carries a layer index."""
    indices = [int(m.group(1)) for name in facts for m in [_LAYER.search(name)] if m]
    return max(indices) + 1 if indices else None


def check_layers(cfg, facts: dict) -> None:
    """Refuse a config.json that asks for more decoder layers than the checkpoint holds."""
    # LongCat's num_hidden_layers counts its attentions (two a layer); num_layers its layers
    field = next((f for f in ("num_layers", "num_hidden_layers") if hasattr(cfg, f)), None)
    held = checkpoint_layers(facts)
    if field is None or held is None:
        return
    asked = getattr(cfg, field)
    if asked > held:
        raise CheckpointError(f"config.json {field}={asked}, and the checkpoint's tensors hold "
                              f"{held} layers")


def checkpoint_elements(facts: dict) -> int:
    """The elements of the checkpoint's tensors that load into parameters."""
    return sum(math.prod(shape) for name, (shape, _) in facts.items()
               if not name.endswith(_NOT_PARAMETERS))


def parameter_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(elements, bytes) of ``model``'s parameters, each shared one once."""
    elements = size = 0
    for p in model.parameters():
        elements += p.numel()
        size += p.numel() * p.element_size()
    return elements, size


# how far a model may outgrow its checkpoint's elements before the config.json is called a
# lie: a head that falls back to the embedding (Nemotron-H without lm_head.weight) loads one
# tensor twice, and a tensor short by a few rows is the loader's to name, tensor by tensor;
# past twice the checkpoint a size field does not describe these weights
SLACK = 2


def check_elements(model: torch.nn.Module, facts: dict) -> None:
    """Refuse a world-1 (meta-built) model with more than ``SLACK`` times the parameter
    elements of the checkpoint's tensors: some config.json field asks for weights the
    checkpoint does not have."""
    asked, _ = parameter_bytes(model)
    held = checkpoint_elements(facts)
    if asked > SLACK * held:
        raise CheckpointError(f"config.json asks for {asked:,} parameters, and the checkpoint's "
                              f"tensors hold {held:,} (a size field such as vocab_size, "
                              "hidden_size, intermediate_size or a head count does not match "
                              "the weights)")


def _tensor_bytes(obj, seen: set) -> int:
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr() if obj.device.type != "meta" else id(obj)
        if key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    state = getattr(obj, "__dict__", None)
    return _tensor_bytes(state, seen) if state else 0


def kv_cache_bytes(model, requests: int, positions: int) -> int:
    """``model``'s KV cache for ``requests`` slots of ``positions`` rows, from a one-slot cache
    of one and of two positions (caches are linear in both; a windowed one grows less)."""
    one = _tensor_bytes(model.make_kv_cache(1, 1), set())
    two = _tensor_bytes(model.make_kv_cache(1, 2), set())
    per_position = max(two - one, 0)
    return requests * (one - per_position + per_position * positions)


def activation_bytes(model, cfg, tokens: int, element: int) -> int:
    """A bound on one forward's transient tensors on a rank: ``tokens`` rows of its widest
    local parameter row (several live at once), the gathered fp32 logits, and attention
    scores of every local head over every pair of tokens."""
    widest = max((max(p.shape) for p in model.parameters() if p.dim() >= 1), default=0)
    heads = getattr(cfg, "num_attention_heads", 1) or 1
    return (4 * tokens * widest * element + tokens * cfg.vocab_size * 4
            + heads * tokens * tokens * 4)


def available_memory() -> int | None:
    """Bytes this machine can still give: MemAvailable, capped by a cgroup limit (v2 or v1)
    where one is set; None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as f:
                text = f.read().strip()
            if text != "max" and int(text) < 2 ** 60:
                with open(usage) as f:
                    found.append(int(text) - int(f.read().strip()))
        except (OSError, ValueError):
            continue
    return min(found) if found else None


MEMORY_ENV = "LAYER_BOUNDARY_MEMORY_GB"


def memory_override() -> int | None:
    """The bytes ``LAYER_BOUNDARY_MEMORY_GB`` grants (None: unset), refused by name unless it
    is a positive, finite number of gigabytes."""
    raw = os.environ.get(MEMORY_ENV)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{MEMORY_ENV}={raw!r} must be a positive, finite number of "
                         "gigabytes (the memory a job may use on this machine)")
    return int(value * GB)


def memory_budget(available: int | None = None) -> int | None:
    """The bytes a job may take here: ``LAYER_BOUNDARY_MEMORY_GB`` where set (a test's
    budget), else ``available`` where given, else ``available_memory()`` (None: unknown)."""
    override = memory_override()
    if override is not None:
        return override
    return available_memory() if available is None else available


def check_fits(estimate: MemoryEstimate, available: int | None = None) -> None:
    """Refuse, naming both figures, an estimate over the memory this machine has.

    Args:
        estimate: the job's estimate.
        available: bytes to compare with (default: ``available_memory()``; None: unknown,
            nothing refused). ``LAYER_BOUNDARY_MEMORY_GB`` overrides it (a test's budget).
    """
    available = memory_budget(available)
    if available is not None and estimate.total > available:
        raise CheckpointError(f"config.json asks for {estimate.describe()}; this machine has "
                              f"{size(available)} available")


def meta_model(checkpoint, runtime, dtype=torch.float32):
    """``checkpoint``'s model for ``runtime``'s rank, built on the meta device (no memory).

    Args:
        checkpoint: a ``Checkpoint`` (config.json read and parsed).
        runtime: the ``BoundaryRuntime`` of the rank (a virtual topology's is enough).
        dtype: the parameters' dtype.
    """
    with torch.device("meta"):
        return checkpoint.model_class(checkpoint.config, runtime, dtype=dtype)


def check_sizes(checkpoint, facts: dict | None = None) -> None:
    """Refuse a config.json that asks for more layers or parameter elements than the
    checkpoint's tensors hold, from the safetensors headers and a world-1 meta build (no
    memory). Checked once per ``Checkpoint`` (the ranks it is handed to do not again), and
    once a process for the same contents (another ``Checkpoint`` of the same folder).

    Args:
        checkpoint: a ``Checkpoint``.
        facts: its ``loader.header_facts`` (``checkpoint.tensor_facts()`` when not given).
    """
    if checkpoint.memo.get("sizes_checked"):
        return
    facts = checkpoint.tensor_facts() if facts is None else facts
    # the check is a function of what the folder holds (the parsed config follows from
    # config.json, the serving class and the stored tensors): a process that opens the same
    # contents again (a rank handed the folder's path, case after case) builds no meta
    # model for it again
    held = hashlib.sha256(repr((checkpoint.model_class.__module__,
                                checkpoint.model_class.__qualname__,
                                json.dumps(checkpoint.raw, sort_keys=True, default=repr),
                                sorted(facts.items()))).encode()).hexdigest()
    if held not in _SIZES_CHECKED:
        check_layers(checkpoint.config, facts)
        check_elements(meta_model(checkpoint, _world1_runtime()), facts)
        _SIZES_CHECKED.add(held)
    checkpoint.memo["sizes_checked"] = True


_SIZES_CHECKED: set[str] = set()  # digests of the contents check_sizes passed


def _world1_runtime():
    from ..runtime.args import BoundaryRuntime
    from ..runtime.parallel import ParallelDims, virtual_parallel

    return BoundaryRuntime(virtual_parallel(ParallelDims(world_size=1)))


def estimate(checkpoint, rank_runtimes, dtype, requests: int, positions: int, tokens: int,
             ranks: int, reference: bool, packed: bool = True) -> MemoryEstimate:
    """A job's memory: the largest of ``rank_runtimes``' ranks (one per pipeline stage) times
    ``ranks``, plus a world-1 reference run where ``reference``.

    Args:
        checkpoint: a ``Checkpoint`` (``check_sizes`` runs first).
        rank_runtimes: one ``BoundaryRuntime`` per pipeline stage (its first rank's, on a
            virtual topology).
        dtype: the parameters' dtype.
        requests, positions: the KV cache's slots and rows per slot.
        tokens: the most rows one forward computes (the whole prefill).
        ranks: the job's rank processes.
        reference: whether a world-1 copy runs too.
        packed: whether the ranks pack their linears' weights (``load_model``'s ``pack`` on
            the CPU): each packed weight counts twice.
    """
    check_sizes(checkpoint)
    element = torch.empty((), dtype=dtype).element_size()
    cfg = checkpoint.config

    def of(model) -> tuple[int, int, int, int]:
        return (parameter_bytes(model)[1], kv_cache_bytes(model, requests, positions),
                activation_bytes(model, cfg, tokens, element),
                packed_bytes(model) if packed else 0)

    *per_rank, packs = max((of(meta_model(checkpoint, rt, dtype)) for rt in rank_runtimes),
                           key=sum)
    world1 = sum(of(meta_model(checkpoint, _world1_runtime(), dtype))) if reference else 0
    return MemoryEstimate(*per_rank, processes=ranks, reference=world1, packed=packs)
