"""``--logits-out``: where the logits may be written, checked before the run, and the write.

The file is written beside its target and renamed over it, so a reader never sees half a
file; a rename replaces whatever the name pointed at, so the target must be a regular file or
absent. A device (``/dev/full``), FIFO, socket or folder is refused, never replaced; so is a
filesystem without room for the file, before the run rather than after it.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from .args import UsageError


def check_target(path: str, size: int) -> Path:
    """The resolved target of ``--logits-out path``, refused with a ``UsageError`` unless a
    ``size``-byte file can be written there.

    Args:
        path: the argument as given.
        size: the bytes the file will hold (about: the safetensors header is small).
    """
    target = Path(path).resolve()  # a symlink's target is what gets written
    if target.exists() and not target.is_file():
        kind = ("a folder" if target.is_dir() else
                "a device" if stat.S_ISCHR(target.stat().st_mode) or
                stat.S_ISBLK(target.stat().st_mode) else "not a regular file")
        raise UsageError(f"--logits-out {path}: {kind}; give a file path (it is written as a "
                         "new regular file)")
    parent = target.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UsageError(f"--logits-out {path}: cannot write a file in {parent}")
    try:
        st = os.statvfs(parent)
    except OSError:
        return target
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise UsageError(f"--logits-out {path}: the logits take {size:,} bytes and {parent}'s "
                         f"filesystem has {free:,} free")
    return target


def write(path: str, data: bytes) -> None:
    """``data`` into ``path`` through a file beside it, renamed over it; a ``UsageError``
    (nothing left behind) if the target stopped being a regular file or the write fails."""
    target = check_target(path, len(data))
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise UsageError(f"--logits-out {path}: could not write it: "
                         f"{exc.strerror or exc}") from None
