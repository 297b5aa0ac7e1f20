"""The command's output: only rank 0 prints, through the ``layer_boundary`` logger.

What a command reports (the run's tokens, verdict, paths and collectives; the plan; the
bench's timing) goes through ``layer_boundary.report``, which always prints on rank 0; what
it says while it works (the processes it starts, a slow combination) goes through the
package logger at the level ``--log-level`` sets (``set_level``)."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("layer_boundary")
REPORT = "layer_boundary.report"  # the logger of a command's report
LEVELS = ("debug", "info", "warning", "error")
_level = logging.INFO  # what --log-level asked (rank 0's package logger)


def set_level(name: str) -> None:
    """The level of what the command says while it works (one of ``LEVELS``)."""
    global _level
    _level = getattr(logging, name.upper())


def setup_logging(rank: int, json_output: bool = False) -> None:
    """Rank 0 logs bare lines to stdout; every other rank logs nothing. With ``json_output``
    (``--json``) stdout holds the report's one JSON object alone: what the command says while
    it works, its warnings included, goes to stderr."""
    logging.raiseExceptions = False  # a closed pipe (e.g. `| head`) is not an error to report
    log.handlers.clear()
    log.propagate = False
    report = logging.getLogger(REPORT)
    if rank == 0:
        out = logging.StreamHandler(sys.stdout)
        out.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(out)
        if json_output:
            out.addFilter(_is_report)
            err = logging.StreamHandler(sys.stderr)
            err.setFormatter(logging.Formatter("%(message)s"))
            err.addFilter(lambda record: not _is_report(record))
            log.addHandler(err)
        log.setLevel(_level)
        report.setLevel(logging.INFO)  # the report prints whatever the level
    else:
        log.addHandler(logging.NullHandler())
        log.setLevel(logging.CRITICAL + 1)
        report.setLevel(logging.CRITICAL + 1)


def _is_report(record: logging.LogRecord) -> bool:
    return record.name == REPORT
