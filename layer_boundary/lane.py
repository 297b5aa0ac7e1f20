"""A stage's lanes: for each (batch variant, row mode) path, what its plain calls read.

``prepare()``, ``exit()`` and ``finish()`` of an ordinary forward select a prebuilt path and
apply it. At decode sizes that selection is most of what a boundary costs, and much of it is
memory traffic: the path's entry, its arrivals, its norm and exit decisions sit in separate
objects that the rest of the forward has pushed out of cache by the next step. A lane holds
the few fields the plain calls read, flat in one object, built when the stage binds.
"""

from __future__ import annotations

from .runtime.context import NO_ADAPTERS


class Lane:
    """One stage's plain-call fields for one path.

    ``arrivals``: the arrival keys a plain add+norm input completes, each with its movement;
    ``update_rows``: where the residual must be for that add; ``moving_input``: the movement
    of the normalized input onto the compute rows, None where it moves nothing; ``plain``:
    the exit decisions whose ``finish()`` records a tensor as compute left it (none where the
    stage transforms its output first, or folds its update in at the producer);
    ``scoped``: the decision ``run()`` publishes in its own scope (the default where it is
    plain, with no choice to ask and no scattered rows; else None, and ``run()`` opens an
    exit), with ``scope``, what compute sees inside it; ``unscoped``: the same for
    ``finish()`` alone, on a PARTIAL attention.
    """

    __slots__ = ("stage", "path", "runtime", "arrivals", "update_rows", "norm", "moving_input",
                 "exit", "plain", "scoped", "scope", "unscoped", "update")

    def __init__(self, stage, path) -> None:
        """``stage``: the StageBoundary; ``path``: one of its plan's ``StagePath``s."""
        entry, exit_path = path.entry, path.exit
        self.stage, self.path, self.runtime = stage, path, stage.runtime
        self.update = stage._update
        self.arrivals, self.update_rows = entry.plain_arrivals, entry.update_rows
        self.norm = entry.norm
        self.moving_input = entry.input_move if entry.input_move.moves else None
        self.exit = exit_path
        self.plain = () if stage._transform is not None or exit_path.at_producer else tuple(
            decision for decision in exit_path.decisions if decision.leaves_as_is)
        default = exit_path.default
        self.scoped = default if (not exit_path.choices and default in self.plain
                                  and default.flags.sequence_parallel is None) else None
        # what compute sees inside that scope: its flags, no scattered rows, no adapters
        self.scope = None if self.scoped is None else (self.scoped.flags, None, NO_ADAPTERS)
        self.unscoped = self.scoped if stage._is_partial else None
