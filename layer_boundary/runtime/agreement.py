"""One decision on every rank: a check mode that compares the ranks' per-forward decisions
before each collective and names the first difference, instead of a hang or a silent sum of
the wrong tensors.

Every per-forward choice the library makes (the row mode under ``auto``, each stage's path,
the padding, the two-batch split, each fusion candidate's accept or decline) must come from
inputs every rank of the group has: when ranks decide differently, their collectives stop
matching, and a collective run with mismatched partners hangs or sums what it should not
(flashinfer#3187, vLLM#43616). With the check on (``AGREEMENT.on``; ``run --check-agreement``,
and ``LAYER_BOUNDARY_CHECK_AGREEMENT=1``, which the tests set), a forward's inputs are noted as
its stack starts (its variant, every DP rank's token counts after padding, its two-batch split:
what the row mode and each stage's path follow from), then each fusion candidate's outcome; and
before each collective every rank of its group exchanges a fingerprint of what it noted since
the group last agreed, and of the collective it is about to run. Where they differ, the ranks
exchange their notes and every one raises ``DisagreementError`` naming the first decision that
differs, its site, and which ranks took which value. Off, a note is one attribute read.

A divergence that sends ranks to collectives over different groups is seen at neither (each
waits for its own group's peers): the collective timeout ends that job, as without the check.
The pipeline group's transfers are not checked: its ranks hold different layers, so their
notes differ by design. Nothing is checked while torch.compile traces or a CUDA graph captures (a
fingerprint exchange would become part of the graph).
"""

from __future__ import annotations

import contextlib
import os
import zlib

import torch
import torch.distributed as dist

from .modes import AGREEMENT_ENV, MODES, scoped

ENV = AGREEMENT_ENV
UNCHECKED = ("send", "recv")  # point to point: the two ends differ by design


def checking_agreement() -> bool:
    """``LAYER_BOUNDARY_CHECK_AGREEMENT``: 1 checks, 0 or unset does not; anything else is
    refused naming the variable (``maybe`` read as off would hide the check it asks for)."""
    value = os.environ.get(ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV}={value!r} must be 1 (check that ranks agree before each "
                         "collective) or 0")
    return value == "1"


class DisagreementError(RuntimeError):
    """Ranks of one group decided differently before a collective (the message names the
    first decision that differs, where it was made and each rank's value)."""


class Agreement:
    """The decisions this rank noted in its current forward, and where each group last agreed
    on them; ``on``: the run-wide mode (``modes.MODES.check_agreement``)."""

    __slots__ = ("notes", "agreed", "_window")

    def __init__(self) -> None:
        self.notes: list[tuple[str, str, str]] = []
        self.agreed: dict[str, int] = {}  # group key -> notes it has compared
        self._window: list = []  # what the last fingerprint covered

    @property
    def on(self) -> bool:
        return MODES.check_agreement

    def begin(self, site: str, decision: str, value) -> None:
        """A forward starts: notes kept from before are dropped (every rank starts its forward
        at the same point: a rank's leftover from an earlier one would differ for no
        reason), and this forward's first note is made."""
        self.notes, self.agreed = [], {}
        self.note(site, decision, value)

    def note(self, site: str, decision: str, value) -> None:
        """Record ``decision`` at ``site`` (a stage, "forward") taking ``value`` (nothing
        while torch.compile traces: a graph holds no check)."""
        if torch.compiler.is_compiling():
            return
        self.notes.append((site, decision, str(value)))

    def fingerprint(self, kind: str, group, numel: int, dtype):
        """Before a collective of ``kind`` over ``group``: this rank's fingerprint of the
        decisions it noted since the group last agreed and of the collective itself, [2]
        int64 on the group's wire device; None where nothing is checked. The caller gathers
        every rank's and hands them to ``compare``.

        Each group compares its own window of notes: the ranks of one group run the same
        collectives over it, while a smaller group inside it (one attention-DP rank's TP
        group, whose rows may all be empty) may run some the others skip."""
        if (kind in UNCHECKED or group.pg is None or group.name == "pp"
                or torch.compiler.is_compiling()
                or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())):
            return None
        # what every rank passes alike: an all-to-all's elements are this rank's sends
        self._window = [*self.notes[self.agreed.get(group.key, 0):],
                        (f"{kind} over {group.name}", "collective",
                         str(dtype) if kind == "all_to_all" else f"{numel} x {dtype}")]
        device = (torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl"
                  else torch.device("cpu"))
        return torch.tensor([zlib.crc32(repr(self._window).encode()), len(self._window)],
                            dtype=torch.int64, device=device)

    def compare(self, every: torch.Tensor, mine: torch.Tensor, group) -> None:
        """Every rank's fingerprint ([group size, 2], group rank order) against this one's:
        raises ``DisagreementError`` (after the ranks exchange their notes) on a difference."""
        if not bool((every == mine).all()):
            windows = [None] * group.size
            dist.all_gather_object(windows, self._window, group=group.pg)
            self.notes, self.agreed = [], {}
            raise DisagreementError(first_difference(windows, group.ranks))
        self.agreed[group.key] = len(self.notes)  # agreed: its next window starts here


def first_difference(notes: list[list], ranks) -> str:
    """The first decision that differs between the ranks' ``notes`` (in ``ranks`` order).

    A rank whose note there is a collective went on to it without that decision (a fusion
    candidate that runs a collective has accepted: it declines before starting one)."""
    for i in range(max(map(len, notes))):
        entries = [n[i] if i < len(n) else None for n in notes]
        if len(set(entries)) == 1:
            continue
        decisions = [e for e in entries if e is not None and e[1] != "collective"]
        where = decisions[0] if decisions else next(e for e in entries if e is not None)
        by_value: dict[str, list[int]] = {}
        for rank, entry in zip(ranks, entries):
            if entry is None:
                value = "nothing more (its notes end here)"
            elif entry[:2] == where[:2]:
                value = entry[2]
            elif entry[1] == "collective":
                value = f"went on to {entry[0]} ({entry[2]})"
            else:
                value = f"{entry[0]} {entry[1]}: {entry[2]}"
            by_value.setdefault(value, []).append(rank)
        who = "; ".join(f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {value}"
                        for value, r in by_value.items())
        return f"ranks decided differently before a collective: {where[0]} {where[1]}: {who}"
    return "ranks decided differently before a collective"  # pragma: no cover - digests differ


AGREEMENT = Agreement()


@contextlib.contextmanager
def checking(on: bool):
    """The agreement check on or off in the enclosed block (then as it was)."""
    with scoped(check_agreement=on):
        yield
