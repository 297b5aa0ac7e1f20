"""What a provider that declares one candidate per movement-table row must be offered: on
every path a stage built (each batch variant and row mode), each arrival after the stack's
entry gets exactly one candidate, and that candidate declares the arrival's own owed sum,
its source rows, the path's update rows and its row mode. Stated here from the arrival's
movement, not from the library's ``FusedInput.applies``, which chose the offer."""

from __future__ import annotations


def offers_not_as_declared(stages) -> list:
    """(stage, variant, mode, arrival key, what was offered) for every arrival offered
    anything but its one declared candidate; [] where every path is as declared."""
    wrong = []
    for stage in stages:
        for (variant, mode), path in stage.plan.paths.items():
            entry = path.entry
            if entry.stack_entry:  # no producer: nothing to add the input to
                continue
            for key, arrival in entry.arrivals.items():
                move = arrival.complete
                declared = [c for c in arrival.candidates
                            if c.completes == frozenset({move.owed}) and c.source == move.src
                            and c.target == entry.update_rows and c.collective is mode]
                if len(arrival.candidates) != 1 or len(declared) != 1:
                    wrong.append((stage.name, variant.value, mode.value, key,
                                  [(sorted(map(str, c.completes)), c.source, c.target,
                                    c.collective) for c in arrival.candidates]))
    return wrong
