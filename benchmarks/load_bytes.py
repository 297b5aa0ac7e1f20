"""What each rank reads from the checkpoint, and its peak memory, at tp 4 against world 1:
`python benchmarks/load_bytes.py`.

A hidden-1024, 8-layer Qwen3 (transformers save_pretrained, random weights). Each rank
loads its model through the sharded loader (safetensors slices: a sharded layer reads only
its rows or columns) and reports the bytes it read, the bytes it keeps and its peak RSS;
the same ranks then load once more reading whole tensors (the loader before slices), each
load in a fresh process, so the two peaks compare. Prints one JSON line per world size.
"""

import json
import resource
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


def load_rank(model_dir: str, tp: int, lazy: bool) -> dict:
    from layer_boundary.models import load_config, model_class_of
    from layer_boundary.models.loader import iter_weights
    from layer_boundary.engine.runner import RunSpec, make_runtime
    from layer_boundary.runtime.shards import ReadBytes

    runtime = make_runtime(RunSpec(model_dir, tp=tp))
    model = model_class_of(model_dir)(load_config(model_dir), runtime)
    before = _peak_mb()
    read = ReadBytes()
    weights = iter_weights(model_dir, lazy=lazy, read=read)
    if not lazy:  # count what the whole tensors held
        weights = ((n, t) for n, t in weights if not setattr(read, "bytes", read.bytes
                                                              + t.numel() * t.element_size()))
    model.load_weights(weights)
    kept = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"read_mb": read.bytes / 2 ** 20, "kept_mb": kept / 2 ** 20,
            "peak_before_mb": before, "peak_after_mb": _peak_mb()}


if __name__ == "__main__":
    from layer_boundary.runtime.launch import spawn

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(checkpoint(Path(tmp) / "qwen3_1024x8"))
        size = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / 2 ** 20
        for tp in (1, 4):
            sliced = spawn(load_rank, tp, model_dir, tp, True)
            whole = spawn(load_rank, tp, model_dir, tp, False)
            print(json.dumps({
                "tp": tp, "checkpoint_mb": round(size, 1),
                "read_mb": [round(r["read_mb"], 1) for r in sliced],
                "kept_mb": [round(r["kept_mb"], 1) for r in sliced],
                "whole_tensors_read_mb": [round(r["read_mb"], 1) for r in whole],
                "peak_rss_mb": [round(r["peak_after_mb"]) for r in sliced],
                "whole_tensors_peak_rss_mb": [round(r["peak_after_mb"]) for r in whole],
                "peak_before_load_mb": [round(r["peak_before_mb"]) for r in sliced]}),
                flush=True)
    sys.exit(0)
