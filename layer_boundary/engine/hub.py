"""Where the command line's checkpoints come from: a folder, or a Hugging Face repo id resolved
through the hub's cache (or a download), and a checkpoint's tokenizer."""

from __future__ import annotations

from .args import UsageError


# what a checkpoint needs of a hub repository (weights, config, tokenizer)
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*"]


def model_folder(name: str | None, what: str = "--model") -> str | None:
    """The checkpoint folder ``name`` means: a folder as it is, else a Hugging Face repo id
    (``org/name``) resolved through ``huggingface_hub``: the local cache first (``HF_HOME``,
    ``HF_HUB_CACHE``), then a download of its config, weights and tokenizer unless
    ``HF_HUB_OFFLINE`` is set. Anything else is a one-line error naming ``what`` (the flag;
    one ending in "=", such as ``--lora a=``, is joined to ``name`` without a space)."""
    import os
    import re

    if name is None or os.path.isdir(name):
        return name
    label = f"{what}{name}" if what.endswith("=") else f"{what} {name}"
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", name) or ".." in name:
        return name  # not a repo id: the checkpoint reader names the missing folder
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise UsageError(f"{label}: no such folder, and a repo id needs huggingface_hub "
                         "(pip install huggingface_hub)") from None
    cache = os.environ.get("HF_HUB_CACHE")  # read now: the hub library reads it at import
    try:
        return snapshot_download(name, local_files_only=True, allow_patterns=HUB_FILES,
                                 cache_dir=cache)
    except LocalEntryNotFoundError:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise UsageError(f"{label}: no such folder, and the repo id is not in the Hugging "
                         "Face cache (HF_HUB_OFFLINE is set, so nothing is downloaded)")
    try:
        return snapshot_download(name, allow_patterns=HUB_FILES, cache_dir=cache)
    except (HfHubHTTPError, OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"{label}: no such folder, not in the Hugging Face cache, and "
                         f"not downloaded: {reason}") from None


def tokenizer(model_dir):
    """The checkpoint's ``tokenizer.json`` (what ``--prompt`` encodes with and the report
    decodes with), or the one-line error naming what is missing."""
    from pathlib import Path

    tok_file = Path(model_dir) / "tokenizer.json"
    if not tok_file.is_file():
        raise UsageError(f"--prompt needs {tok_file}; pass --prompt-ids instead")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError("--prompt needs the 'tokenizers' package (pip install "
                         "'layer_boundary[tokenizer]'); or pass --prompt-ids") from None
    return Tokenizer.from_file(str(tok_file))
