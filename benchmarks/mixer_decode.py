"""The recurrent mixers' decode step over a batch: `python benchmarks/mixer_decode.py`.

A Nemotron-H (Mamba2) and a Qwen3-Next (gated DeltaNet) of the tests' tiny sizes, world 1,
one thread: after a prefill of 16 requests, one decode step of all 16, timed with each
layer's conv and state update run once over the batch (what the mixers do) and with the
per-request loop a prefill takes (``ForwardBatch.decode_step`` patched to say no),
interleaved, minimum of 30 each. Prints one JSON line per model: both times (ms) and
``loop_vs_batched``.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tiny checkpoints

from checkpoints.nh import hf_nemotron_h  # noqa: E402
from checkpoints.qwen3_next import hf_qwen3_next  # noqa: E402
from oracle import world1  # noqa: E402

from layer_boundary.models import load_model  # noqa: E402
from layer_boundary.runtime.forward_batch import ForwardBatch, ForwardMode  # noqa: E402

REQUESTS, REPEATS = 16, 30


def _set_decode_step(prop: property) -> None:
    ForwardBatch.decode_step = prop


def measure(model) -> dict:
    prompts = [[(7 * i + j) % 50 + 1 for j in range(5 + i % 4)] for i in range(REQUESTS)]
    cache = model.make_kv_cache(REQUESTS, 64)
    with torch.no_grad():
        model(ForwardBatch.build(ForwardMode.EXTEND, prompts, [0] * REQUESTS, kv_cache=cache))
    prefix = [len(p) for p in prompts]

    def step() -> float:  # the same step each time: the cached prefix stays as it is
        batch = ForwardBatch.build(ForwardMode.DECODE, [[3]] * REQUESTS, prefix,
                                   kv_cache=cache)
        start = time.perf_counter()
        with torch.no_grad():
            model(batch)
        return time.perf_counter() - start

    batched = ForwardBatch.decode_step  # the property itself
    times = {"batched": [], "loop": []}
    try:
        for _ in range(REPEATS):
            for kind, prop in (("batched", batched), ("loop", property(lambda fb: False))):
                _set_decode_step(prop)
                times[kind].append(step())
    finally:
        _set_decode_step(batched)
    out = {f"{k}_ms": min(v) * 1e3 for k, v in times.items()}
    out["loop_vs_batched"] = out["loop_ms"] / out["batched_ms"]
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    root = tempfile.mkdtemp()
    for name, make in (("nemotron_h", hf_nemotron_h), ("qwen3_next", hf_qwen3_next)):
        model = load_model(make(Path(root) / name), world1())
        print(json.dumps(dict(model=name, requests=REQUESTS, **measure(model))), flush=True)
