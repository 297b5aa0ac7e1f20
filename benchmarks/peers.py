"""The library's whole forward against what a user would run instead, on the same checkpoint
and batches: `python benchmarks/peers.py [--hidden 256] [--tp 2] [--repeats 20]`.

Peers: plain transformers at world 1; at tp > 1, transformers' own tensor parallelism
(``from_pretrained(distributed_config=DistributedConfig(tp_plan="auto", tp_size=tp))``) and a
DTensor plan (``parallelize_module``: q/k/v,
gate/up column-wise, o/down row-wise, the LM head column-wise with its output gathered), on
the same gloo ranks. Workloads: a prefill of 4 x 64 tokens (each request's last logits, as
an engine needs: ``logits_to_keep=1`` for transformers), a decode step of 1 request and of
16 requests after a 64-token prefix (transformers' cache cropped back after each step, ours
rewritten in place; ``DECODE_CALLS`` steps a repeat). Eager, fp32, one thread a rank, every
peer's calls interleaved with the others' in each repeat; each figure is the minimum over
repeats of rank 0's time between two barriers, and ``ratio`` is the library's over the
peer's (``median_ratio``: the same of the medians). One JSON line per (workload, peer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

PREFILL, PREFIX = (4, 64), 64  # prefill requests x tokens; the cached prefix of a decode step
WORKLOADS = ("prefill 4x64", "decode 1", "decode 16")
# timed decode steps per repeat, after one prefix (each peer's cache back to the prefix after
# each): a decode step is short, so its minimum needs more samples than a prefill's to settle
# (at hidden 256, one request, 9 samples spread 0.92-1.05 for one build; 150 gave 0.94-0.98)
DECODE_CALLS = 4
# repeats of every peer's calls: at tp > 1 a step is mostly waiting in gloo, whose latency on
# 2 shared cores is heavy-tailed, so each minimum needs more samples there than at world 1
# (at 9 repeats single tp-2 figures spread 0.74-1.14 for one build)
REPEATS = 20


def config(hidden: int) -> dict:
    heads = max(8, hidden // 64)
    return dict(vocab_size=4096, hidden_size=hidden, intermediate_size=3 * hidden,
                num_hidden_layers=8, num_attention_heads=heads, num_key_value_heads=4,
                head_dim=hidden // heads, max_position_embeddings=512)


def checkpoint(path: Path, hidden: int) -> Path:
    import transformers

    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config(hidden))).save_pretrained(
        path)
    return path


def _sync() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


class Library:
    """``layer_boundary``'s model on this rank (tp = the world), its KV cache reused."""

    name = "layer_boundary"

    def __init__(self, path: str, tp: int) -> None:
        from layer_boundary.models import load_model
        from layer_boundary.runtime.args import BoundaryRuntime
        from layer_boundary.runtime.parallel import ParallelDims, build_parallel

        runtime = BoundaryRuntime(build_parallel(ParallelDims(world_size=tp, tp=tp)),
                                  boundary_reduction="rs+rsv", choose_by_bytes=True)
        self.model = load_model(path, runtime).eval()
        self.cache = self.model.make_kv_cache(16, PREFIX + 2)

    def _batch(self, mode, requests, prefix):
        from layer_boundary.runtime import ForwardBatch, LogitsRows

        batch = ForwardBatch.build(mode, requests, prefix, kv_cache=self.cache)
        batch.logits_rows = LogitsRows.LAST
        return batch

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        from layer_boundary.runtime import ForwardMode

        return self.model(self._batch(ForwardMode.EXTEND, ids.tolist(), [0] * len(ids)))

    def prepare_decode(self, ids: torch.Tensor) -> None:
        self.prefill(ids)

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        from layer_boundary.runtime import ForwardMode

        return self.model(self._batch(ForwardMode.DECODE, token.tolist(),
                                      [PREFIX] * len(token)))


class Transformers:
    """A transformers model (sdpa attention); its cache is cropped back after each decode."""

    def __init__(self, name: str, model) -> None:
        self.name, self.model = name, model.eval()

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, logits_to_keep=1).logits[:, -1]

    def prepare_decode(self, ids: torch.Tensor) -> None:
        self.cache = self.model(input_ids=ids, use_cache=True).cache

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=token, cache=self.cache, use_cache=True).logits
        self.cache.crop(-1)  # back to the prefix
        return out[:, -1]


def dtensor_tp(model, tp: int):
    """``model`` (replicated) under a DTensor tensor-parallel plan over ``tp`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (tp,))
    plan = {f"{m}.{p}": ColwiseParallel() for m, ps in (("self_attn", "qkv"),
                                                         ("mlp", ("gate", "up")))
            for p in (f"{x}_proj" for x in ps)}
    plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    return model


def peers_rank(path: str, tp: int, repeats: int) -> list:
    """One rank: every workload on every peer, interleaved; rank 0's minimum times (ms)."""
    import transformers

    torch.set_num_threads(1)
    torch.manual_seed(0)
    load = lambda **kw: transformers.Qwen3ForCausalLM.from_pretrained(  # noqa: E731
        path, dtype=torch.float32, attn_implementation="sdpa", **kw)
    runs = [Library(path, tp)]
    if tp == 1:
        runs.append(Transformers("transformers", load()))
    else:
        from transformers.distributed import DistributedConfig

        # tp_size explicit: without it transformers reads WORLD_SIZE from the environment,
        # which spawned ranks do not set, and silently shards over 1 rank
        runs.append(Transformers("transformers TP", load(
            distributed_config=DistributedConfig(tp_plan="auto", tp_size=tp))))
        runs.append(Transformers("DTensor TP", dtensor_tp(load(), tp)))
    vocab = runs[0].model.config.vocab_size
    prompts = torch.randint(1, vocab, PREFILL)
    contexts = {n: torch.randint(1, vocab, (n, PREFIX)) for n in (1, 16)}
    tokens = {n: torch.randint(1, vocab, (n, 1)) for n in (1, 16)}
    times = {(w, r.name): [] for w in WORKLOADS for r in runs}
    calls = {w: 1 if w == "prefill 4x64" else DECODE_CALLS for w in WORKLOADS}  # a repeat's
    with torch.no_grad():
        # the same numbers first: each peer's last logits against the library's
        want = runs[0].prefill(prompts)
        for r in runs[1:]:
            torch.testing.assert_close(r.prefill(prompts), want, atol=2e-4, rtol=1e-4)
        for _ in range(repeats + 1):  # the first round warms up
            for w in WORKLOADS:
                n = 16 if w == "decode 16" else 1
                for r in runs:
                    if w != "prefill 4x64":
                        r.prepare_decode(contexts[n])
                    call = (lambda: r.prefill(prompts)) if w == "prefill 4x64" else (
                        lambda: r.decode(tokens[n]))
                    for _ in range(calls[w]):
                        _sync()
                        start = time.perf_counter()
                        call()
                        _sync()
                        times[(w, r.name)].append(time.perf_counter() - start)
    kept = {k: v[calls[k[0]]:] for k, v in times.items()}  # round 1 warmed up
    best = {k: min(v) * 1e3 for k, v in kept.items()}
    # the median beside the minimum: at tp > 1 a step's time is heavy-tailed (gloo), so one
    # lucky sample can set a minimum that the bulk of the steps never approach
    mid = {k: statistics.median(v) * 1e3 for k, v in kept.items()}
    lib = runs[0].name
    return [dict(bench="peers", workload=w, tp=tp, peer=r.name, ms=best[(w, r.name)],
                 lib_ms=best[(w, lib)], ratio=best[(w, lib)] / best[(w, r.name)],
                 median_ms=mid[(w, r.name)], lib_median_ms=mid[(w, lib)],
                 median_ratio=mid[(w, lib)] / mid[(w, r.name)])
            for w in WORKLOADS for r in runs[1:]]


def peers(hidden: int = 256, tp: int = 1, repeats: int = REPEATS) -> list:
    """The rows of ``peers_rank`` at ``tp`` ranks (spawned over gloo) on a fresh checkpoint."""
    from layer_boundary.runtime.launch import spawn

    with tempfile.TemporaryDirectory() as tmp:
        path = str(checkpoint(Path(tmp) / "qwen3", hidden))
        if tp == 1:
            rows = peers_rank(path, 1, repeats)
        else:
            rows = spawn(peers_rank, tp, path, tp, repeats, timeout_s=3600)[0]
    return [dict(row, hidden=hidden) for row in rows]


def main(argv) -> None:
    parser = argparse.ArgumentParser(prog="benchmarks/peers.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    args = parser.parse_args(argv)
    for row in peers(args.hidden, args.tp, args.repeats):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import peers  # the ranks import peers_rank from the module, not from __main__

    peers.main(sys.argv[1:])
