"""examples/torchrun_two_nodes.sh with both "machines" on this host (LOCAL=1): two torchrun
nodes of 2 processes, --pp 2 --tp 2; rank 0 reports parity with world 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from layer_boundary.runtime.launch import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "torchrun_two_nodes.sh"


@pytest.mark.timeout(300)
def test_the_two_node_example_passes_on_one_host():
    env = dict(os.environ, LOCAL="1", MASTER_PORT=str(free_port()),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(["bash", str(SCRIPT), "--json", "--max-new-tokens", "2"], env=env,
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert (report["pp"], report["tp"]) == (2, 2)
    assert report["parity"]["tokens_match"] and report["parity"]["max_abs_diff"] <= 1e-5
