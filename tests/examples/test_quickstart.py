"""The README's library example is examples/quickstart.py, and run on its own it says that
two tensor-parallel ranks give one rank's numbers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "quickstart.py"


def test_the_readme_shows_the_example_as_it_is():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert blocks and blocks[0] == EXAMPLE.read_text()
    assert readme.index("```python") < readme.index("## Documentation")  # the front page


@pytest.mark.timeout(120)
def test_the_example_runs_and_matches_one_rank():
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                         check=True, timeout=100).stdout.strip()
    found = re.fullmatch(r"2 layers, 5 tokens: tp 2 matches 1 rank to (\S+) "
                         r"\(both ranks equal: True\)", out)
    assert found, out
    assert float(found.group(1)) <= 1e-5
