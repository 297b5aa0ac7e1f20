"""Inkling's feed-forward layers (``models/inkling.py`` builds them): the gated SiLU MLP
times its learned scale, and the MoE as transformers' ``InklingMoE`` computes it.

* Router (``gate``): one fp32 linear over the routed then the shared experts; the top-k routed
  experts by sigmoid score plus ``e_score_correction_bias``; weights: the sigmoids of the
  chosen routed experts and of every shared expert, normalized together (a softmax of their
  log-sigmoids), times ``route_scale * global_scale``.
* Routed experts: ``FusedMoE`` (``moe_ep x moe_tp``), loaded from the fused per-layer tensors
  ``experts.gate_up_proj`` [E, 2 * inter, hidden] (gate rows, then up rows) and
  ``experts.down_proj`` [E, hidden, inter].
* Shared experts: ``shared_experts.{gate,up,down}_proj`` [S, inter, hidden] / [S, hidden,
  inter], each expert's activation scaled by its router weight, their sum in fp32; their
  intermediate dim over TP, a partial that joins the routed experts' one sum (whole on every
  rank beside dispatched experts, whose rows no other rank holds).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.args import BoundaryRuntime
from ..runtime.linear import expect_shape
from ..runtime.shards import take
from .layers import GatedMLP
from .moe import UNSHARDED, FusedMoE


class InklingMLP(GatedMLP):
    """The gated SiLU MLP over TP, times its learned ``global_scale`` (a partial scales as its
    sum does)."""

    def __init__(self, cfg, runtime: BoundaryRuntime, dtype) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size, runtime, dtype)
        self.global_scale = nn.Parameter(torch.ones(1, dtype=dtype), requires_grad=False)

    def forward(self, x):
        return super().forward(x) * self.global_scale


class InklingRouter(nn.Module):
    """Sigmoid scores over the routed then the shared experts (``weight`` [E + S, hidden]);
    the bias steers only the routed choice. Returns (routed weights [T, k], their ids [T, k],
    the shared experts' weights [T, S]), the weights in fp32."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.top_k, self.shared, self.scale = (cfg.num_experts_per_tok, cfg.n_shared_experts,
                                               cfg.route_scale)
        experts = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(experts + self.shared, cfg.hidden_size,
                                               dtype=torch.float32), requires_grad=False)
        self.global_scale = nn.Parameter(torch.ones(1), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts), requires_grad=False)

    def forward(self, x: torch.Tensor):
        logits = F.linear(x.float(), self.weight)  # [T, E + S]
        routed, shared = logits[:, :-self.shared], logits[:, -self.shared:]
        choice = routed.sigmoid() + self.e_score_correction_bias
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        chosen = F.logsigmoid(torch.cat((routed.gather(1, ids), shared), dim=-1))
        weights = torch.exp(chosen - torch.logsumexp(chosen, dim=-1, keepdim=True))
        weights = weights * self.scale * self.global_scale
        return weights[:, :self.top_k], ids, weights[:, self.top_k:]


class SharedExperts(nn.Module):
    """``n_shared_experts`` gated SiLU experts (``[S, inter, hidden]`` gate/up, ``[S, hidden,
    inter]`` down), their intermediate dim over ``group``, each scaled by its router weight
    before its down projection; the output is a partial over ``group``."""

    def __init__(self, cfg, group, dtype) -> None:
        super().__init__()
        s, d, inter = cfg.n_shared_experts, cfg.hidden_size, cfg.moe_intermediate_size
        shard = inter // group.size
        start = group.rank * shard
        for name, shape, dim in (("gate_proj", (s, shard, d), 1), ("up_proj", (s, shard, d), 1),
                                 ("down_proj", (s, d, shard), 2)):
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            param.weight_loader = _column_loader(dim, start, shard, inter)
            setattr(self, name, param)

    def forward(self, x: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], gammas [T, S] -> [T, hidden]: the experts' sum, taken in fp32."""
        xs = x[None].expand(self.gate_proj.shape[0], -1, -1)  # [S, T, hidden]
        gate = torch.bmm(xs, self.gate_proj.transpose(1, 2))  # [S, T, shard]
        up = torch.bmm(xs, self.up_proj.transpose(1, 2))
        scaled = F.silu(gate) * up * gammas.t()[..., None].to(x.dtype)
        down = torch.bmm(scaled, self.down_proj.transpose(1, 2))  # [S, T, hidden]
        return down.float().sum(0).to(x.dtype)


def _column_loader(dim: int, start: int, size: int, full: int):
    """A loader keeping [start, start + size) of dim ``dim`` (of ``full``) of a 3-d tensor."""

    def load(param, loaded):
        shape = list(param.shape)
        shape[dim] = full
        expect_shape(loaded, *shape)
        param.data.copy_(loaded.narrow(dim, start, size))

    return load


class InklingExperts(FusedMoE):
    """The routed experts as ``FusedMoE``, loaded from Inkling's fused tensors:
    ``gate_up_proj`` [E, 2 * inter, hidden] (gate rows, then up rows) and ``down_proj``
    [E, hidden, inter]."""

    def fused_loader(self, param, loaded, which: str) -> None:
        inter, hidden = self.intermediate_size, self.hidden_size
        shapes = {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
        expect_shape(loaded, self.num_experts, *shapes[which])
        mine = take(loaded, 0, self.first, self.local)  # [local, ...] this EP rank's experts
        cut = slice(self.shard_start, self.shard_start + self.shard)
        if which == "down":
            self.w2.data.copy_(mine[:, :, cut])
        else:
            gate, up = mine[:, :inter][:, cut], mine[:, inter:][:, cut]
            self.w13.data.copy_(torch.cat((gate, up), dim=1))


InklingExperts.fused_loader.reads_slices = True


class InklingMoE(nn.Module):
    """The router, the routed experts and the shared experts, whose partial joins the
    experts' one sum (whole on every rank beside dispatched experts)."""

    def __init__(self, cfg, runtime: BoundaryRuntime, dtype) -> None:
        super().__init__()
        dispatch = runtime.dispatches_moe
        self.gate = InklingRouter(cfg)
        self.experts = InklingExperts(cfg.n_routed_experts, cfg.hidden_size,
                                      cfg.moe_intermediate_size, runtime.parallel, dtype,
                                      dispatch=dispatch)
        self.shared_experts = SharedExperts(
            cfg, UNSHARDED if dispatch else runtime.parallel.tp_group, dtype)

    def forward(self, x: torch.Tensor):
        weights, ids, gammas = self.gate(x)
        shared = self.shared_experts(x, gammas)  # the shared experts the router's gammas weight
        return self.experts(x, ids, weights.to(x.dtype), shared_output=shared)
