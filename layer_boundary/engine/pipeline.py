"""The generation loop's pipeline transport: what a stage receives before its forward, sends
after it, and the sampled tokens every stage gets from the last one (one batch in flight).

The model side (which layers a stage holds, the stack's pass over them, ``from_pp`` and
``to_pp``) stays with the models (``models/pipeline.py``); this is the driver's part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.collectives import (broadcast_from_last_stage, recv_from_prev_stage,
                                   send_to_next_stage)


@dataclass(frozen=True)
class PipelineLink:
    """One rank's links to its neighbouring pipeline stages.

    Args:
        group: the runtime's pipeline group (None: no pipeline parallelism).
        first, last: whether this rank's stage is the first / the last.
        device: the model's device, where what the previous stage sent is put (None: where
            the group's backend received it).
    """

    group: object = None
    first: bool = True
    last: bool = True
    device: object = None  # the model's device (what arrives is moved there)

    @classmethod
    def of(cls, model, group) -> PipelineLink:
        """The links of ``model``'s pipeline stage (a model without ``stage`` is whole)."""
        stage = getattr(model, "stage", None)
        if stage is None:
            return cls(group)
        return cls(group, stage.first, stage.last, getattr(model, "device", None))

    def receive(self):
        """What the previous stage sent for this forward (None on the first stage)."""
        return None if self.first else recv_from_prev_stage(self.group, site="pp_recv",
                                                            device=self.device)

    def send(self, out) -> None:
        """This stage's output tensors to the next stage."""
        send_to_next_stage(out, self.group, site="pp_send")

    def share_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The last stage's sampled tokens on every stage (``tokens`` elsewhere: a buffer of
        the same shape), so the next step's batch is the same on all."""
        if self.group is None:
            return tokens
        return broadcast_from_last_stage(tokens, self.group, site="pp_tokens")
