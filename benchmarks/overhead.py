"""Boundary overhead on a Qwen3 decode step at world 1: `python benchmarks/overhead.py`.

The model must not pay for the boundary: the integrated decoder should cost within a few
percent of a hand-written forward doing the same tensor ops. Speed is shown here, never in
timed tests.
"""

import json
import sys

from layer_boundary.bench import overhead

if __name__ == "__main__":
    for hidden, layers in ((256, 8), (1024, 4)):
        print(json.dumps(overhead(hidden=hidden, layers=layers)), flush=True)
    sys.exit(0)
