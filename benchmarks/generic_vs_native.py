"""The Transformers backend against our own model file, on the same Llama checkpoint at world 1
(eager, this machine's device): a prefill of 4 x 256 tokens and a decode step of 16 requests
after it, timed interleaved (native, generic, native, ...) so drift hits both alike. Prints
each side's median and the ratio generic / native; the issue's budget is 1.15x for decode and
1.1x for prefill.

    python benchmarks/generic_vs_native.py [--device cuda] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-6,
              max_position_embeddings=4096, tie_word_embeddings=False)
PREFILL = (4, 256)
DECODE = 16


def _checkpoint(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    model.save_pretrained(folder)
    return folder


def _steps(model, device):
    """(prefill, decode) closures over a fresh cache each call."""
    from layer_boundary.runtime.forward_batch import ForwardBatch, ForwardMode

    n, length = PREFILL
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(length)] for i in range(n)]
    decoders = [[(3 * i) % 1000 + 1] for i in range(DECODE)]

    def prefill():
        cache = model.make_kv_cache(n, length)
        batch = ForwardBatch.build(ForwardMode.EXTEND, prompts, [0] * n, kv_cache=cache,
                                   device=device)
        with torch.no_grad():
            model(batch)

    cache = model.make_kv_cache(DECODE, length + 1)
    warm = ForwardBatch.build(ForwardMode.EXTEND, [p[:32] for p in prompts * (DECODE // n)],
                              [0] * DECODE, kv_cache=cache, device=device)
    with torch.no_grad():
        model(warm)

    def decode():
        batch = ForwardBatch.build(ForwardMode.DECODE, decoders, [32] * DECODE, kv_cache=cache,
                                   device=device)
        with torch.no_grad():
            model(batch)

    return prefill, decode


def _timed(fn, device) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    from layer_boundary.models import load_model
    from layer_boundary.models.checkpoint import open_checkpoint
    from layer_boundary.runtime.args import BoundaryRuntime
    from layer_boundary.runtime.parallel import ParallelDims, build_parallel

    with tempfile.TemporaryDirectory() as tmp:
        folder = _checkpoint(Path(tmp) / "llama")
        runtime = BoundaryRuntime(build_parallel(ParallelDims()))
        steps = {impl: _steps(load_model(open_checkpoint(folder, impl), runtime,
                                         device=args.device), args.device)
                 for impl in ("native", "transformers")}
        for which, index in (("prefill 4x256", 0), ("decode 16", 1)):
            times = {impl: [] for impl in steps}
            for fn in (s[index] for s in steps.values()):
                fn()  # warm-up
            for _ in range(args.repeats):
                for impl, s in steps.items():
                    times[impl].append(_timed(s[index], args.device))
            native = statistics.median(times["native"])
            generic = statistics.median(times["transformers"])
            print(f"{which:14s} native {native * 1e3:8.2f} ms  generic {generic * 1e3:8.2f} ms"
                  f"  ratio {generic / native:.3f}")


if __name__ == "__main__":
    main()
