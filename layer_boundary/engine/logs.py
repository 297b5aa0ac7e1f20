"""The command's output: only rank 0 prints, through the ``layer_boundary`` logger."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("layer_boundary")


def setup_logging(rank: int) -> None:
    """Rank 0 logs bare lines to stdout; every other rank logs nothing."""
    logging.raiseExceptions = False  # a closed pipe (e.g. `| head`) is not an error to report
    log.handlers.clear()
    log.propagate = False
    if rank == 0:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    else:
        log.addHandler(logging.NullHandler())
        log.setLevel(logging.CRITICAL + 1)
