"""Producer-specific output handoffs."""

from __future__ import annotations

import torch


class HandoffOutput:
    """Producer-specific work (such as a deferred MoE finalize) left for the next input.

    ``complete()`` is the unfused completion path; a fusion provider may do better. Its
    result owes whatever sum the exit that published ``defer_moe_finalize`` recorded.
    """

    def complete(self) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError
