"""A job stopped by a signal: SIGTERM raised as ``Stopped``, which the command reports by name
with the exit status 128 + the signal's number, as Ctrl-C's KeyboardInterrupt is.

It imports no torch: the command installs it before it imports anything slow (torch's import
takes a second or more, and a signal then was a KeyboardInterrupt traceback or a death by
SIGTERM with nothing said, ``--json``'s object included)."""

from __future__ import annotations

import contextlib
import signal
import threading


class Stopped(SystemExit):
    """The job was stopped by a signal (SIGTERM): its exit status is 128 + the signal's
    number, and the CLI names the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signal = signal.Signals(signum).name


@contextlib.contextmanager
def stop_on_sigterm():
    """SIGTERM ends the job like Ctrl-C (the spawner stops every rank on its way out), as a
    ``Stopped`` the CLI reports by name."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
