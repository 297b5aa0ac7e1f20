"""Boundary overhead on a Qwen3 decode step at world 1: `python benchmarks/overhead.py`.

The model must not pay for the boundary: the integrated decoder should cost within a few
percent of a hand-written forward doing the same tensor ops. Speed is shown here, never in
timed tests. Rows: eager at two compute-dominated sizes; eager at an overhead-dominated size
(hidden 64, one request), where the boundary's Python is what is measured, with its cost per
stage in microseconds; the same size and one larger with both forwards compiled (inductor,
fullgraph), where the boundary's Python is gone.
"""

import json
import sys

from layer_boundary.engine.bench import overhead

if __name__ == "__main__":
    compiled = "--eager-only" not in sys.argv
    for hidden, layers, requests, backend in (
            (256, 8, 16, None), (1024, 4, 16, None), (64, 8, 1, None),
            *(((64, 8, 1, "inductor"), (256, 8, 16, "inductor")) if compiled else ())):
        print(json.dumps(overhead(hidden=hidden, layers=layers, requests=requests,
                                  repeats=50 if requests == 1 else 30, compile=backend)),
              flush=True)
    sys.exit(0)
