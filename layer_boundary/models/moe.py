"""Routed experts for MoE models: plain PyTorch compute under expert and tensor parallelism.

Every rank of the TP group holds the FFN's input rows (every DP rank's tokens), so expert
parallelism needs no all-to-all here: rank (ep, mtp) runs its local experts on the tokens
routed to them, with each expert's intermediate dim split over moe_tp, and the MoE output is a
partial sum over the whole TP group (``SumGroup.MOE_OUT``). Finalize (the top-k weighted sum)
runs here, or is handed to the next input as a ``HandoffOutput`` when the exit publishes
``defer_moe_finalize``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import HandoffOutput
from ..runtime import Parallel, all_reduce_rows, get_forward
from ..runtime.linear import expect_shape


class MoeFinalize(HandoffOutput):
    """Per-(token, k) expert outputs and their router weights; ``complete()`` sums them (plus
    any partial that shares the MoE output's reduction, such as TP-sharded shared experts)."""

    def __init__(self, expert_out: torch.Tensor, weights: torch.Tensor,
                 extra: torch.Tensor | None = None) -> None:
        self.expert_out, self.weights, self.extra = expert_out, weights, extra  # [T,k,H], [T,k]

    def complete(self) -> torch.Tensor:
        out = finalize(self.expert_out, self.weights)
        return out if self.extra is None else out + self.extra


def finalize(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[T, k, H] x [T, k] -> [T, H]: the router-weighted sum of a token's expert outputs."""
    return (expert_out * weights.unsqueeze(-1).to(expert_out.dtype)).sum(dim=1)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU (transformers' ``relu2``)."""
    return torch.square(F.relu(x))


ACTIVATIONS = {"silu": F.silu, "relu2": relu2}


class FusedMoE(nn.Module):
    """``num_experts`` experts; this rank holds experts [moe_ep_rank * E/moe_ep, ...) with
    their intermediate dim split over moe_tp.

    Gated (the default, SwiGLU with ``activation="silu"``): ``down(act(gate(x)) * up(x))``,
    ``w13`` stacks this rank's gate and up rows. Ungated (``gated=False``, as Nemotron-H's
    ``up -> relu2 -> down``): ``down(act(up(x)))``, ``w13`` holds the up rows only.

    Checkpoint tensors load one per expert (``experts.{e}.gate_proj/up_proj/down_proj``).

    ``zero_experts`` (LongCat-Flash): router ids ``num_experts .. num_experts + zero_experts - 1``
    are identity experts, whose output is the token itself (times its router weight). The
    output is a partial over the TP group, so exactly one rank of it (TP rank 0) puts the
    identity rows into its expert outputs: they reach the one sum, wherever it runs (the
    boundary's all-reduce or reduce-scatter, or a finalize handoff's completion), once.

    ``swiglu_limit`` (DeepSeek-V4, gated only): the gate pre-activation is clamped to at most
    the limit and the up pre-activation to [-limit, limit] before ``act(gate) * up``.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 parallel: Parallel, dtype=torch.float32, *, gated: bool = True,
                 activation: str = "silu", zero_experts: int = 0,
                 swiglu_limit: float | None = None):
        super().__init__()
        if swiglu_limit is not None and not gated:
            raise ValueError("swiglu_limit clamps gated experts only")
        if activation not in ACTIVATIONS:
            raise ValueError(f"expert activation {activation!r} is not supported "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        self.gated, self.act = gated, ACTIVATIONS[activation]
        self.limit = swiglu_limit
        dims = parallel.dims
        if num_experts % dims.moe_ep:
            raise ValueError(f"num_experts={num_experts} is not divisible by moe_ep={dims.moe_ep}")
        if intermediate_size % dims.moe_tp:
            raise ValueError(f"moe_intermediate_size={intermediate_size} is not divisible by "
                             f"moe_tp={dims.moe_tp}")
        self.group = parallel.tp
        self.num_experts = num_experts
        # only TP rank 0 carries the identity experts' rows into the group's partial sum
        self.zero_experts = zero_experts if parallel.tp.rank == 0 else 0
        self.local = num_experts // dims.moe_ep
        self.first = parallel.moe_ep_rank * self.local
        self.shard = intermediate_size // dims.moe_tp
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.shard_start = parallel.moe_tp_rank * self.shard
        up_rows = 2 * self.shard if gated else self.shard
        self.w13 = nn.Parameter(torch.empty(self.local, up_rows, hidden_size, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.local, hidden_size, self.shard, dtype=dtype),
                               requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded: torch.Tensor, shard_id) -> None:
        expert, which = shard_id
        hidden, inter = self.hidden_size, self.intermediate_size  # one expert, unsharded
        expect_shape(loaded, *((hidden, inter) if which == "down" else (inter, hidden)))
        e = expert - self.first
        if not 0 <= e < self.local:
            return  # another expert-parallel rank's expert
        rows = slice(self.shard_start, self.shard_start + self.shard)
        if which == "down":
            self.w2.data[e].copy_(loaded[:, rows])
        else:
            if which == "gate" and not self.gated:
                raise RuntimeError("ungated experts have no gate_proj")
            offset = self.shard if which == "up" and self.gated else 0
            self.w13.data[e, offset:offset + self.shard].copy_(loaded[rows])

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                shared_output: torch.Tensor | None = None):
        """x: [T, H]; topk_ids/weights: [T, k]. Returns [T, H] (summed over the TP group unless
        the exit skips it), or a ``MoeFinalize`` handoff under ``defer_moe_finalize``.

        ``shared_output``: another partial over the TP group (shared experts sharded like the
        routed ones) added before the one reduction, wherever that runs.
        """
        if torch.compiler.is_compiling():
            expert_out = self._dense_experts(x, topk_ids)
        else:
            expert_out = x.new_zeros((*topk_ids.shape, x.shape[-1]))  # [T, k, H]
            for e in range(self.local):
                token, slot = torch.where(topk_ids == self.first + e)
                if token.numel() == 0:
                    continue
                expert_out[token, slot] = self._expert(x[token], e)
        if self.zero_experts:
            identity = (topk_ids >= self.num_experts).unsqueeze(-1)  # [T, k, 1]
            expert_out = torch.where(identity, x.unsqueeze(1), expert_out)
        flags = get_forward()
        if flags.defer_moe_finalize:
            return MoeFinalize(expert_out, topk_weights, shared_output)
        out = finalize(expert_out, topk_weights)
        if shared_output is not None:
            out = out + shared_output
        if not flags.skips_reduction:
            out = all_reduce_rows(out, self.group)
        return out

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Local expert ``e`` on rows x: [n, H] -> [n, H] (this rank's moe_tp partial)."""
        h = F.linear(x, self.w13[e])  # [n, 2 * shard] gated, [n, shard] ungated
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            if self.limit is not None:
                gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return F.linear(h, self.w2[e])

    def _dense_experts(self, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T, k, H] expert outputs without data-dependent shapes (what a compiled graph can
        hold): every local expert runs on every token and a mask keeps the routed (token,
        slot) pairs. Each pair takes exactly one expert's rows, so the values are the routed
        ones; only the work grows (fine for the small models compiled here)."""
        expert_out = x.new_zeros((*topk_ids.shape, x.shape[-1]))  # [T, k, H]
        for e in range(self.local):
            y = self._expert(x, e)  # [T, H]
            routed = (topk_ids == self.first + e).unsqueeze(-1)  # [T, k, 1]
            expert_out = torch.where(routed, y.unsqueeze(1), expert_out)
        return expert_out


def expert_stacked_params(num_experts: int, gated: bool = True) -> list[tuple[str, str, tuple]]:
    """Loader mapping from per-expert checkpoint names to the fused expert parameters of a
    ``FusedMoE`` held as the ``experts`` attribute of the MoE block (no ``gate_proj`` when
    the experts are ungated)."""
    out = []
    for e in range(num_experts):
        if gated:
            out.append(("experts.w13", f"experts.{e}.gate_proj.weight", (e, "gate")))
        out += [("experts.w2", f"experts.{e}.down_proj.weight", (e, "down")),
                ("experts.w13", f"experts.{e}.up_proj.weight", (e, "up"))]
    return out
