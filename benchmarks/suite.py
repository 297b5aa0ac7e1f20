"""Every benchmark, as ratios measured A/B in one run: `python benchmarks/suite.py [--quick]
[--json FILE]`.

- ``overhead``: a boundary-integrated Qwen3 decode step against a hand-written forward of the
  same modules (same tensor ops; at tp > 1 the same collectives a Megatron-style forward
  issues), paired and interleaved, eager at three sizes, compiled (inductor) at two, and at
  tp 2 and 4 under ``auto`` (its per-batch choice) and under ``rs``. ``ratio`` = boundary /
  hand-written, the median of ``runs`` paired measurements.
- ``load``: each rank's bytes read from the checkpoint against the bytes it keeps (tp 4),
  asked for by the library and, from outside, resident in the page cache after the load.
- ``path_bytes``: a forward's collective bytes under ``auto`` against the least of ar, rs and
  rsv for that forward (tp 4 dp 2: a skewed prefill, then a one-token decode).
- ``tbo``: two-batch overlap against the plain forward on the same ranks (tp 4 dp 2 MoE).
- ``peers``: the whole forward against transformers (world 1), transformers' TP and a DTensor
  plan (tp 2 at hidden 256, tp 4 at hidden 1024): prefill 4 x 64, decode of 1 and of 16
  requests (``peers.py``). ``ratio`` = library / peer, minima of interleaved runs.

One JSON object per line on stdout; ``--json FILE`` writes them all as one list (what
README's figures come from). ``--only overhead,load,path_bytes,tbo,peers`` picks benchmarks;
``--quick`` runs tiny sizes once (a check that it runs; its numbers mean nothing).
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _median_ratio(fn, runs: int, **kwargs) -> dict:
    results = [fn(**kwargs) for _ in range(runs)]
    ratios = [r["boundary_ms"] / r["hand_written_ms"] for r in results]
    best = min(results, key=lambda r: abs(r["boundary_ms"] / r["hand_written_ms"]
                                          - statistics.median(ratios)))
    return dict(best, ratio=statistics.median(ratios), ratios=ratios, runs=runs)


def overhead_rows(quick: bool):
    from layer_boundary.engine.bench import overhead, overhead_tp

    runs = 1 if quick else 5
    small = dict(hidden=64, layers=2, requests=1, prefix=4, repeats=1) if quick else None
    eager = [small] if quick else [dict(hidden=64, layers=8, requests=1, repeats=80),
                                   dict(hidden=256, layers=8, requests=16, repeats=30),
                                   dict(hidden=1024, layers=4, requests=16, repeats=20)]
    for size in eager:
        yield dict(bench="overhead", tp=1, **_median_ratio(overhead, runs, **size))
    if not quick:
        for size in (dict(hidden=64, layers=8, requests=1, repeats=80),
                     dict(hidden=256, layers=8, requests=16, repeats=30)):
            yield dict(bench="overhead", tp=1,
                       **_median_ratio(overhead, 3, compile="inductor", **size))
    for tp in ((2,) if quick else (2, 4)):
        for policy in ("rs+rsv", "rs"):
            size = (dict(hidden=64, layers=2, requests=2, prefix=4, repeats=1) if quick
                    else dict(hidden=256, layers=8, requests=16, repeats=20))
            row = _median_ratio(overhead_tp, runs, tp=tp, boundary_reduction=policy, **size)
            yield dict(bench="overhead", policy="auto" if policy == "rs+rsv" else policy, **row)


def load_row(quick: bool):
    import load_bytes

    with tempfile.TemporaryDirectory() as tmp:
        if quick:
            load_bytes.CONFIG.update(hidden_size=64, intermediate_size=128, vocab_size=128,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=4, head_dim=16)
        model_dir = str(load_bytes.checkpoint(Path(tmp) / "qwen3"))
        row = load_bytes.measure(model_dir, 4)
    return dict(bench="load", tp=4, checkpoint_mb=row["checkpoint_mb"],
                read_vs_kept=max(r / k for r, k in zip(row["read_mb"], row["kept_mb"])),
                read_vs_checkpoint=max(row["read_mb"]) / row["checkpoint_mb"],
                resident_vs_kept=row["resident_vs_kept"],
                whole_tensors_resident_vs_kept=row["whole_tensors_resident_vs_kept"])


SKEWED = (tuple(range(1, 30)), (5,), (7, 8), (9,))  # DP rank 0 holds most rows


def path_bytes_row(ranks=None):
    from layer_boundary.engine.bench import path_bytes
    from layer_boundary.models.tiny import write_tiny_qwen3

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_tiny_qwen3(Path(tmp) / "qwen3"))
        return dict(bench="path_bytes", **path_bytes(model_dir, SKEWED, ranks=ranks))


def tbo_rows(quick: bool):
    from layer_boundary.engine.bench import tbo_overlap

    for tokens in ((64,) if quick else (128, 384)):
        row = tbo_overlap(tokens=tokens, repeats=1 if quick else 10,
                          **(dict(hidden=64, layers=2) if quick else {}))
        yield dict(bench="tbo", **row)


def peers_rows(quick: bool):
    import peers

    sizes = [(64, 1), (64, 2)] if quick else [(256, 1), (256, 2), (1024, 1), (1024, 4)]
    for hidden, tp in sizes:
        yield from peers.peers(hidden, tp, repeats=1 if quick else peers.REPEATS)


BENCHES = {"overhead": lambda quick: overhead_rows(quick), "load": lambda quick: [load_row(quick)],
           "path_bytes": lambda quick: [path_bytes_row()], "tbo": lambda quick: tbo_rows(quick),
           "peers": lambda quick: peers_rows(quick)}


def parse(argv):
    parser = argparse.ArgumentParser(
        prog="benchmarks/suite.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(BENCHES),
                        help=f"benchmarks to run, comma-separated ({', '.join(BENCHES)})")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, once: a check that it runs (its numbers mean nothing)")
    parser.add_argument("--json", metavar="FILE", help="write every row as one JSON list")
    args = parser.parse_args(argv)
    unknown = [n for n in args.only.split(",") if n not in BENCHES]
    if unknown:
        parser.error(f"--only {args.only}: no benchmark named {', '.join(unknown)}")
    return args


def main(argv) -> list:
    args = parse(argv)
    rows = []
    for name in args.only.split(","):
        for row in BENCHES[name](args.quick):
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
