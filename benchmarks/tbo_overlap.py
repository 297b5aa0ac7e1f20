"""Two-batch overlap on this machine: `python benchmarks/tbo_overlap.py`.

tp=4 dp=2 (EP 2) MoE prefill over gloo. Each forward is timed three ways (medians, rank 0):
the plain forward, the two-batch forward with every collective synchronous (its compute and
its communication serialized), and the two-batch forward with each microbatch's owed sums in
flight while the other microbatch computes. ``tbo_vs_plain`` is overlapped / plain (above 1:
TBO is slower than not using it, as on this machine); ``ratio`` is overlapped / synchronous
(below 1: communication hidden behind compute).
"""

import json
import sys

from layer_boundary.engine.bench import tbo_overlap

if __name__ == "__main__":
    for tokens in (128, 384):
        print(json.dumps(tbo_overlap(tokens=tokens)), flush=True)
    sys.exit(0)
