"""Consumer input preparation: complete owed work, apply the update, read, move rows.

Order per call: finish what the producer owes onto the rows the residual update runs on,
bring the residual there, update and read, then move the read to the rows compute consumes.
Every movement was resolved from the table (ops.TRANSITIONS) at construction, and so was how
each kind of output that can arrive is taken (its ``ArrivalPath``); a call only dispatches on
what actually arrived. ``EntryPath.enter`` is the only implementation of entering a stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .fusions import Arrival
from .layout import Layout
from .ops import Movement
from .primitives import SLICE_DP
from .residual import ReadKind, in_forward, is_plain, read_kind
from .residual.add_norm import PLAIN_ADD, Fp32Norm, accumulate_dtype
from .residual.stream import ArrivalKey, Turn
from .runtime.agreement import AGREEMENT
from .runtime.quant import QuantizedInput

PREPARED = Turn.PREPARED  # what an entered stream's handle is (a module constant: no lookup)

MISDECLARED_UPDATE = ("stage {stage}: its producer's output arrives with a residual update that "
                      "is not a plain add, but its previous declaration names a plain one (its "
                      "path may add the residual before the sum); declare previous with the "
                      "producer's own update and output_transform")
NO_RESIDUAL = ("stage {stage} has a previous producer but the stream holds no residual; "
               "pipeline receivers enter through from_pp()")


class ArrivalPath:
    """How one kind of pending output (owed sum, rows, handoff) reaches this input, bound at
    construction: the movement completing it onto the update rows, the fusion candidates
    that apply to it (in order), and, under attention DP with a plain update and the add+norm
    read, the all-reduce that sums it with the residual added on one rank first."""

    __slots__ = ("chooses", "moves", "complete", "key", "candidates", "sum_before_read")

    def __init__(self, key: ArrivalKey, complete: Movement, candidates: tuple = (),
                 sum_before_read: Movement | None = None) -> None:
        self.key = key
        self.complete = complete  # the owed sum (or nothing) onto the update rows
        self.candidates = candidates  # fusion candidates that apply here, in order
        # attention DP with a plain update and read: add the residual on one attention-TP
        # rank and let a single TP all-reduce sum the partials and gather every DP rank's rows
        self.sum_before_read = sum_before_read
        # something may stand in for the completion (a candidate, the add before the sum)
        self.chooses = bool(candidates) or sum_before_read is not None
        self.moves = complete.moves  # the completion runs a movement


@dataclass(eq=False, slots=True, kw_only=True)
class EntryPath:
    """A consumer's prebuilt input path for one batch variant and row mode. (The fields a
    plain entry reads come first: a stage's turn touches few cache lines of it.)"""

    arrivals: dict  # ArrivalKey -> ArrivalPath
    # the declared producer's update is a plain add: arrival paths were bound on that (an
    # add before the sum), so an output arriving with any other update is refused
    assumes_plain: bool = False
    update_rows: Layout  # where the update and read run (the residual's layout)
    read: object  # the stage's StageRead
    norm: object
    # the read's input reaches compute as the read returns it (no latent, no movement)
    direct: bool = field(init=False, repr=False)
    input_move: Movement  # update rows -> compute rows
    stage: str
    mode: object  # RowMode
    # an attention's qkv_latent_func: run before the input's gather in an input-scattered
    # batch (only the latent moves), on the gathered compute rows otherwise
    latent: object
    stack_entry: bool  # no producer: the stack's input enters here
    local: Layout  # this DP rank's rows
    compute_rows: Layout  # where compute consumes its input
    producer_keys: tuple  # what the declared producer leaves, for plans
    align: dict  # residual layout key -> movement onto the update rows
    enter_residual: Movement  # the stack's input (local rows) onto the update rows
    enter_input: Movement  # local rows -> compute rows
    local_to_update: Movement  # a model-side tensor onto the update rows
    capture_move: Movement  # update rows -> local rows (for captures)
    residual_src: Layout  # where the producer leaves the residual
    # the producer's statically declared exit (a PARTIAL sum), which a pipeline receiver
    # rebuilds from its own declaration; None where the producer decides per batch
    declared: object = None
    latent_first: bool = False  # an input-scattered batch: the latent runs before the move
    # a parallel block's FFN: the producer's output is set aside (it joins this stage's sum
    # at its finish) and the residual it was to update is read as it is
    beside: bool = False
    # ... and its compute rows are the attention's (no attention DP or CP): where the
    # attention read through the very same norm and read, its compute input is this one
    beside_shares_input: bool = False

    def __post_init__(self) -> None:
        self.direct = self.latent is None and not self.input_move.moves

    def arrival(self, c) -> ArrivalPath:
        """The bound path for contribution ``c`` as it actually arrived: its owed sum and
        rows, and an update the path may treat as it does (checked before anything runs)."""
        if c.rows is None:  # left before any boundary placed the rows: on local rows
            c.place(self.local)
        path = self.arrivals.get(c.key)
        if path is None:
            raise RuntimeError(
                f"stage {self.stage} cannot complete an output with "
                f"{'a sum over ' + c.owed.value if c.owed else 'nothing'} owed on "
                f"{c.rows} rows; its previous declaration does not match the producer "
                "that ran")
        if self.assumes_plain and c.update is not PLAIN_ADD and not is_plain(c.update):
            raise RuntimeError(MISDECLARED_UPDATE.format(stage=self.stage))
        return path

    def enter(self, stream, hidden, facts, forward, *, extra=None, fused: bool = True):
        """This stage's compute input; the stream holds the updated residual afterwards and
        the turn is the stage's (``Turn.PREPARED``).

        Args:
            stream: the forward's residual stream, its handle checked by the caller.
            hidden: what the model passed (the stack's input at stack entry).
            facts: the forward's row facts.
            forward: the forward batch, handed to an update that reads it (``reads_batch``).
            extra: a tensor on local rows added to the residual with the update (plain
                updates only, checked by the caller).
            fused: a fusion candidate or the add-before-sum all-reduce may stand in for
                the completion (False where a capture needs the completed output).
        """
        c = stream.contribution
        if c is None:
            return self._enter_written(stream, hidden, facts, extra)
        if self.beside:
            return self._enter_beside(stream, hidden, facts, extra)
        path = self.arrivals.get(c.key)
        if path is None or (self.assumes_plain and c.update is not PLAIN_ADD):
            path = self.arrival(c)  # places it, or names what does not match
        update = c.update if c.update is PLAIN_ADD else in_forward(c.update, forward)
        if path.chooses and fused and extra is None:
            chosen = self._chosen(path, stream, c, update, facts)
            if chosen is not None:
                x, residual = chosen
                stream.write(residual, PREPARED, self.update_rows)
                return x
        value = c.value.complete() if c.handoff else c.value
        if path.moves:
            value = path.complete.move(facts, value)
        residual = stream.residual
        if residual is not None and stream.residual_rows is not self.update_rows:
            residual = self.residual(stream, facts)
        if extra is not None:
            acc = accumulate_dtype(value.dtype)
            value = value.to(acc) + self.local_to_update.move(facts, extra).to(acc)
        x, residual = self.read.update_and_read(update, residual, value, self.norm)
        stream.write(residual, PREPARED, self.update_rows)
        return x if self.direct else self._to_compute(facts, x, self.input_move)

    def _enter_beside(self, stream, hidden, facts, extra):
        """A parallel block's FFN: the attention's output set aside, the residual it read
        read again through this stage's norm, or (Cohere's one norm, on the attention's
        rows) the attention's own compute input taken as it is: no second norm, no second
        gather."""
        attn, x = stream.stage, stream.prepared_input
        stream.set_aside()
        if (self.beside_shares_input and extra is None and x is not None and attn is not None
                and _unwrapped(attn.norm) is _unwrapped(self.norm)
                and attn.declaration.residual.read is self.read
                and attn.qkv_latent_func is None and stream.residual_rows is self.update_rows):
            stream.write(stream.residual, PREPARED, self.update_rows)
            return x
        return self._enter_written(stream, hidden, facts, extra)

    def _enter_written(self, stream, hidden, facts, extra):
        """``enter`` where nothing is pending: a written residual, or the stack's input."""
        if stream.residual is not None:
            residual = self.residual(stream, facts)
            if extra is not None:
                residual = PLAIN_ADD.apply(residual, self.local_to_update.move(facts, extra))
            x, residual = self.read.read(residual, self.norm)
            x = self._to_compute(facts, x, self.input_move)
        elif self.stack_entry:
            # the embedding arrives on local rows: the residual starts there
            if extra is not None:
                hidden = PLAIN_ADD.apply(hidden, extra)
            x, residual = self.read.enter(hidden, self.norm)
            if self.enter_residual.moves:
                residual = self.enter_residual.move(facts, residual)
            x = self._to_compute(facts, x, self.enter_input)
        else:
            raise RuntimeError(NO_RESIDUAL.format(stage=self.stage))
        stream.write(residual, PREPARED, self.update_rows)
        return x

    def _chosen(self, path: ArrivalPath, stream, c, update, facts):
        """What stands in for the completion: the first fusion candidate that accepts the
        arrival (``update``: the contribution's, in its forward), or the add before the sum;
        None where nothing does."""
        if path.candidates:
            arrival = Arrival(c.value, c.owed, c.rows, update, stream.residual,
                              stream.residual_rows, self.norm, facts)
            for i, candidate in enumerate(path.candidates):
                out = candidate.run(arrival)
                if AGREEMENT.on:
                    AGREEMENT.note(self.stage, f"fusion candidate {i}",
                                   "applied" if out else getattr(out, "reason", "declined"))
                if out:  # None, or a ``Declined``: the next candidate, then the built-in path
                    x, residual = out
                    return self._to_compute(facts, x, self.input_move), residual
        if path.sum_before_read is not None and stream.residual is not None:
            return self._sum_before_read(path.sum_before_read, stream, c.value, facts)
        return None

    def residual(self, stream, facts):
        """The stream's residual on the update rows."""
        src = stream.residual_rows
        if src is self.update_rows:  # already there (the common case: skip the lookup)
            return stream.residual
        movement = self.align.get(self.local.key if src is None else src.key)
        if movement is None:
            raise RuntimeError(f"stage {self.stage} finds the residual on {src} rows, which "
                               f"it cannot bring to its update rows ({self.update_rows})")
        return movement.move(facts, stream.residual) if movement.moves else stream.residual

    def _to_compute(self, facts, x, move: Movement):
        if self.latent is None:
            return _moved(move, facts, x) if move.moves else x
        if self.latent_first:
            return _moved(move, facts, self.latent(x))
        return self.latent(_moved(move, facts, x))

    def _sum_before_read(self, movement: Movement, stream, partial, facts):
        residual = self.residual(stream, facts)
        dtype, acc = residual.dtype, accumulate_dtype(residual.dtype)
        if facts.tp_rank != 0:
            partial = partial.to(dtype)
        elif movement.src == self.local:  # a plain add may move before the sum, on one rank
            partial = (partial.to(acc) + residual.to(acc)).to(dtype)
        else:  # a global partial: the residual joins this DP rank's segment of it
            start, end = facts.offset, facts.offset + facts.local
            mine = (partial[start:end].to(acc) + residual.to(acc)).to(dtype)
            partial = partial.to(dtype).slice_scatter(mine, 0, start, end)
        total = movement.move(facts, partial)
        x, _ = self.read.read(total, self.norm)
        if self.latent is not None:
            x = self.latent(x)
        return x, SLICE_DP.move(facts, total).clone()

    # -- plans

    def describe(self) -> str:
        """What this path does to each input its declared producer can leave."""
        kind = read_kind(self.read)
        norm = getattr(self.norm, "norm", self.norm)  # through Fp32Norm's adapter
        normless = norm is None or isinstance(norm, torch.nn.Identity)
        # a producer's update other than the plain add (a post norm) runs by itself, then
        # the norm reads what it left
        add = "add" if self.assumes_plain else "update"
        what = "update+read" if kind is not ReadKind.ADD_NORM else (
            add if normless else f"{add}+norm")
        read = f"{what} on {self.update_rows}"
        if self.beside:
            read = "norm" if kind is ReadKind.ADD_NORM and not normless else "read"
            shared = (" (the attention's input itself where it reads through the same norm)"
                      if self.beside_shares_input else "")
            return (f"the attention's partial set aside; {read} of the same residual on "
                    f"{self.update_rows}{self._compute_steps(self.input_move)}{shared}")
        if self.stack_entry:
            text = f"enter: norm on {self.local}"
            text += self._compute_steps(self.enter_input)
            if self.enter_residual.moves:
                text += f"; residual {self.enter_residual.name}"
            return text
        steps = []
        for key in self.producer_keys:
            path = self.arrivals[key]
            if path.sum_before_read is not None:
                steps.append(f"add on attn_tp rank 0 -> {path.sum_before_read.name} -> norm on "
                             f"{path.sum_before_read.dst}")
                continue
            fused = " [fusable]" if path.candidates else ""
            head = f"{path.complete.name} -> " if path.complete.moves else ""
            steps.append(f"{head}{read}{self._compute_steps(self.input_move)}{fused}")
        return " | ".join(dict.fromkeys(steps)) or read

    def _compute_steps(self, move: Movement) -> str:
        """The steps from the read's rows to compute's (where the latent runs decides the
        gathered width)."""
        steps = [move.name] if move.moves else []
        if self.latent is not None:
            steps.insert(0 if self.latent_first else len(steps), "qkv_latent_func")
        return "".join(f" -> {step}" for step in steps)

    def expected(self, key, facts, width: int, input_width: int | None = None) -> list:
        """The collectives this path runs for an arrival ``key`` (None: a written stream whose
        residual is on the update rows; "enter": stack entry), as [(kind, group, numel)]."""
        input_width = width if input_width is None else input_width
        if key == "enter":
            return (self.enter_residual.expected(facts, width)
                    + self.enter_input.expected(facts, input_width))
        out = []
        if key is not None and not self.beside:  # beside: the arrival is set aside
            path = self.arrivals[key]
            if path.sum_before_read is not None:
                return path.sum_before_read.expected(facts, width)
            out += path.complete.expected(facts, width)
        return out + self.input_move.expected(facts, input_width)


def _unwrapped(norm):
    """The model's norm behind a boundary's ``Fp32Norm`` adapter."""
    return norm.norm if isinstance(norm, Fp32Norm) else norm


def _moved(move: Movement, facts, x):
    """``x`` on ``move``'s target rows; a quantized input moves its values (as bytes) and its
    scales alike."""
    if not move.moves:
        return x
    if isinstance(x, QuantizedInput):
        return x.map_rows(lambda t: move.move(facts, t))
    return move.move(facts, x)
