"""World-1 speed on a GPU against transformers and the memory roofline (scripts/gpu_check.py
prints it as its performance table; on its own: `python benchmarks/gpu_decode.py`).

A Qwen3 of hidden 2048 x 16 layers (random weights, bf16): a prefill of 4 x 512 tokens, and a
decode step of 1, 16 and 64 requests after a 512-token prefix, for
- ours eager (``load_model`` with the boundaries, no graphs),
- ours captured (``engine.graphs.CapturedDecode``: the padded step replayed from its graph),
  holding the eager step, or the step compiled by inductor (what ``run --device cuda`` does
  by default),
- transformers eager (a DynamicCache step),
- transformers compiled (a StaticCache step under ``torch.compile(mode="reduce-overhead")``,
  what its docs recommend for fast decode; the prefill runs eagerly into the static cache);
- then ours at tp 2 on the machine's GPUs (``multi_rank``): NCCL with a GPU a rank, decode
  replayed from captured graphs; else two ranks sharing one GPU over gloo, eagerly.

Each figure is the median of CUDA-event timings after warm-up. Each decode row's roofline is
the bytes a step must read (every weight once, the LM head included, plus the cached keys and
values of its requests) over the device's measured copy bandwidth.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
              num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
              max_position_embeddings=4096, tie_word_embeddings=False)
PREFIX = 512
PREFILL = (4, 512)
DECODES = (1, 16, 64)
REPEATS = 20


def _median_ms(fn, repeats: int = REPEATS, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes a second of a large device-to-device copy (read + write counted)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    ms = _median_ms(lambda: x.clone(), repeats=10)
    return 2 * x.numel() / (ms / 1e3)


def checkpoint(folder: Path):
    """A random bf16 Qwen3 of ``CONFIG`` saved by transformers, and the transformers model."""
    import transformers

    cfg = transformers.Qwen3Config(**CONFIG)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
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


def kv_bytes(requests: int, length: int) -> int:
    c = CONFIG
    return (2 * c["num_hidden_layers"] * requests * length * c["num_key_value_heads"]
            * c["head_dim"] * 2)


class _Ours:
    def __init__(self, path: Path, tp: int = 1) -> None:
        from layer_boundary.models import load_model
        from layer_boundary.runtime import BoundaryRuntime, ParallelDims
        from layer_boundary.runtime.parallel import build_parallel

        runtime = BoundaryRuntime(build_parallel(ParallelDims(world_size=tp, tp=tp)),
                                  boundary_reduction="ar")
        self.model = load_model(str(path), runtime, dtype=torch.bfloat16, device="cuda")

    def prefill(self, requests: int, length: int):
        from layer_boundary.runtime import ForwardBatch, ForwardMode
        from layer_boundary.runtime.forward_batch import LogitsRows

        cache = self.model.make_kv_cache(requests + 1, PREFIX + 64)
        # the same prompts on every rank of a multi-rank run
        gen = torch.Generator().manual_seed(requests)
        prompts = torch.randint(0, CONFIG["vocab_size"], (requests, length), generator=gen).tolist()

        def run():
            batch = ForwardBatch.build(ForwardMode.EXTEND, prompts, [0] * requests,
                                       kv_cache=cache, device="cuda")
            batch.logits_rows = LogitsRows.LAST
            return self.model(batch)
        return run, cache

    def decode(self, requests: int, captured: str | None):
        """A decode step's callable: eager (``captured`` None), or replayed from a graph of
        the "eager" or the "inductor" step."""
        from layer_boundary.engine.graphs import CapturedDecode, decode_step
        from layer_boundary.engine.runner import RunSpec
        from layer_boundary.runtime import ForwardBatch, ForwardMode
        from layer_boundary.runtime.forward_batch import token_bucket

        run_prefill, cache = self.prefill(requests, PREFIX)
        with torch.no_grad():
            run_prefill()
        tokens = [[1]] * requests
        forward = self.model
        if captured is not None:
            torch._dynamo.reset()
            step, name = decode_step(RunSpec("m", captured_decode=captured), self.model)
            forward = CapturedDecode(self.model, step, step_name=name)

        def step():
            batch = ForwardBatch.build(ForwardMode.DECODE, tokens, [PREFIX] * requests,
                                       kv_cache=cache, device="cuda")
            if captured:
                batch = batch.padded(token_bucket(requests), scratch_slot=requests)
            return forward(batch)
        return step


class _Transformers:
    def __init__(self, hf) -> None:
        self.hf = hf
        self.compiled = None

    def prefill(self, requests: int, length: int):
        ids = torch.randint(0, CONFIG["vocab_size"], (requests, length), device="cuda")
        return lambda: self.hf(input_ids=ids, logits_to_keep=1, use_cache=False).logits

    def decode(self, requests: int, compiled: bool):
        from transformers import DynamicCache, StaticCache

        ids = torch.randint(0, CONFIG["vocab_size"], (requests, PREFIX), device="cuda")
        if compiled:
            cache = StaticCache(config=self.hf.config, max_cache_len=PREFIX + 64)
            if self.compiled is None:
                self.compiled = torch.compile(self.hf.forward, mode="reduce-overhead",
                                              fullgraph=True)
            forward = self.compiled
        else:
            cache, forward = DynamicCache(config=self.hf.config), self.hf
        with torch.no_grad():
            self.hf(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                    cache_position=torch.arange(PREFIX, device="cuda"))
        token = torch.ones((requests, 1), dtype=torch.long, device="cuda")
        steps = [PREFIX]

        def step():
            # a static cache rewrites the same row each step; a dynamic one grows by a row a
            # step, as generation does
            position = torch.tensor([steps[-1]], device="cuda")
            if not compiled:
                steps.append(steps[-1] + 1)
            return forward(input_ids=token, past_key_values=cache, use_cache=True,
                           cache_position=position).logits
        return step


def _rank_rows(path: str, tp: int, captured: str | None) -> list[dict]:
    """One spawned rank's share of the multi-rank rows: ours at ``tp`` (attention TP, ``ar``)
    on this rank's GPU, the same requests on every rank; rank 0's timings are the rows'."""
    import os

    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    ours = _Ours(Path(path), tp)
    rows = []
    with torch.no_grad():
        run_prefill, _ = ours.prefill(*PREFILL)
        dist.barrier()
        rows.append((f"prefill {PREFILL[0]}x{PREFILL[1]}", _median_ms(run_prefill, 10)))
        for requests in DECODES:
            step = ours.decode(requests, captured)
            dist.barrier()
            rows.append((f"decode {requests}", _median_ms(step)))
    return rows


def multi_rank(path: Path, tp: int, log=print) -> list[dict]:
    """Ours at ``tp`` on this machine's GPUs: NCCL with a GPU a rank (each decode bucket
    replayed from its captured inductor step), else gloo with the ranks sharing the GPUs
    (graphs off: a graph cannot hold a gloo collective)."""
    from layer_boundary.engine.runner import backend_for
    from layer_boundary.runtime.launch import spawn

    backend = backend_for("cuda", tp)
    captured = "inductor" if backend == "nccl" else None
    system = f"ours tp {tp} ({backend}, {'captured' if captured else 'eager'})"
    results = spawn(_rank_rows, tp, str(path), tp, captured, backend=backend,
                    start_method="spawn", timeout_s=900, collective_timeout_s=600)
    rows = []
    for workload, ms in results[0]:
        rows.append({"workload": workload, "system": system, "ms": ms})
        log(f"  {workload:<18} {system:<28} {ms:8.3f} ms")
    return rows


@torch.no_grad()
def table(folder: Path | None = None, log=print) -> list[dict]:
    """The rows (workload, system, ms, roofline ms where it has one, ms over the roofline):
    world 1, then ours at tp 2 (``multi_rank``)."""
    folder = Path(folder or tempfile.mkdtemp(prefix="gpu_decode_"))
    bandwidth = copy_bandwidth()
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    path, hf = checkpoint(folder / "qwen3-2048x16")
    rows = _world1_rows(path, hf, bandwidth, log)
    del hf  # the ranks take the GPU next
    torch.cuda.empty_cache()
    try:
        rows += multi_rank(path, 2, log)
    except Exception as exc:  # named in the table; the world-1 rows stand
        log(f"  multi-rank rows failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        rows.append({"workload": "tp 2", "system": "ours", "error": str(exc)[:300]})
    return rows


def _world1_rows(path: Path, hf, bandwidth: float, log) -> list[dict]:
    ours, theirs = _Ours(path), _Transformers(hf)
    weights = _weight_bytes(ours.model)
    rows = []

    def add(workload, system, ms, roof=None):
        row = {"workload": workload, "system": system, "ms": ms}
        if roof is not None:
            row.update(roofline_ms=roof, over_roofline=ms / roof)
        rows.append(row)
        log(f"  {workload:<18} {system:<28} {ms:8.3f} ms"
            + (f"  roofline {roof:.3f} ms ({ms / roof:.2f}x)" if roof else ""))

    n, length = PREFILL
    add(f"prefill {n}x{length}", "ours eager", _median_ms(ours.prefill(n, length)[0], 10))
    add(f"prefill {n}x{length}", "transformers eager", _median_ms(theirs.prefill(n, length), 10))
    for requests in DECODES:
        roof = (weights + kv_bytes(requests, PREFIX)) / bandwidth * 1e3
        workload = f"decode {requests}"
        for system, step in (("ours eager", lambda: ours.decode(requests, None)),
                             ("ours captured, eager step", lambda: ours.decode(requests,
                                                                               "eager")),
                             ("ours captured, inductor step",
                              lambda: ours.decode(requests, "inductor")),
                             ("transformers eager", lambda: theirs.decode(requests, False)),
                             ("transformers compiled", lambda: theirs.decode(requests, True))):
            try:
                add(workload, system, _median_ms(step()), roof)
            except Exception as exc:  # a row that cannot run is named, the others still run
                log(f"  {workload:<18} {system:<28} failed: {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:200]}")
                rows.append({"workload": workload, "system": system, "error": str(exc)[:300]})
    return rows


if __name__ == "__main__":
    import json

    for r in table():
        print(json.dumps(r))
