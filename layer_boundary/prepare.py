"""Consumer input preparation: complete owed work, apply the update, read, move rows."""

from __future__ import annotations

from .output import CompletionStep, HandoffOutput
from .residual.stream import IN_COMPUTE


class EntryPath:
    """A consumer's prebuilt input path for one batch variant.

    ``completions`` maps every ``Owed`` the declared producer may leave to the step that
    finishes it on this consumer's rows; anything else arriving means the model declared a
    different neighbour than the one that ran.
    """

    __slots__ = ("stage", "read", "norm", "stack_entry", "completions")

    def __init__(self, stage: str, read, norm, stack_entry: bool,
                 completions: dict) -> None:
        self.stage, self.read, self.norm = stage, read, norm
        self.stack_entry, self.completions = stack_entry, completions

    def run(self, stream, hidden):
        stream.check(hidden)
        contribution = stream.contribution
        if contribution is None:
            if stream.residual is not None:
                compute_input, residual = self.read.read(stream.residual, self.norm)
            elif self.stack_entry:
                compute_input, residual = self.read.enter(hidden, self.norm)
            else:
                raise RuntimeError(f"stage {self.stage} has a previous producer but the stream "
                                   "holds no residual; pipeline receivers enter through from_pp()")
        else:
            value = contribution.value
            if isinstance(value, HandoffOutput):
                value = value.complete()
            if contribution.owed is not None:
                step: CompletionStep | None = self.completions.get(contribution.owed)
                if step is None:
                    raise RuntimeError(
                        f"stage {self.stage} cannot complete the {contribution.owed} its input "
                        "carries; its previous declaration does not match the producer that ran")
                value = step.run(value)
            compute_input, residual = self.read.update_and_read(
                contribution.update, stream.residual, value, self.norm)
        stream.write(residual, IN_COMPUTE)
        return compute_input

    def describe(self) -> str:
        steps = [repr(s) for s in self.completions.values()]
        head = "enter" if self.stack_entry else "read"
        return "+".join(steps + [f"{head}:{type(self.read).__name__}"])
