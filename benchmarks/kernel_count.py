"""What one decode layer launches: `python benchmarks/kernel_count.py [--device cuda] [--row ROW]`.

At decode sizes a GPU kernel costs a few microseconds of launch and scheduling whatever its
work, and a captured CUDA graph replays every kernel the eager step launched, so the kernels
of one decode layer are the GPU cost a CPU can count. Two counts, each per layer as the
difference between a 4-layer and a 2-layer tiny Qwen3 (hidden 64) over 2, so that the
embedding, the final norm and the LM head drop out:

- ``dispatcher``: the aten ops a padded decode step dispatches that are not views (each is a
  kernel or more on a GPU, a few are host-only), plus each Triton launch of the fusion
  provider (the ops its interpreter runs on the CPU are not counted);
- ``cuda`` (on a GPU): the kernels the profiler saw run, memory copies and sets included.

Rows: ours eager, ours with ``--fusions triton`` (whose caches decode attention in place,
``KVCache.decode_in_place``: Triton launches where the gather and SDPA were; and the same with
the gathering path), ours compiled by inductor (CUDA only; and with the Triton provider, its
launches custom ops in the graph: ``runtime.kernel_ops``), and transformers eager (its
``generate``'s step: a DynamicCache decode of the same requests).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

LAYERS = (2, 4)
PROMPTS = [[3, 1, 4], [1, 5], [9, 2, 6, 5]]


class _Dispatched(TorchDispatchMode):
    """Counts the non-view aten ops dispatched inside it (by name), except while ``paused``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        view = any(r.alias_info is not None and not r.alias_info.is_write
                   for r in schema.returns)
        if not self.paused and not view:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _triton_launches(mode: _Dispatched):
    """Each launch of the Triton provider's kernels counts as one op, and what its interpreter
    runs inside (numpy and torch on the CPU) does not."""
    from layer_boundary.fusions import kernels
    from layer_boundary.models import decode_kernel

    # every public function of the kernels module launches one kernel (a new one counts
    # without being listed here)
    originals = {(kernels, name): fn for name, fn in vars(kernels).items()
                 if inspect.isfunction(fn) and fn.__module__ == kernels.__name__
                 and not name.startswith("_")}
    originals[(decode_kernel, "launch")] = decode_kernel.launch

    def counted(name, call):
        def launch(*args, **kwargs):
            mode.ops[f"triton:{name}"] += 1
            mode.paused += 1
            try:
                return call(*args, **kwargs)
            finally:
                mode.paused -= 1
        return launch

    for (module, name), call in originals.items():
        setattr(module, name, counted(name, call))
    try:
        yield
    finally:
        for (module, name), call in originals.items():
            setattr(module, name, call)


def _checkpoint(folder: Path, layers: int) -> Path:
    from layer_boundary.models.tiny import write_tiny_qwen3

    return write_tiny_qwen3(folder / f"qwen3-{layers}", num_hidden_layers=layers)


def _ours(path: Path, device: str, fusions: str | None, backend: str | None,
          in_place: bool | None = None):
    """A decode step of ours after a prefill: the callable and the step's batch."""
    from layer_boundary.engine.compiled import compile_forward
    from layer_boundary.engine.runner import make_fusions
    from layer_boundary.models import load_model
    from layer_boundary.runtime import BoundaryRuntime, ForwardBatch, ForwardMode, ParallelDims
    from layer_boundary.runtime.forward_batch import token_bucket
    from layer_boundary.runtime.parallel import build_parallel

    runtime = BoundaryRuntime(build_parallel(ParallelDims()), boundary_reduction="ar")
    model = load_model(str(path), runtime, device=device)
    if fusions is not None:
        model.install_fusion(make_fusions(fusions))
    slots = len(PROMPTS) + 1
    cache = model.make_kv_cache(slots, 32)
    if in_place is not None:  # else the model's choice (the Triton provider's: in place)
        cache.decode_in_place = in_place
    with torch.no_grad():
        model(ForwardBatch.build(ForwardMode.EXTEND, PROMPTS, [0] * len(PROMPTS),
                                 kv_cache=cache, device=device))
    step = ForwardBatch.build(ForwardMode.DECODE, [[7]] * len(PROMPTS),
                              [len(p) for p in PROMPTS], kv_cache=cache,
                              device=device).padded(token_bucket(len(PROMPTS)),
                                                    scratch_slot=slots - 1)
    forward = model if backend is None else compile_forward(model, backend, padded=True)
    return forward, step


def _transformers(path: Path, device: str):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS], device=device)
    mask = (torch.arange(width, device=device)[None] >= torch.tensor(
        [width - len(p) for p in PROMPTS], device=device)[:, None]).long()
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask, use_cache=True)
    cache = out.past_key_values
    step_ids = torch.full((len(PROMPTS), 1), 7, device=device)
    step_mask = torch.cat((mask, torch.ones_like(step_ids)), dim=1)

    def step(_):
        return hf(input_ids=step_ids, attention_mask=step_mask, past_key_values=cache,
                  use_cache=True).logits

    return step, None


def dispatched(forward, batch, fusions: bool) -> Counter:
    """The non-view aten ops (and Triton launches) of ``forward(batch)``, by name: a warm
    step, as ``cuda_kernels`` counts and a captured graph replays (the process's first step
    does one-time work that the first row counted, 1.5 ops a layer less than its repeat)."""
    with torch.no_grad():
        forward(batch)
    mode = _Dispatched()
    with torch.no_grad(), mode, (_triton_launches(mode) if fusions
                                  else contextlib.nullcontext()):
        forward(batch)
    return mode.ops


def cuda_kernels(forward, batch) -> int:
    """The kernels (copies and sets included) the profiler saw ``forward(batch)`` run."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        forward(batch)  # compiled: the graph is built before the profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            forward(batch)
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def per_layer(device: str = "cpu", rows=("ours", "ours, triton fusions", "transformers"),
              folder: Path | None = None, layers: tuple[int, int] = LAYERS) -> list[dict]:
    """Each row's per-layer count: ``dispatcher`` always, ``cuda`` on a CUDA device; the
    difference of two models' counts (``layers``) over their difference in layers."""
    folder = Path(folder or tempfile.mkdtemp(prefix="kernel_count_"))
    paths = {n: _checkpoint(folder, n) for n in layers}
    out = []
    for row in rows:
        counts = {"dispatcher": [], "cuda": []}
        for n in layers:
            if row == "transformers":
                forward, batch = _transformers(paths[n], device)
            else:
                forward, batch = _ours(paths[n], device,
                                       "triton" if "triton" in row else None,
                                       "inductor" if "inductor" in row else None,
                                       in_place=False if "gathering" in row else None)
            if "inductor" not in row:  # a compiled forward dispatches its graph, not ops
                counts["dispatcher"].append(sum(dispatched(forward, batch,
                                                           "triton" in row).values()))
            if device == "cuda":
                counts["cuda"].append(cuda_kernels(forward, batch))
        record = {"row": row, "device": device}
        for kind, (two, four) in ((k, v) for k, v in counts.items() if v):
            record[kind] = (four - two) / (layers[1] - layers[0])
        out.append(record)
    return out


ROWS = ("ours", "ours, triton fusions", "ours, triton fusions, gathering", "transformers",
        "ours, inductor", "ours, inductor, triton fusions")


def main(argv=None) -> int:
    """Print each row's counts as one JSON object a line; a device this machine lacks is one
    line on stderr (exit 2). On the CPU the Triton row's kernels run under Triton's
    interpreter, chosen here before anything imports triton (as ``layer-boundary run
    --fusions triton`` chooses it): without it the row ended in a traceback."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--row", action="append", choices=ROWS, default=None,
                        help="a row to count (repeatable; default: every row the device runs; "
                             "ours, inductor needs CUDA)")
    parser.add_argument("--layers", nargs=2, type=int, default=LAYERS, metavar=("FEWER", "MORE"),
                        help="the two layer counts whose difference gives a layer's count "
                             f"(default: {LAYERS[0]} {LAYERS[1]})")
    args = parser.parse_args(argv)
    if not 1 <= args.layers[0] < args.layers[1]:
        parser.error(f"--layers {args.layers[0]} {args.layers[1]}: two counts, the first at "
                     "least 1 and below the second")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("kernel_count: error: --device cuda, but torch sees no CUDA device here (count "
              "on the CPU: leave --device out)", file=sys.stderr)
        return 2
    rows = tuple(args.row or (r for r in ROWS if args.device == "cuda" or "inductor" not in r))
    if args.device == "cpu":
        compiled = [r for r in rows if "inductor" in r]
        if compiled:
            parser.error(f"the row '{compiled[0]}' counts CUDA kernels: add --device cuda")
        from layer_boundary.fusions.triton_provider import use_interpreter  # imports no triton

        use_interpreter()
    for record in per_layer(args.device, rows, layers=tuple(args.layers)):
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
