"""``scripts/transformers_coverage.py``: its table in docs/models.md lists every causal-LM type
of the installed transformers that carries a tp_plan, for that transformers version, with no
FAIL; and the script itself, run on a sample (a type that runs and one refused), gives a PASS
row within fp32 rounding and a refusal naming why."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "transformers_coverage.py"


def _load():
    import importlib.util

    spec = importlib.util.spec_from_file_location("transformers_coverage", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_is_the_installed_transformers():
    import transformers

    coverage = _load()
    text = (ROOT / "docs" / "models.md").read_text()
    table = text[text.index(coverage.BEGIN):text.index(coverage.END)]
    assert f"transformers {transformers.__version__}:" in table
    rows = dict(re.findall(r"^\| (\w+) \| ([^|]+?) \|", table, flags=re.M)[1:])
    assert sorted(rows) == coverage.causal_lm_types()
    assert "FAIL" not in rows.values()
    assert sum(v == "PASS" for v in rows.values()) >= 45


@pytest.mark.timeout(300)
def test_the_script_on_a_sample():
    out = subprocess.run([sys.executable, str(SCRIPT), "starcoder2", "phi"], cwd=ROOT,
                         capture_output=True, text=True, timeout=280)
    rows = {r["type"]: r for r in map(json.loads, (line for line in out.stdout.splitlines()
                                                   if line.startswith("{")))}
    assert out.returncode == 0, out.stderr[-2000:]
    assert rows["starcoder2"]["status"] == "PASS"
    assert rows["starcoder2"]["world1"] <= 1e-4 and rows["starcoder2"]["tp2"] <= 1e-4
    assert rows["phi"]["status"] == "refused"
    assert "not laid out as model.embed_tokens, model.layers, model.norm" in rows["phi"]["why"]
