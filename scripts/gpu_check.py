"""The checks that need a CUDA device (scripts/gpu_check.sh runs this): one table, exit 1 if a
check fails, exit 2 (saying so) where no CUDA device is visible. NOTE rows report what they
found without a verdict.

Sections (`--only SECTION,...` runs some; the whole script takes more than one device call's
ten minutes on an H100, so split it: `--only parity,cli,kernels,captured,counts`, then
`--only perf`, then `--only perf7b`):
- parity: world 1 against transformers on CUDA, fp32 and bf16, on the reference checkpoints
  (Qwen3, Qwen3-MoE, Qwen3.5-MoE): max |logit diff| against the logits' scale;
- cli: `layer-boundary run --device cuda` (decode replayed from captured graphs, `--compile`,
  `--fusions triton`) and at tp 2 (NCCL with a GPU per rank, else two ranks sharing one GPU
  over gloo), each report's parity against eager world 1 and where graphs ran; `--compile`
  over gloo refused by name, and the same run through the library as a NOTE (its failure's
  traceback kept in --json's "probes");
- kernels: the Triton kernels compiled for the GPU against the interpreter (CPU), each one's
  bandwidth against the device's copy bandwidth (the FP8 kernel's at 0.8 or more, and a NOTE
  of it by warps), the in-place decode attention against the gathering path;
- captured: a decode step captured as a CUDA graph and replayed (holding the eager or the
  inductor step, each plain and with the Triton provider decoding in place) against the
  eager step that gathers whole slots;
- counts: the kernels one decode layer launches (benchmarks/kernel_count.py's rows);
- perf, perf7b: benchmarks/gpu_decode.py's tables (a Qwen3 of hidden 2048 x 16, then the
  Llama-2-7B shape): ours eager and captured against transformers eager and compiled,
  interleaved, each decode against its HBM roofline.

`--json FILE` writes every row, count and timing there, after each section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

ROWS: list[tuple[str, str, str]] = []  # (check, verdict, detail)


def row(check: str, ok: bool, detail: str) -> None:
    ROWS.append((check, "PASS" if ok else "FAIL", detail))
    print(f"  {check}: {'PASS' if ok else 'FAIL'}  {detail}", flush=True)


def note(check: str, detail: str) -> None:
    """A row that reports what it found without a verdict (not in the exit status)."""
    ROWS.append((check, "NOTE", detail))
    print(f"  {check}: NOTE  {detail}", flush=True)


def guarded(check: str):
    def wrap(fn):
        def run(*args):
            try:
                fn(*args)
            except Exception as exc:  # a check that cannot run is a failed check, named
                row(check, False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        return run
    return wrap


def checkpoints(root: Path) -> dict:
    from checkpoints import hf_qwen3, hf_qwen3_moe
    from checkpoints.qwen3_next import hf_qwen3_next

    return {"qwen3": hf_qwen3(root / "qwen3"), "qwen3_moe": hf_qwen3_moe(root / "qwen3_moe"),
            "qwen3_5_moe": hf_qwen3_next(root / "qwen3_5_moe", "qwen3_5_moe")}


@torch.no_grad()
def world1_against_transformers(name: str, path: Path) -> None:
    import transformers

    from layer_boundary.models import load_model
    from layer_boundary.runtime import BoundaryRuntime, ForwardBatch, ForwardMode, ParallelDims
    from layer_boundary.runtime.parallel import build_parallel

    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5], [8, 9, 7, 9, 3, 2]]
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 4e-2)):
        check = f"world 1 vs transformers, {name}, {str(dtype).split('.')[-1]}"

        @guarded(check)
        def one():
            runtime = BoundaryRuntime(build_parallel(ParallelDims()), boundary_reduction="ar")
            ours = load_model(str(path), runtime, dtype=dtype, device="cuda")
            fb = ForwardBatch.build(ForwardMode.EXTEND, prompts, [0] * len(prompts),
                                    kv_cache=ours.make_kv_cache(len(prompts), 16),
                                    device="cuda")
            mine = ours(fb).float()
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda()
            theirs = torch.cat([hf(input_ids=torch.tensor([p], device="cuda")).logits[0]
                                for p in prompts]).float()
            scale = theirs.abs().max().item()
            diff = (mine - theirs).abs().max().item()
            row(check, diff <= tol * max(scale, 1.0), f"max |diff| {diff:.2e}, scale {scale:.2f}")
        one()


def cli_run(check: str, path: Path, *extra: str, graphs: str | None = None) -> None:
    """``run --device cuda --json EXTRA``: its verdict, and where ``graphs`` is given the mode
    its report must give for CUDA graphs ("captured", "inductor", "off")."""
    @guarded(check)
    def one():
        proc = subprocess.run(
            [sys.executable, "-m", "layer_boundary", "run", "--model", str(path), "--device",
             "cuda", "--json", *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"exit {proc.returncode}: {_error_line(proc.stderr)}")
        report = json.loads(proc.stdout)
        parity = report["parity"] or {}
        detail = (f"tokens match {parity.get('tokens_match')}, max |diff| "
                  f"{parity.get('max_abs_diff', float('nan')):.2e}")
        if "fused_stages" in report:
            detail += f", fused {len(report['fused_stages'])} stage inputs"
        cuda_graphs = report.get("cuda_graphs", {})
        detail += f"; graphs {cuda_graphs.get('mode')}: {cuda_graphs.get('why', '')[:90]}"
        for key in ("buckets", "replays", "skipped"):
            if key in cuda_graphs:
                detail += f", {key} {cuda_graphs[key]}"
        # a world-1 run without graphs is its own reference (NOT_CHECKED); every run with
        # graphs is compared with the eager world-1 run
        ok = (report["verdict"] == "NOT_CHECKED" and graphs == "off" and "--tp" in extra
              and extra[extra.index("--tp") + 1] == "1") or (
            bool(parity.get("tokens_match")) and report["verdict"] == "PASS")
        if graphs is not None:
            ok &= cuda_graphs.get("mode") == graphs and not cuda_graphs.get("skipped")
            ok &= graphs != "captured" or bool(cuda_graphs.get("replays"))
        row(check, ok, detail)
    one()


def _error_line(stderr: str) -> str:
    """The line that says why a run failed: the command's own error, a rank's, or the last
    line naming an error or a signal (a warning printed on the way out comes after it)."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    for marks in (("layer-boundary: error",), ("Error", "error:", "signal", "SIG")):
        found = [line for line in lines if any(m in line for m in marks)]
        if found:
            return found[-1][:300]
    return lines[-1][:300] if lines else "no output"


def cli_rows(paths: dict, gpus: int) -> None:
    transport = "nccl" if gpus >= 2 else "gloo, 2 ranks on one GPU"
    multi = "captured" if gpus >= 2 else "off"  # graphs never hold a gloo collective
    qwen3 = paths["qwen3"]
    cli_run("run --device cuda (decode from captured graphs of the inductor step)", qwen3,
            "--tp", "1", graphs="captured")
    cli_run("run --device cuda --captured-decode eager", qwen3, "--tp", "1",
            "--captured-decode", "eager", graphs="captured")
    cli_run("run --device cuda, Qwen3-MoE (captured)", paths["qwen3_moe"], "--tp", "1",
            graphs="captured")
    cli_run("run --device cuda --disable-cuda-graph", qwen3, "--tp", "1",
            "--disable-cuda-graph", graphs="off")
    cli_run("run --device cuda --tp 1 --fusions triton (captured)", qwen3, "--tp", "1",
            "--fusions", "triton", graphs="captured")
    cli_run(f"run --device cuda --tp 2 ({transport})", qwen3, "--tp", "2", graphs=multi)
    cli_run(f"run --device cuda --tp 2 --dp 2 rsv ({transport})", qwen3, "--tp", "2", "--dp",
            "2", "--boundary-reduction", "rsv", graphs=multi)
    cli_run(f"run --device cuda --tp 2 --fusions triton ({transport})", paths["qwen3_5_moe"],
            "--tp", "2", "--fusions", "triton", graphs="off")  # gated DeltaNet: no padding
    cli_run("run --device cuda --compile (inductor, CUDA graphs per bucket)", qwen3,
            "--tp", "1", "--compile", graphs="inductor")
    cli_run("run --device cuda --fusions triton --compile (the kernels' ops in the graph)",
            qwen3, "--tp", "1", "--fusions", "triton", "--compile", graphs="inductor")
    if gpus >= 2:
        cli_run(f"run --device cuda --tp 2 --compile ({transport})", qwen3, "--tp", "2",
                "--compile", graphs="inductor")
        cli_run(f"run --device cuda --tp 2 --dp 2 rsv --compile ({transport})", qwen3, "--tp",
                "2", "--dp", "2", "--boundary-reduction", "rsv", "--compile", graphs="inductor")
    else:  # refused by name (engine.features): the library probe below reads why
        cli_refused("run --device cuda --tp 2 --compile over gloo: refused", qwen3,
                    "--compile with --device cuda over gloo", "--tp", "2", "--compile")
    compiled_over_gloo(qwen3)


def cli_refused(check: str, path: Path, expected: str, *extra: str) -> None:
    """``run --device cuda EXTRA`` ends with exit 2 and the one-line refusal ``expected``."""
    @guarded(check)
    def one():
        proc = subprocess.run(
            [sys.executable, "-m", "layer_boundary", "run", "--model", str(path), "--device",
             "cuda", *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)
        line = _error_line(proc.stderr)
        row(check, proc.returncode == 2 and expected in line, f"exit {proc.returncode}: {line}")
    one()


def compiled_over_gloo(path: Path) -> None:
    """Two ranks sharing GPU 0 over gloo, each compiling a prefill and a decode step by
    inductor through the library (scripts/gpu_ranks.py): what ``run`` refuses, run to read
    why it failed on the H200 (or that it works: then the refusal in engine/features.py,
    ``_check_compiled_transport``, can go). A note, not a verdict."""
    from gpu_ranks import compiled_step_over_gloo

    from layer_boundary.runtime.launch import spawn

    check = "compiled tp 2 over gloo on CUDA (library; run refuses it)"
    try:
        # bounded well inside a device call: a hang here would spend the session's GPU time
        diffs = spawn(compiled_step_over_gloo, 2, str(path), backend="gloo",
                      start_method="spawn", timeout_s=240, collective_timeout_s=180)
        note(check, f"ran: max |diff| against eager {max(diffs):.2e} on each rank {diffs}")
    except Exception as exc:  # the reason, kept whole in --json
        text = f"{type(exc).__name__}: {exc}"
        RESULTS.setdefault("probes", {})[check] = text
        tail = " | ".join(line.strip() for line in text.strip().splitlines()[-6:])
        note(check, f"failed: {tail[:600]}")


KERNEL_SHAPES = ((7, 48), (33, 4096))


def kernel_cases(device: str) -> list:
    """The inputs both modes run: (name, args) per kernel, dtype and shape."""
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows, width in KERNEL_SHAPES:
            gen = torch.Generator().manual_seed(rows)
            value = torch.randn(rows, width, generator=gen).to(dtype).to(device)
            residual = torch.randn(rows, width, generator=gen).to(dtype).to(device)
            weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype).to(device)
            tag = f"{str(dtype).split('.')[-1]} {rows}x{width}"
            cases.append((f"add_rms_norm {tag}", "add_rms_norm",
                          (value, residual, weight, 1e-6, False)))
            cases.append((f"add_rms_norm gemma {tag}", "add_rms_norm",
                          (value, residual, weight - 1, 1e-6, True)))
            cases.append((f"add_rms_norm_fp8 {tag}", "add_rms_norm_fp8",
                          (value, residual, weight, 1e-6, 16, False)))
            cases.append((f"silu_mul {tag}", "silu_mul", (value, residual)))
    return cases


def interpreted_outputs(out: Path) -> None:
    """In a process with TRITON_INTERPRET=1: every case's outputs on the CPU, saved."""
    from layer_boundary.fusions import kernels

    torch.save({name: [t.float() for t in getattr(kernels, fn)(*args)]
                for name, fn, args in kernel_cases("cpu")}, out)


@guarded("Triton kernels compiled vs interpreter")
def kernels_against_interpreter(work: Path) -> None:
    from layer_boundary.fusions import kernels

    saved = work / "interpreted.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    subprocess.run([sys.executable, __file__, "--interpreted", str(saved)], cwd=ROOT, env=env,
                   check=True, timeout=300)
    interpreted = torch.load(saved)
    for name, fn, args in kernel_cases("cuda"):
        compiled = [t.float().cpu() for t in getattr(kernels, fn)(*args)]
        # fp32 statistics may differ in the last bit between the GPU and numpy; a rounded
        # value then moves by one step of its dtype
        worst = max(((c - i).abs() / i.abs().clamp_min(1e-6)).max().item()
                    for c, i in zip(compiled, interpreted[name]))
        limit = 1e-6 if "float32" in name and "fp8" not in name else 2 ** -7 + 1e-6
        if "fp8" in name:
            limit = 2 ** -3 + 1e-6  # one e4m3 step
        row(f"kernel {name}", worst <= limit, f"max relative diff {worst:.1e}")


DECODE_VARIANTS = {"gqa": {}, "layer window": {"window": 4}, "sinks": {"sinks": True},
                   "softcap": {"softcap": 2.5}, "ring": {"ring": 5}}


@guarded("decode in place")
def decode_in_place(dtype=torch.bfloat16) -> None:
    """models/decode_kernel.py compiled for the GPU against the gathering path, a padded decode
    step (ragged prefixes, a scratch slot) of every variant; the ring decodes unpadded. Where
    it passes, KVCache.decode_in_place may become CUDA's default."""
    from layer_boundary.models.attention import cached_attention
    from layer_boundary.models.kv_cache import KVCache
    from layer_boundary.runtime.forward_batch import ForwardBatch, ForwardMode

    heads, kv_heads, dim, prompts = 16, 4, 128, (300, 7, 1000)
    for name, variant in DECODE_VARIANTS.items():
        outs = []
        for in_place in (False, True):
            gen = torch.Generator().manual_seed(0)

            def rand(*shape):
                return torch.randn(*shape, generator=gen).to(dtype).cuda()

            cache = KVCache(1, 4, 1024, kv_heads, dim, dtype, device="cuda",
                            window=variant.get("ring"))
            cache.decode_in_place = in_place
            kwargs = dict(window=variant.get("window"), softcap=variant.get("softcap"),
                          sinks=rand(heads).float() if variant.get("sinks") else None)
            batch = ForwardBatch.build(ForwardMode.EXTEND, [[1] * n for n in prompts],
                                       [0] * 3, kv_cache=cache, device="cuda")
            n = sum(prompts)
            cached_attention(0, rand(n, heads, dim), rand(n, kv_heads, dim),
                             rand(n, kv_heads, dim), batch, dim ** -0.5, **kwargs)
            step = ForwardBatch.build(ForwardMode.DECODE, [[1]] * 3, list(prompts),
                                      kv_cache=cache, device="cuda")
            rows = 3 if "ring" in variant else 4
            if rows == 4:
                step = step.padded(4, scratch_slot=3)
            outs.append(cached_attention(0, rand(rows, heads, dim), rand(rows, kv_heads, dim),
                                         rand(rows, kv_heads, dim), step, dim ** -0.5,
                                         **kwargs)[:3].float())
        worst = (outs[1] - outs[0]).abs().max().item()
        scale = outs[0].abs().max().item()
        row(f"decode in place {name} ({str(dtype).split('.')[-1]})", worst <= 2e-2 * scale,
            f"max diff {worst:.1e} of outputs up to {scale:.2f}")


def _timed(fn, repeats: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


@guarded("kernel bandwidth")
def kernel_bandwidth() -> None:
    from layer_boundary.fusions import kernels

    rows, width = 16384, 4096
    value = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(value)
    weight = torch.ones(width, device="cuda", dtype=torch.bfloat16)
    copy_s = _timed(lambda: value.clone())
    copy_bw = 2 * value.numel() * 2 / copy_s  # read + write
    for name, fn, moved in (
            ("add_rms_norm", lambda: kernels.add_rms_norm(value, residual, weight, 1e-6),
             4 * value.numel() * 2),
            ("add_rms_norm_fp8", lambda: kernels.add_rms_norm_fp8(value, residual, weight,
                                                                  1e-6, 128),
             3 * value.numel() * 2 + value.numel()),
            ("silu_mul", lambda: kernels.silu_mul(value, residual), 3 * value.numel() * 2)):
        bw = moved / _timed(fn)
        least = 0.8 if name == "add_rms_norm_fp8" else 0.5  # issue 65: FP8 at 0.8 of copy
        row(f"bandwidth {name} bf16 {rows}x{width}", bw >= least * copy_bw,
            f"{bw / 1e9:.0f} GB/s against copy {copy_bw / 1e9:.0f} GB/s ({bw / copy_bw:.2f})")
    fp8_moved = 3 * value.numel() * 2 + value.numel()
    values = torch.empty_like(value, dtype=torch.float8_e4m3fn)
    scales = torch.empty((rows, width // 128), device="cuda")
    out = torch.empty_like(value)
    seen = []
    for warps in (4, 8, 16):  # what kernels._fp8_warps picks (8 at this width) against others
        seconds = _timed(lambda: kernels._add_rms_norm_fp8[(rows,)](
            value, residual, weight, values, scales, out, width, width // 128, width, width,
            1e-6, ZERO_CENTERED=False, BF16=True, GROUP=128, GROUPS=width // 128,
            num_warps=warps))
        seen.append(f"{warps} warps {fp8_moved / seconds / copy_bw:.2f}")
    note(f"add_rms_norm_fp8 of copy bandwidth by warps (picked: "
         f"{kernels._fp8_warps(width)})", ", ".join(seen))


def _stepped(path: Path, fused: bool, in_place: bool):
    """A tiny Qwen3 on CUDA (with the Triton provider where ``fused``) after a prefill of
    three requests, and its next decode step padded to 4 rows (the scratch slot the fifth):
    ``(model, step)``; ``in_place``: its cache decodes in place."""
    from layer_boundary.engine.runner import make_fusions
    from layer_boundary.models import load_model
    from layer_boundary.runtime import BoundaryRuntime, ForwardBatch, ForwardMode, ParallelDims
    from layer_boundary.runtime.parallel import build_parallel

    runtime = BoundaryRuntime(build_parallel(ParallelDims()), boundary_reduction="ar")
    model = load_model(str(path), runtime, device="cuda")
    if fused:
        model.install_fusion(make_fusions("triton"))
    cache = model.make_kv_cache(5, 32)
    cache.decode_in_place = in_place
    prompts = [[3, 1, 4], [1, 5], [9, 2, 6, 5]]
    model(ForwardBatch.build(ForwardMode.EXTEND, prompts, [0, 0, 0], kv_cache=cache,
                             device="cuda"))
    step = ForwardBatch.build(ForwardMode.DECODE, [[7], [8], [9]], [3, 2, 4],
                              kv_cache=cache, device="cuda").padded(4, scratch_slot=4)
    return model, step


@torch.no_grad()
def captured_decode(path: Path) -> None:
    """A padded decode step captured as a CUDA graph and replayed, against the eager step
    that gathers whole cache slots: holding the eager step or the step compiled by inductor,
    each plain and with the Triton provider decoding in place (``KVCache.decode_in_place``:
    where these pass, it may become CUDA's default)."""
    from layer_boundary.engine.compiled import compile_forward

    model, step = _stepped(path, False, False)
    eager = model(step)[:3].clone()
    for held in ("eager step", "inductor step"):
        for fused in (False, True):
            check = (f"captured decode ({held}{', triton + in place' if fused else ''}) vs "
                     "the eager step")

            @guarded(check)
            def one():
                model, step = _stepped(path, fused, fused)
                forward = (compile_forward(model, "inductor", padded=True)
                           if held == "inductor step" else model)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm up (and compile) outside the capture
                        forward(step)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = forward(step)
                graph.replay()
                torch.cuda.synchronize()
                diff = (captured[:3] - eager).abs().max().item()
                row(check, diff <= 1e-4, f"max |diff| {diff:.2e}")
            one()


@guarded("inductor writes the cache in place")
@torch.no_grad()
def inductor_writes_in_place(path: Path) -> None:
    """The inductor step with the Triton provider decoding in place: its generated code calls
    ``layer_boundary.store_kv`` once a layer on the cache itself (inductor reinplaced the
    functionalized write; a clone would copy the whole cache every step). On this CPU the same
    code calls it on its inputs with no clone or copy (Qwen3 tiny, 3 layers)."""
    from torch._inductor.utils import run_and_get_code

    from layer_boundary.engine.compiled import compile_forward

    model, step = _stepped(path, True, True)
    _, code = run_and_get_code(compile_forward(model, "inductor", padded=True), step)
    src = "\n".join(code)
    writes, layers = src.count("layer_boundary.store_kv.default("), len(model.model.layers)
    clones, copies = src.count("clone"), src.count(".copy_(")
    row("inductor writes the cache in place", writes == layers and clones == 0,
        f"store_kv {writes} calls for {layers} layers, {clones} clones, {copies} copies")


SECTIONS = ("parity", "cli", "kernels", "captured", "counts", "perf", "perf7b")
RESULTS: dict = {"rows": ROWS, "counts": [], "perf": []}


@guarded("kernels per decode layer")
def kernel_counts(work: Path) -> None:
    """benchmarks/kernel_count.py on CUDA: each row's kernels per decode layer."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from kernel_count import ROWS, per_layer

    for record in per_layer("cuda", ROWS, work / "counts"):
        RESULTS["counts"].append(record)
        print(f"  kernels per layer, {record['row']}: cuda {record.get('cuda')}, dispatcher "
              f"{record.get('dispatcher')}", flush=True)


def performance(work: Path, shape: str) -> None:
    """benchmarks/gpu_decode.py's rows of ``shape`` (a failed shape is a failed row)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_decode import table

    @guarded(f"performance table, {shape}")
    def one():
        RESULTS["perf"] += table(work / "perf", log=lambda line: print(line, flush=True),
                                 shapes=(shape,))
    one()


def print_tables() -> None:
    width = max([len(c) for c, _, _ in ROWS] + [5])
    print("\n| check | verdict | detail |\n| --- | --- | --- |")
    for check, verdict, detail in ROWS:
        print(f"| {check.ljust(width)} | {verdict} | {detail} |")
    if RESULTS["counts"]:
        print("\n| kernels per decode layer | CUDA kernels | dispatcher ops |\n| --- | --- | --- |")
        for r in RESULTS["counts"]:
            print(f"| {r['row']} | {r.get('cuda', '-')} | {r.get('dispatcher', '-')} |")
    if RESULTS["perf"]:
        print("\n| shape | workload | system | ms | HBM roofline ms | over the roofline | "
              "of transformers compiled |\n| --- | --- | --- | --- | --- | --- | --- |")
        for r in RESULTS["perf"]:
            where = f"| {r.get('shape', '-')} | {r['workload']} | {r['system']}"
            if "error" in r:
                print(f"{where} | failed: {r['error'][:80]} | | | |")
                continue
            roof = (f"{r['roofline_ms']:.3f} | {r['over_roofline']:.2f}"
                    if "roofline_ms" in r else "- | -")
            peer = f"{r['vs_peer']:.2f}" if "vs_peer" in r else "-"
            print(f"{where} | {r['ms']:.3f} | {roof} | {peer} |")


def _options(argv: list[str]) -> tuple[tuple[str, ...], Path | None]:
    only, out = SECTIONS, None
    if "--only" in argv:
        only = tuple(argv[argv.index("--only") + 1].split(","))
        unknown = set(only) - set(SECTIONS)
        if unknown:
            raise SystemExit(f"gpu_check: unknown sections {sorted(unknown)} (known: "
                             f"{', '.join(SECTIONS)})")
    if "--json" in argv:
        out = Path(argv[argv.index("--json") + 1])
    return only, out


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--interpreted":
        interpreted_outputs(Path(sys.argv[2]))
        return 0
    only, out = _options(sys.argv[1:])
    if not torch.cuda.is_available():
        print("gpu_check: needs a CUDA device, and none is visible (torch.cuda.is_available() "
              "is False); run it on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    print(f"gpu_check on {torch.cuda.get_device_name(0)} x {gpus}, torch {torch.__version__}",
          flush=True)
    RESULTS["device"] = f"{torch.cuda.get_device_name(0)} x {gpus}, torch {torch.__version__}"
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    paths = checkpoints(work)
    steps = {"parity": lambda: [world1_against_transformers(n, p) for n, p in paths.items()],
             "cli": lambda: cli_rows(paths, gpus),
             "kernels": lambda: (kernels_against_interpreter(work), kernel_bandwidth(),
                                 decode_in_place()),
             "captured": lambda: (captured_decode(paths["qwen3"]),
                                  inductor_writes_in_place(paths["qwen3"])),
             "counts": lambda: kernel_counts(work),
             "perf": lambda: performance(work, "qwen3-2048x16"),
             "perf7b": lambda: performance(work, "llama-7b")}
    for section in SECTIONS:
        if section in only:
            started = time.perf_counter()
            steps[section]()
            print(f"[{section}: {time.perf_counter() - started:.0f} s]", flush=True)
            if out is not None:
                out.write_text(json.dumps(RESULTS, indent=1, default=str))
    print_tables()
    return 0 if all(v != "FAIL" for _, v, _ in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
