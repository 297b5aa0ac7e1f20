"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): a nonlinear residual update and
the read that goes with it.

The residual is ``hc_mult`` streams per token, ``[T, N, D]``. A stage's read computes three
sets of coefficients from the streams (fp32): ``pre`` collapses the streams into the stage's
input (then the stage's own norm), ``post`` expands the stage's output back into N streams and
``comb``, projected towards a doubly-stochastic matrix by Sinkhorn-Knopp, mixes the streams
that carry over:

    x' = post (x) out + comb^T @ x           (in the model dtype, coefficients cast first)

``post`` and ``comb`` belong to the read of the stage whose output they expand, and are used
by that stage's update at the next boundary, possibly on other rows (a reduce-scatter, a DP
gather). So the read leaves them beside the streams, in the residual the stream holds:
``[T, N, D + 1 + N]`` = streams | post | comb's rows, and every row movement of the residual
carries them along. The update consumes them and leaves plain streams ``[T, N, D]``: what an
accessor or the final norm sees.

The update is not a plain add: it never moves before a sum (no add on one rank), never joins a
fused add+norm, and ``snapshot`` refuses it. The read has no ``kind``, so no fusion candidate
stands in for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.norm import unweighted_rms

NEEDS_COEFFICIENTS = ("the MHC update needs the post/comb coefficients its stage's read left "
                      "in the residual; the residual holds plain streams (was it written or "
                      "folded between the read and the update?)")


class HyperConnection(nn.Module):
    """One stage's mHC coefficients (transformers' ``DeepseekV4HyperConnection``)."""

    def __init__(self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float,
                 norm_eps: float) -> None:
        super().__init__()
        if hc_mult < 1 or sinkhorn_iters < 1:
            raise ValueError(f"hc_mult={hc_mult} and hc_sinkhorn_iters={sinkhorn_iters} must "
                             "be positive")
        n = hc_mult
        self.hidden_size, self.hc_mult, self.sinkhorn_iters = hidden_size, n, sinkhorn_iters
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        width = (2 + n) * n  # pre (N), post (N), comb (N x N)
        self.fn = nn.Parameter(torch.empty(width, n * hidden_size), requires_grad=False)
        self.base = nn.Parameter(torch.empty(width), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3), requires_grad=False)

    def coefficients(self, streams: torch.Tensor):
        """streams [T, N, D] -> pre [T, N], post [T, N], comb [T, N, N], all fp32."""
        n = self.hc_mult
        flat = unweighted_rms(streams.flatten(1).float(), self.norm_eps)  # [T, N * D]
        mixes = F.linear(flat, self.fn.float())  # [T, (2 + N) * N]
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n)  # [T, N, N]
        comb = torch.softmax(comb, dim=-1) + self.hc_eps
        # Sinkhorn-Knopp: columns once, then (rows, columns) for the remaining iterations
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return pre, post, comb


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_j pre_j x_j: [T, N, D] with fp32 pre [T, N] -> [T, D] in the streams' dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class HyperHead(nn.Module):
    """The stack's final collapse of the streams (transformers' ``DeepseekV4HyperHead``)."""

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_mult, self.hc_eps, self.norm_eps = hc_mult, hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size),
                                  requires_grad=False)
        self.hc_base = nn.Parameter(torch.empty(hc_mult), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.empty(1), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [T, N, D] -> [T, D]."""
        return collapse(streams, self._pre(streams))

    def _pre(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())  # [T, N]
        return torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps


class MhcFinalNorm(nn.Module):
    """The final norm of an mHC stack: the head's collapse, then the norm. ``norm()`` hands it
    the updated streams on the residual's rows (it has no fused add+norm form)."""

    def __init__(self, head: HyperHead, norm: nn.Module) -> None:
        super().__init__()
        self.head, self.norm = head, norm

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        return self.norm(self.head(streams))


class MhcUpdate:
    """``x' = post (x) out + comb^T @ x`` with the coefficients the stage's read left."""

    plain = False
    portable = True  # stateless: the coefficients travel in the residual it updates
    at_producer = False

    def apply(self, residual: torch.Tensor | None, contribution: torch.Tensor) -> torch.Tensor:
        hidden = contribution.shape[-1]
        if residual is None or residual.dim() != 3 or residual.shape[-1] == hidden:
            raise RuntimeError(NEEDS_COEFFICIENTS)
        streams = residual[..., :hidden]  # [T, N, D]
        post, comb = residual[..., hidden], residual[..., hidden + 1:]  # [T, N], [T, N, N]
        out = contribution.to(residual.dtype)
        return post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2),
                                                                      streams)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class MhcRead:
    """A stage's mHC read: coefficients from the streams, the collapsed input through the
    stage's norm; the residual it leaves carries ``post`` and ``comb`` for the update."""

    before_gather = False
    kind = None  # a custom read: no fused add+norm stands in for it

    def __init__(self, hc: HyperConnection) -> None:
        self.hc = hc

    def enter(self, hidden: torch.Tensor, norm):
        """The stack's input [T, D]: N copies of it are the first streams."""
        streams = hidden.unsqueeze(1).expand(-1, self.hc.hc_mult, -1).contiguous()
        return self.read(streams, norm)

    def read(self, residual: torch.Tensor, norm):
        streams = residual[..., :self.hc.hidden_size]  # written streams, or a read's residual
        pre, post, comb = self.hc.coefficients(streams)
        x = norm(collapse(streams, pre))
        dtype = streams.dtype
        held = torch.cat((streams, post.to(dtype).unsqueeze(-1), comb.to(dtype)), dim=-1)
        return x, held  # [T, D], [T, N, D + 1 + N]

    def visible(self, residual: torch.Tensor) -> torch.Tensor:
        """What captures see of the residual this read leaves: the streams [T, N, D]."""
        return residual[..., :self.hc.hidden_size]

    def update_and_read(self, update, residual, contribution, norm):
        # the update first, in full, then the read: the rounding order of two separate steps
        if residual is None:
            return self.enter(contribution, norm)
        return self.read(update.apply(residual, contribution), norm)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(hc_mult={self.hc.hc_mult})"


MHC_UPDATE = MhcUpdate()


def mhc_stage(hc: HyperConnection) -> dict:
    """Declaration keywords for a stage whose residual is mHC streams read through ``hc``:
    ``declare_attn(**mhc_stage(self.attn_hc))``."""
    return {"update": MHC_UPDATE, "read": MhcRead(hc)}
