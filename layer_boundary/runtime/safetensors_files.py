"""A checkpoint folder's safetensors files and their headers, read without their tensors:
which files there are (an index's, or every ``*.safetensors``), each opened with
safetensors' own errors turned into a ``CheckpointError`` naming the file, and each tensor's
shape and dtype. The loader reads tensors through them; the command line's checks and an
adapter's base-model tensors read only the headers."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from .shards import CheckpointError


def safetensors_files(path) -> list[Path]:
    """The checkpoint's safetensors files (its index's, or every ``*.safetensors``), each
    checked to be a regular file (a symlink to one counts; a device, FIFO or folder does not)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (json.JSONDecodeError, AttributeError, UnicodeDecodeError, RecursionError):
            raise CheckpointError(f"{index} is not a JSON object") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index} field weight_map must map tensor names to file "
                                  "names")
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} holds no *.safetensors weights (pickle checkpoints are "
                              "not loaded)")
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{f} is listed in the index but missing" if index.is_file()
                                  else f"{f} is a broken symlink")
        if not f.is_file():
            raise CheckpointError(f"{f} is not a regular file (a folder, device or FIFO); "
                                  "safetensors weights must be files")
    return files


def open_file(f: Path):
    """``safe_open`` with safetensors' own errors (a truncated file, a lying or huge header)
    turned into a ``CheckpointError`` naming the file."""
    try:
        return safe_open(str(f), framework="pt")
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(f"{f} is not a readable safetensors file: {exc}") from None


def header_facts(path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, safetensors dtype such as "F32" or "F8_E4M3")} from the
    checkpoint's headers alone (no tensor data read)."""
    facts = {}
    for f in safetensors_files(path):
        with open_file(f) as handle:
            for name in handle.keys():
                try:
                    part = handle.get_slice(name)
                    facts[name] = (tuple(part.get_shape()), part.get_dtype())
                except Exception as exc:
                    raise CheckpointError(f"{f} is not a readable safetensors file: tensor "
                                          f"{name}: {exc}") from None
    return facts
