"""World-1 decode speed on a GPU against transformers and the memory roofline
(scripts/gpu_check.py prints it as its performance tables; on its own:
`python benchmarks/gpu_decode.py [--shape NAME ...] [--device cuda|cpu]`).

Shapes (random weights, bf16):
- ``qwen3-2048x16``: a Qwen3 of hidden 2048 x 16 layers (a Llama-3.2-1B-like size): a prefill
  of 4 x 512 tokens, and a decode step of 1, 16 and 64 requests after a 512-token prefix;
  then ours at tp 2 (``multi_rank``);
- ``llama-7b``: a Llama of hidden 4096 x 32 layers, intermediate 11008 (Llama-2-7B's shape),
  where the weights' bytes dominate: decode steps of 1 and 16 requests;
- ``tiny``: hidden 64 x 2, for ``--device cpu``: runs every system's code without a GPU (no
  graphs captured there), so the script is known to run before a GPU is lent.

Systems, each decode step timed interleaved with the others (``interleaved``):
- ours eager (``load_model`` with the boundaries, no graphs);
- ours captured (``engine.graphs.CapturedDecode``: the padded step replayed from its graph),
  holding the eager step or the step compiled by inductor (``run --device cuda``'s default);
  and each with the Triton provider and the decode attention in place
  (``KVCache.decode_in_place``: no gather of whole cache slots);
- transformers eager (a DynamicCache step) and compiled (a StaticCache step under
  ``torch.compile(mode="reduce-overhead")``, its docs' recipe for fast decode).

A row's ``ms`` is the median over rounds of each round's median step; ``vs_peer`` is the
median over rounds of the step's time over transformers compiled's in the same round. The
roofline of a decode step is the bytes it must read (every weight once but the embedding, the
LM head included, plus its requests' cached keys and values) over the device's measured copy
bandwidth.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

ROUNDS, PER_ROUND, WARMUP = 7, 5, 3


@dataclass(frozen=True)
class System:
    """What a row times: ours (``captured`` None: the eager step; "eager" or "inductor": the
    padded step replayed from its graph, holding that step; ``in_place``: with the Triton
    provider, its caches decoding in place) or transformers (``compiled`` or eager)."""

    name: str
    ours: bool
    captured: str | None = None
    in_place: bool = False
    compiled: bool = False


OURS_EAGER = System("ours eager", True)
CAPTURED_EAGER = System("ours captured, eager step", True, "eager")
CAPTURED_INDUCTOR = System("ours captured, inductor step", True, "inductor")
IN_PLACE_EAGER = System("ours captured, eager step, triton + in place", True, "eager", True)
IN_PLACE_INDUCTOR = System("ours captured, inductor step, triton + in place", True, "inductor",
                           True)
THEIRS_EAGER = System("transformers eager", False)
PEER = System("transformers compiled", False, compiled=True)  # what each row is a ratio of
SYSTEMS = (OURS_EAGER, CAPTURED_EAGER, CAPTURED_INDUCTOR, IN_PLACE_EAGER, IN_PLACE_INDUCTOR,
           THEIRS_EAGER, PEER)


@dataclass(frozen=True)
class Shape:
    """A model size and what is timed on it."""

    family: str  # the transformers class saved: "qwen3" or "llama"
    config: dict
    prefix: int  # cached tokens before each decode step
    prefill: tuple[int, int] | None  # (requests, tokens), or None
    decodes: tuple[int, ...]  # requests a decode step
    systems: tuple[System, ...]
    multi_rank: bool = False  # then ours at tp 2


QWEN3_2048 = dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144,
                  num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=4096,
                  tie_word_embeddings=False)
LLAMA_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
            max_position_embeddings=256, tie_word_embeddings=False)
# each inductor-compiled system compiles a graph a decode workload (about a minute on a GPU,
# caches cold): a shape times those it needs within one device call
SHAPES = {
    "qwen3-2048x16": Shape("qwen3", QWEN3_2048, 512, (4, 512), (1, 16, 64),
                           tuple(s for s in SYSTEMS if s != CAPTURED_EAGER), True),
    "llama-7b": Shape("llama", LLAMA_7B, 512, None, (1, 16),
                      (IN_PLACE_EAGER, IN_PLACE_INDUCTOR, PEER)),
    "tiny": Shape("qwen3", TINY, 8, (2, 8), (1, 3), SYSTEMS),
}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn, repeats: int, device: str, warmup: int = 1) -> float:
    """The median of ``repeats`` calls (CUDA events on a GPU, the wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: str) -> float:
    """Bytes a second of a large device copy (read + write counted)."""
    x = torch.empty(1 << (30 if device == "cuda" else 26), dtype=torch.uint8, device=device)
    return 2 * x.numel() / (_median_ms(lambda: x.clone(), 10, device) / 1e3)


def checkpoint(folder: Path, shape: Shape, device: str):
    """A random bf16 checkpoint of ``shape`` saved by transformers, and the transformers
    model (built in bf16 on ``device``: a 7B model never exists in fp32)."""
    import transformers

    config_cls, model_cls = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                             "llama": ("LlamaConfig", "LlamaForCausalLM")}[shape.family]
    cfg = getattr(transformers, config_cls)(**shape.config)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            hf = getattr(transformers, model_cls)(cfg)
    finally:
        torch.set_default_dtype(default)
    hf.eval()
    hf.save_pretrained(folder)
    return folder, hf


def _weight_bytes(model) -> int:
    """Every parameter's bytes but the embedding's (a step reads one row of it a token)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if "embed" not in name and p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def kv_bytes(shape: Shape, requests: int, length: int) -> int:
    c = shape.config
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    return 2 * c["num_hidden_layers"] * requests * length * c["num_key_value_heads"] * head_dim * 2


class _Ours:
    """Our model of a checkpoint (with the Triton provider where ``fused``)."""

    def __init__(self, path: Path, shape: Shape, device: str, tp: int = 1,
                 fused: bool = False) -> None:
        from layer_boundary.engine.runner import make_fusions
        from layer_boundary.models import load_model
        from layer_boundary.runtime import BoundaryRuntime, ParallelDims
        from layer_boundary.runtime.parallel import build_parallel

        runtime = BoundaryRuntime(build_parallel(ParallelDims(world_size=tp, tp=tp)),
                                  boundary_reduction="ar")
        self.model = load_model(str(path), runtime, dtype=torch.bfloat16, device=device)
        if fused:
            self.model.install_fusion(make_fusions("triton"))
        self.shape, self.device = shape, device

    def prefill(self, requests: int, length: int):
        from layer_boundary.runtime import ForwardBatch, ForwardMode
        from layer_boundary.runtime.forward_batch import LogitsRows

        cache = self.model.make_kv_cache(requests + 1, self.shape.prefix + 64)
        # the same prompts on every rank of a multi-rank run
        gen = torch.Generator().manual_seed(requests)
        prompts = torch.randint(0, self.shape.config["vocab_size"], (requests, length),
                                generator=gen).tolist()

        def run():
            batch = ForwardBatch.build(ForwardMode.EXTEND, prompts, [0] * requests,
                                       kv_cache=cache, device=self.device)
            batch.logits_rows = LogitsRows.LAST
            return self.model(batch)
        return run, cache

    def decode(self, requests: int, captured: str | None, in_place: bool = False):
        """A decode step's callable after a prefix: eager (``captured`` None), or the padded
        step holding the "eager" or the "inductor" step, replayed from its graph on a GPU
        (run as it is on the CPU); ``in_place``: the cache decodes in place."""
        from layer_boundary.engine.graphs import CapturedDecode, decode_step
        from layer_boundary.engine.runner import RunSpec
        from layer_boundary.runtime import ForwardBatch, ForwardMode
        from layer_boundary.runtime.forward_batch import token_bucket

        run_prefill, cache = self.prefill(requests, self.shape.prefix)
        with torch.no_grad():
            run_prefill()
        cache.decode_in_place = in_place
        tokens, prefix = [[1]] * requests, self.shape.prefix
        forward = self.model
        if captured is not None:
            step, name = decode_step(RunSpec("m", captured_decode=captured), self.model)
            forward = (CapturedDecode(self.model, step, step_name=name)
                       if self.device == "cuda" else step)

        def step():
            batch = ForwardBatch.build(ForwardMode.DECODE, tokens, [prefix] * requests,
                                       kv_cache=cache, device=self.device)
            if captured:
                batch = batch.padded(token_bucket(requests), scratch_slot=requests)
            return forward(batch)
        return step


class _Transformers:
    def __init__(self, hf, shape: Shape, device: str) -> None:
        self.hf, self.shape, self.device = hf, shape, device
        self.compiled = None

    def prefill(self, requests: int, length: int):
        ids = torch.randint(0, self.shape.config["vocab_size"], (requests, length),
                            device=self.device)
        return lambda: self.hf(input_ids=ids, logits_to_keep=1, use_cache=False).logits

    def decode(self, requests: int, compiled: bool):
        from transformers import DynamicCache, StaticCache

        prefix, device = self.shape.prefix, self.device
        ids = torch.randint(0, self.shape.config["vocab_size"], (requests, prefix),
                            device=device)
        if compiled:
            cache = StaticCache(config=self.hf.config, max_cache_len=prefix + 64)
            if self.compiled is None:
                self.compiled = torch.compile(self.hf.forward, mode="reduce-overhead",
                                              fullgraph=True)
            forward = self.compiled
        else:
            cache, forward = DynamicCache(config=self.hf.config), self.hf
        with torch.no_grad():
            self.hf(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                    cache_position=torch.arange(prefix, device=device))
        token = torch.ones((requests, 1), dtype=torch.long, device=device)
        steps = [prefix]

        def step():
            # a static cache rewrites the same row each step; a dynamic one grows by a row a
            # step, as generation does
            position = torch.tensor([steps[-1]], device=device)
            if not compiled:
                steps.append(steps[-1] + 1)
            return forward(input_ids=token, past_key_values=cache, use_cache=True,
                           cache_position=position).logits
        return step


def interleaved(steps: dict, device: str, rounds: int = ROUNDS,
                per_round: int = PER_ROUND) -> dict[str, list[float]]:
    """Each round times every step (the median of ``per_round`` calls), the order rotated a
    round, so drift in the device's clock or temperature falls on every system alike."""
    times = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(_median_ms(steps[name], per_round, device))
    return times


def _build(systems, make, log, workload: str, rows: list) -> dict:
    """Each system's step, built and warmed up (compiled, captured); one that fails is an
    error row, and the others still run."""
    steps = {}
    for system in systems:
        try:
            step = make(system)
            with torch.no_grad():
                for _ in range(WARMUP):
                    step()
            steps[system] = step
        except Exception as exc:  # named in the table; the other rows stand
            log(f"  {workload:<18} {system.name:<46} failed: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200] if str(exc) else ''}")
            rows.append({"workload": workload, "system": system.name, "error": str(exc)[:300]})
    return steps


def _timed_rows(workload: str, steps: dict, device: str, log, roof: float | None) -> list:
    with torch.no_grad():
        times = interleaved(steps, device)
    rows = []
    for system, ms_list in times.items():
        ms = statistics.median(ms_list)
        row = {"workload": workload, "system": system.name, "ms": ms}
        detail = ""
        if roof is not None:
            row.update(roofline_ms=roof, over_roofline=ms / roof)
            detail += f"  roofline {roof:.3f} ms ({ms / roof:.2f}x)"
        if PEER in times and system != PEER:
            row["vs_peer"] = statistics.median(a / b for a, b in zip(ms_list, times[PEER]))
            detail += f"  {row['vs_peer']:.2f} of {PEER.name}"
        rows.append(row)
        log(f"  {workload:<18} {system.name:<46} {ms:8.3f} ms{detail}")
    return rows


def _system_step(system: System, requests: int, ours: dict, theirs: _Transformers):
    if not system.ours:
        return theirs.decode(requests, system.compiled)
    model = ours["fused" if system.in_place else "plain"]
    return model.decode(requests, system.captured, in_place=system.in_place)


def world1_rows(path: Path, hf, shape: Shape, bandwidth: float, device: str, log) -> list:
    """The shape's world-1 rows: its prefill (ours and transformers eager), then each decode
    workload's systems, interleaved."""
    ours = {"plain": None, "fused": None}
    needs = {"fused" if s.in_place else "plain" for s in shape.systems if s.ours}
    for kind in needs:
        ours[kind] = _Ours(path, shape, device, fused=kind == "fused")
    theirs = _Transformers(hf, shape, device)
    weights = _weight_bytes(next(m for m in ours.values() if m is not None).model)
    rows = []
    if shape.prefill is not None and ours["plain"] is not None:
        n, length = shape.prefill
        workload = f"prefill {n}x{length}"
        steps = _build((OURS_EAGER, THEIRS_EAGER),
                       lambda s: (ours["plain"].prefill(n, length)[0] if s.ours
                                  else theirs.prefill(n, length)), log, workload, rows)
        rows += _timed_rows(workload, steps, device, log, None)
    for requests in shape.decodes:
        workload = f"decode {requests}"
        roof = (weights + kv_bytes(shape, requests, shape.prefix)) / bandwidth * 1e3
        steps = _build(shape.systems, lambda s: _system_step(s, requests, ours, theirs), log,
                       workload, rows)
        rows += _timed_rows(workload, steps, device, log, roof)
        del steps
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _rank_rows(path: str, shape_name: str, tp: int, captured: str | None) -> list[dict]:
    """One spawned rank's share of the multi-rank rows: ours at ``tp`` (attention TP, ``ar``)
    on this rank's GPU, the same requests on every rank; rank 0's timings are the rows'."""
    import os

    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    shape = SHAPES[shape_name]
    ours = _Ours(Path(path), shape, "cuda", tp)
    rows = []
    with torch.no_grad():
        if shape.prefill is not None:
            run_prefill, _ = ours.prefill(*shape.prefill)
            dist.barrier()
            rows.append((f"prefill {shape.prefill[0]}x{shape.prefill[1]}",
                         _median_ms(run_prefill, 10, "cuda", 3)))
        for requests in shape.decodes:
            step = ours.decode(requests, captured)
            dist.barrier()
            rows.append((f"decode {requests}", _median_ms(step, 20, "cuda", 3)))
    return rows


def multi_rank(path: Path, shape_name: str, tp: int, log=print) -> list[dict]:
    """Ours at ``tp`` on this machine's GPUs: NCCL with a GPU a rank (each decode bucket
    replayed from its captured inductor step), else gloo with the ranks sharing the GPUs
    (graphs off: a graph cannot hold a gloo collective)."""
    from layer_boundary.engine.runner import backend_for
    from layer_boundary.runtime.launch import spawn

    backend = backend_for("cuda", tp)
    captured = "inductor" if backend == "nccl" else None
    system = f"ours tp {tp} ({backend}, {'captured' if captured else 'eager'})"
    results = spawn(_rank_rows, tp, str(path), shape_name, tp, captured, backend=backend,
                    start_method="spawn", timeout_s=900, collective_timeout_s=600)
    rows = []
    for workload, ms in results[0]:
        rows.append({"workload": workload, "system": system, "ms": ms})
        log(f"  {workload:<18} {system:<46} {ms:8.3f} ms")
    return rows


@torch.no_grad()
def table(folder: Path | None = None, log=print, shapes=("qwen3-2048x16",),
          device: str = "cuda") -> list[dict]:
    """The rows of each shape (workload, system, ms; roofline ms, ms over the roofline and
    the ratio to transformers compiled where they apply), each row naming its shape."""
    folder = Path(folder or tempfile.mkdtemp(prefix="gpu_decode_"))
    bandwidth = copy_bandwidth(device)
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows = []
    for name in shapes:
        shape = SHAPES[name]
        log(f"{name}:")
        path, hf = checkpoint(folder / name, shape, device)
        mine = world1_rows(path, hf, shape, bandwidth, device, log)
        del hf  # the ranks take the GPU next
        if device == "cuda":
            torch.cuda.empty_cache()
        if shape.multi_rank and device == "cuda":
            try:
                mine += multi_rank(path, name, 2, log)
            except Exception as exc:  # named in the table; the world-1 rows stand
                log(f"  multi-rank rows failed: {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:200]}")
                mine.append({"workload": "tp 2", "system": "ours", "error": str(exc)[:300]})
        rows += [{"shape": name, **row} for row in mine]
    return rows


def main(argv=None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), default=None,
                        help="a shape to time (repeatable; default qwen3-2048x16)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_decode: error: --device cuda, but torch sees no CUDA device here (a smoke "
              "run on the CPU: --device cpu --shape tiny)", file=sys.stderr)
        return 2
    if args.device == "cpu":
        from layer_boundary.fusions.triton_provider import use_interpreter  # imports no triton

        use_interpreter()
    for r in table(shapes=tuple(args.shape or ("qwen3-2048x16",)), device=args.device):
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
