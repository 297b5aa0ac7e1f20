"""The run-wide modes are one object (``runtime.modes.MODES``): each mode's own context sets
its field for a block and puts it back, and the names engines read (``BATCH_INVARIANT.on``,
``AGREEMENT.on``, ``HOOK.observer``) are views of the same fields."""

from __future__ import annotations

import pytest

from layer_boundary.runtime import MODES, RunModes
from layer_boundary.runtime.agreement import AGREEMENT, checking
from layer_boundary.runtime.invariant import BATCH_INVARIANT, batch_invariant
from layer_boundary.runtime.ledger import HOOK, observing
from layer_boundary.runtime.modes import scoped


def test_each_modes_context_sets_the_one_object_and_puts_it_back():
    before = (MODES.batch_invariant, MODES.check_agreement, MODES.observer)
    watcher = object()
    with batch_invariant(), checking(not before[1]), observing(watcher):
        assert (MODES.batch_invariant, MODES.check_agreement, MODES.observer) == (
            True, not before[1], watcher)
        assert BATCH_INVARIANT.on and AGREEMENT.on is MODES.check_agreement
        assert HOOK.observer is watcher
        with batch_invariant(False), observing(None):
            assert not BATCH_INVARIANT.on and HOOK.observer is None
        assert BATCH_INVARIANT.on and HOOK.observer is watcher
    assert (MODES.batch_invariant, MODES.check_agreement, MODES.observer) == before


def test_a_name_that_is_not_a_mode_is_refused_before_anything_changes():
    before = repr(MODES)
    with pytest.raises(TypeError, match=r"scoped\(\): batch_invariance is not a run-wide "
                                        r"mode \(known: batch_invariant, check_agreement, "
                                        r"observer\)"):
        with scoped(batch_invariant=True, batch_invariance=True):
            pass
    assert repr(MODES) == before and isinstance(MODES, RunModes)
