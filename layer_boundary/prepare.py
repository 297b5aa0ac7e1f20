"""Consumer input preparation: complete owed work, apply the update, read, move rows.

Order per call: finish what the producer owes onto the rows the residual update runs on,
bring the residual there, update and read, then move the read to the rows compute consumes.
"""

from __future__ import annotations

from .fusions import Arrival
from .layout import Rows, SumGroup
from .output import HandoffOutput, completion, describe_move, input_move
from .residual.add_norm import accumulate_dtype
from .residual.stream import IN_COMPUTE

_ATTN_PARTIAL = (SumGroup.ATTN_TP, Rows.LOCAL)


class EntryPath:
    """A consumer's prebuilt input path for one batch variant and row mode.

    ``arrivals`` maps every (owed sum group, rows) the declared producer can leave to the
    movement that brings it onto ``update_rows``; anything else arriving means the model
    declared a different neighbour than the one that ran.
    """

    __slots__ = ("stage", "mode", "read", "norm", "stack_entry", "update_rows", "compute_rows",
                 "arrivals", "producer_keys", "move_input", "sum_before_read", "_align_residual",
                 "attn_dp", "latent", "candidates")

    def __init__(self, stage: str, mode, read, norm, *, stack_entry: bool, update_rows: Rows,
                 compute_rows: Rows, arrivals: dict, producer_keys: tuple,
                 sum_before_read: bool, attn_dp: int = 1, latent=None,
                 candidates: tuple = ()) -> None:
        self.stage, self.mode, self.read, self.norm = stage, mode, read, norm
        self.stack_entry, self.update_rows, self.compute_rows = stack_entry, update_rows, compute_rows
        self.arrivals = arrivals
        self.producer_keys = producer_keys  # what the declared producer leaves, for plans
        self.attn_dp = attn_dp
        self.latent = latent  # attention's qkv latent projection, run before the row move
        self.candidates = candidates  # fusion-provider completions, tried in order
        self.move_input = input_move(update_rows, compute_rows)
        # attention DP with a plain update: add the residual on one attention-TP rank and let a
        # single TP all-reduce sum the partials and gather every DP rank's rows at once
        self.sum_before_read = sum_before_read
        self._align_residual = {rows: completion(None, rows, update_rows)
                                for rows in (Rows.LOCAL, Rows.SCATTERED)}

    def run(self, stream, hidden, batch_rows):
        stream.check(hidden)
        contribution = stream.contribution
        if contribution is None:
            if stream.residual is not None:
                residual = self._residual_on_update_rows(stream, batch_rows)
                compute_input, residual = self.read.read(residual, self.norm)
                compute_input = self._to_compute(batch_rows, compute_input, self.move_input)
                rows = self.update_rows
            elif self.stack_entry:
                # the embedding arrives on local rows; the residual starts there
                compute_input, residual = self.read.enter(hidden, self.norm)
                compute_input = self._to_compute(batch_rows, compute_input,
                                                 input_move(Rows.LOCAL, self.compute_rows))
                rows = Rows.LOCAL
            else:
                raise RuntimeError(f"stage {self.stage} has a previous producer but the stream "
                                   "holds no residual; pipeline receivers enter through from_pp()")
        else:
            value = contribution.value
            owed = contribution.owed
            key = (None if owed is None else owed.group, contribution.rows)
            fused = self._try_candidates(stream, contribution, batch_rows) if self.candidates else None
            if fused is not None:
                compute_input, residual = fused
                compute_input = self._to_compute(batch_rows, compute_input, self.move_input)
                rows = self.update_rows
            elif (self.sum_before_read and key == _ATTN_PARTIAL and contribution.update.plain
                    and stream.residual_rows is Rows.LOCAL and stream.residual is not None):
                compute_input, residual = self._sum_with_residual(stream, value, batch_rows)
                rows = Rows.LOCAL
            else:
                if isinstance(value, HandoffOutput):
                    value = value.complete()
                move = self.arrivals.get(key)
                if move is None:
                    raise RuntimeError(
                        f"stage {self.stage} cannot complete an output with "
                        f"{contribution.owed or 'nothing'} owed on {contribution.rows.value} rows; "
                        "its previous declaration does not match the producer that ran")
                value = move(batch_rows, value)
                residual = (self._residual_on_update_rows(stream, batch_rows)
                            if stream.residual is not None else None)
                compute_input, residual = self.read.update_and_read(
                    contribution.update, residual, value, self.norm)
                compute_input = self._to_compute(batch_rows, compute_input, self.move_input)
                rows = self.update_rows
        stream.write(residual, IN_COMPUTE, rows)
        return compute_input

    def _try_candidates(self, stream, contribution, batch_rows):
        arrival = Arrival(contribution.value, contribution.owed, contribution.rows,
                          contribution.update, stream.residual, stream.residual_rows, self.norm,
                          batch_rows)
        for candidate in self.candidates:
            out = candidate(arrival)
            if out is not None:
                return out
        return None

    def _to_compute(self, batch_rows, x, move):
        if self.latent is not None:
            x = self.latent(x)
        return move(batch_rows, x)

    def _residual_on_update_rows(self, stream, batch_rows):
        return self._align_residual[stream.residual_rows](batch_rows, stream.residual)

    def _sum_with_residual(self, stream, partial, batch_rows):
        residual = stream.residual
        if batch_rows.tp_rank == 0:  # a plain add may move before the sum, on one rank only
            acc = accumulate_dtype(residual.dtype)
            partial = (partial.to(acc) + residual.to(acc)).to(residual.dtype)
        else:
            partial = partial.to(residual.dtype)
        total = batch_rows.sum_local_partial_to_global(partial)
        compute_input, _ = self.read.read(total, self.norm)
        if self.latent is not None:
            compute_input = self.latent(compute_input)
        return compute_input, batch_rows.global_to_local(total).clone()

    def describe(self) -> str:
        """What this path does to the input its declared producer leaves."""
        dp = self.attn_dp
        if self.stack_entry:
            move = describe_move(input_move(Rows.LOCAL, self.compute_rows), self.mode, dp)
            return "enter: norm on local" + ("" if move == "-" else f" -> {move}")
        if self.sum_before_read and _ATTN_PARTIAL in self.producer_keys:
            return "add on attn_tp rank 0 -> all_reduce(tp) sum+gather -> norm on global"
        steps = [describe_move(self.arrivals[k], self.mode, dp) for k in self.producer_keys]
        head = " | ".join(s for s in steps if s != "-")
        move = describe_move(self.move_input, self.mode, dp)
        return ((f"{head} -> " if head else "") + f"add+norm on {self.update_rows.value}"
                + ("" if move == "-" else f" -> {move}"))


