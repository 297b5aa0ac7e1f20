"""The run-wide modes, one object (``MODES``): what holds for every forward run inside a scope,
whoever runs it, and no forward's own state.

- ``batch_invariant``: a request's logits the same bits alone as in any batch
  (``invariant.batch_invariant()``, which also intercepts the ops);
- ``check_agreement``: before each collective the ranks of its group compare what they decided
  (``agreement.checking()``; on at import where ``LAYER_BOUNDARY_CHECK_AGREEMENT=1``);
- ``observer``: who watches each boundary, stage and collective (``ledger.observing()``;
  None: nobody, and a forward does no work for observation).

Each mode is set for a block by its own context (``scoped`` beneath them all) and read where it
matters; ``invariant.BATCH_INVARIANT.on``, ``agreement.AGREEMENT.on`` and
``ledger.HOOK.observer`` are views of the same fields. A combination the modes do not run is the
combination table's to refuse (``capabilities``), never a model's.
"""

from __future__ import annotations

import contextlib
import os

AGREEMENT_ENV = "LAYER_BOUNDARY_CHECK_AGREEMENT"


class RunModes:
    """The run-wide modes (the module docstring)."""

    __slots__ = ("batch_invariant", "check_agreement", "observer")

    def __init__(self) -> None:
        self.batch_invariant = False
        # made at import: a value other than 0 or 1 is the command line's to refuse
        # (``agreement.checking_agreement``), not an import error
        self.check_agreement = os.environ.get(AGREEMENT_ENV, "") == "1"
        self.observer = None

    def __repr__(self) -> str:
        return (f"RunModes(batch_invariant={self.batch_invariant}, "
                f"check_agreement={self.check_agreement}, observer={self.observer!r})")


MODES = RunModes()


@contextlib.contextmanager
def scoped(**modes):
    """The named modes set for the enclosed block (``scoped(batch_invariant=True)``), then as
    they were; a name that is not a mode is refused before anything changes."""
    unknown = sorted(set(modes) - set(RunModes.__slots__))
    if unknown:
        raise TypeError(f"scoped(): {', '.join(unknown)} is not a run-wide mode (known: "
                        f"{', '.join(RunModes.__slots__)})")
    previous = {name: getattr(MODES, name) for name in modes}
    for name, value in modes.items():
        setattr(MODES, name, value)
    try:
        yield MODES
    finally:
        for name, value in previous.items():
            setattr(MODES, name, value)
