"""What the batch-invariant mode costs (``run --batch-invariant``, ``runtime/invariant.py``):
the same Qwen3 forwards at world 1, the mode off and on, timed interleaved (off, on, off, ...)
so drift hits both alike. A Qwen3 of hidden 256 x 8 layers (vocab 4096), one thread: a prefill
of 4 x 64 tokens, a decode step of one request and of 16. Prints each side's median and the
ratio on / off.

    python benchmarks/batch_invariance.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=4, head_dim=32, rms_norm_eps=1e-6,
              max_position_embeddings=1024, tie_word_embeddings=False)
PREFILL = (4, 64)


def _checkpoint(folder: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**CONFIG)).save_pretrained(folder)
    return folder


def _steps(model):
    """name -> a closure running one forward (a fresh cache for the prefill)."""
    from layer_boundary.runtime.forward_batch import ForwardBatch, ForwardMode

    n, length = PREFILL
    prompts = [[(7 * i + j) % 4000 + 1 for j in range(length)] for i in range(n)]

    def prefill():
        cache = model.make_kv_cache(n, length)
        model(ForwardBatch.build(ForwardMode.EXTEND, prompts, [0] * n, kv_cache=cache))

    def decode(requests: int):
        cache = model.make_kv_cache(requests, length + 1)
        model(ForwardBatch.build(ForwardMode.EXTEND, [prompts[i % n] for i in range(requests)],
                                 [0] * requests, kv_cache=cache))
        ids = [[(3 * i) % 4000 + 1] for i in range(requests)]
        return lambda: model(ForwardBatch.build(ForwardMode.DECODE, ids, [length] * requests,
                                                kv_cache=cache))

    return {"prefill 4x64": prefill, "decode 1": decode(1), "decode 16": decode(16)}


def _timed(fn, on: bool) -> float:
    from layer_boundary.runtime.invariant import batch_invariant

    with torch.no_grad(), batch_invariant() if on else contextlib.nullcontext():
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from layer_boundary.models import load_model
    from layer_boundary.models.checkpoint import open_checkpoint
    from layer_boundary.runtime.args import BoundaryRuntime
    from layer_boundary.runtime.parallel import ParallelDims, build_parallel

    with tempfile.TemporaryDirectory() as tmp:
        folder = _checkpoint(Path(tmp) / "qwen3")
        runtime = BoundaryRuntime(build_parallel(ParallelDims()))
        model = load_model(open_checkpoint(folder), runtime)
        for name, fn in _steps(model).items():
            times = {False: [], True: []}
            for on in (False, True):
                _timed(fn, on)  # warm-up
            for _ in range(args.repeats):
                for on in (False, True):
                    times[on].append(_timed(fn, on))
            off, on = statistics.median(times[False]), statistics.median(times[True])
            print(f"{name:13s} usual {off * 1e3:8.2f} ms  invariant {on * 1e3:8.2f} ms"
                  f"  ratio {on / off:.2f}")


if __name__ == "__main__":
    main()
