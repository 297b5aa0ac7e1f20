"""What the package says about itself: its version (the same in the package, the command
line and the installed metadata), its license, its type marker, and the metadata a built
wheel carries."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import layer_boundary
from layer_boundary.engine.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_the_version_is_one_fact(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"layer-boundary {layer_boundary.__version__}"
    assert metadata.version("layer_boundary") == layer_boundary.__version__


def test_the_wheel_carries_its_license_readme_and_type_marker():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["readme"] == "README.md"
    assert project["project"]["license"] == "Apache-2.0"
    assert project["project"]["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text().splitlines()[0]
    assert (Path(layer_boundary.__file__).parent / "py.typed").is_file()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["layer_boundary"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "layer_boundary.__version__"}


def test_runtime_dependencies_are_ranges_and_extras_name_the_optional_ones():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] and not any("==" in d for d in project["dependencies"])
    extras = project["optional-dependencies"]
    assert extras["tokenizer"] == ["tokenizers"] and "peft" in extras["test"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU runs the checks")
def test_the_gpu_check_refuses_clearly_without_a_gpu():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == ("gpu_check: needs a CUDA device, and none is visible "
                                   "(torch.cuda.is_available() is False); run it on a machine "
                                   "with an NVIDIA GPU")
