"""Routed experts for MoE models: plain PyTorch compute under expert and tensor parallelism.

Rank (ep, mtp) of the TP group holds experts [ep * E/moe_ep, ...), each with its intermediate
dim split over moe_tp. Two ways to reach them:

* gathered (``moe_a2a_backend="none"``): every rank holds the FFN's input rows (every DP
  rank's tokens, gathered by the boundary) and runs its local experts on the tokens routed to
  them; the output is a partial sum over the whole TP group (``SumGroup.MOE_OUT``). Finalize
  (the top-k weighted sum) runs here, or is handed to the next input as a ``HandoffOutput``
  when the exit publishes ``defer_moe_finalize``.
* dispatched (``"all_to_all"``, ``declare_ffn(dispatches=True)``): the MoE stays on the
  residual's rows, which no other rank holds. Each token goes once to every rank holding one
  of its chosen experts (all moe_tp shards of that EP rank), with its ids and weights; the
  rank returns the weighted sum of its experts' outputs for the token, and the source adds
  the returns: the output is complete on the source's rows. Under ``defer_moe_finalize`` that
  last add is handed to the next input (``CombineFinalize``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import HandoffOutput
from ..runtime import Parallel, all_reduce_rows, all_to_all_rows, exchange_counts, get_forward
from ..runtime.linear import expect_shape
from ..runtime.shards import read_columns, take
from ..runtime.parallel import Group
from .config import quantized_read

# a group of one: shared experts whole on every rank (DeepSeek-V3's shared_experts_tp1, and
# every shared expert beside dispatched routed experts, whose rows no other rank holds)
UNSHARDED = Group("shared_tp1", (0,), 0)


def experts_fp8_group(cfg, layer: int, num_experts: int, shared: bool = False) -> int | None:
    """The group (channels per scale) in which an FP8 checkpoint's MoE layer ``layer`` feeds
    its experts' (and ``shared`` experts') gate/up projections the stage input quantized, or
    None: not every one of them is FP8. The rule of ``config.quantized_read``, but applied in
    the block, after the movement: the router reads the unquantized input, so the stage's read
    stays unquantized, and the quantization is row-wise, so it gives the same values there."""
    names = [f"mlp.experts.{e}.{p}" for e in range(num_experts) for p in ("gate_proj", "up_proj")]
    if shared:
        names += ["mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"]
    read = quantized_read(cfg, layer, tuple(names))
    return None if read is None else read.group


class MoeFinalize(HandoffOutput):
    """Per-(token, k) expert outputs and their router weights; ``complete()`` sums them (plus
    any partial that shares the MoE output's reduction, such as TP-sharded shared experts)."""

    def __init__(self, expert_out: torch.Tensor, weights: torch.Tensor,
                 extra: torch.Tensor | None = None) -> None:
        self.expert_out, self.weights, self.extra = expert_out, weights, extra  # [T,k,H], [T,k]

    def complete(self) -> torch.Tensor:
        out = finalize(self.expert_out, self.weights)
        return out if self.extra is None else out + self.extra


class CombineFinalize(HandoffOutput):
    """The all-to-all MoE's combined rows before they are summed per token: each EP rank's
    router-weighted partial for the tokens it served (``back``, in ``index`` order), plus the
    identity experts' and replicated shared experts' complete terms. ``complete()`` adds them
    onto the token rows; nothing is owed after it (the combine already crossed the ranks)."""

    def __init__(self, shape, index: torch.Tensor, back: torch.Tensor,
                 identity: torch.Tensor | None, shared: torch.Tensor | None) -> None:
        self.shape, self.index, self.back = shape, index, back  # [T, H], [N], [N, H]
        self.identity, self.shared = identity, shared  # [T, H] each, or None

    def complete(self) -> torch.Tensor:
        out = self.back.new_zeros(self.shape).index_add_(0, self.index, self.back)
        for term in (self.identity, self.shared):
            if term is not None:
                out = out + term
        return out


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

    ``swiglu_alpha`` (GPT-OSS, gated only): ``(up + 1) * gate * sigmoid(alpha * gate)``
    in place of ``act(gate) * up`` (after the ``swiglu_limit`` clamps).

    ``bias`` (GPT-OSS): a bias on each expert's gate/up rows (sharded with them) and on its
    down output, which only moe_tp rank 0 of the expert's EP rank adds, so the sum over the
    TP group (or the dispatched combine) holds it once per (token, expert), inside the router
    weighting. The checkpoint's fused tensors load through ``fused_loader``.

    ``dispatch`` (an all-to-all runtime): the forward dispatches and combines (module
    docstring) and returns the complete output; identity experts run on the source rank.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 parallel: Parallel, dtype=torch.float32, *, gated: bool = True,
                 activation: str = "silu", zero_experts: int = 0,
                 swiglu_limit: float | None = None, dispatch: bool = False,
                 swiglu_alpha: float | None = None, bias: bool = False):
        super().__init__()
        if (swiglu_limit is not None or swiglu_alpha is not None) and not gated:
            raise ValueError("swiglu_limit and swiglu_alpha apply to gated experts only")
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
        self.group = parallel.tp_group
        self.num_experts, self.identity_experts = num_experts, zero_experts
        self.dispatch, self.moe_ep, self.moe_tp = dispatch, dims.moe_ep, dims.moe_tp
        # gathered: only TP rank 0 carries the identity experts' rows into the group's partial
        # sum; dispatched: every rank, for its own rows (its output is complete)
        self.zero_experts = zero_experts if dispatch or parallel.tp_group.rank == 0 else 0
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
        self.alpha, self.w13_bias, self.w2_bias = swiglu_alpha, None, None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(self.local, up_rows, dtype=dtype),
                                         requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(self.local, hidden_size, dtype=dtype),
                                        requires_grad=False)
            self.w13_bias.weight_loader = self.w2_bias.weight_loader = self.fused_loader
        # the down bias joins the TP group's sum once: on moe_tp rank 0 of each EP rank
        self.adds_down_bias = bias and parallel.moe_tp_rank == 0

    def fused_loader(self, param, loaded: torch.Tensor, which: str) -> None:
        """Every expert's tensor of one kind, fused as GPT-OSS's checkpoint holds them (``which``):
        "gate_up" [E, hidden, 2 * inter], "gate_up_bias" [E, 2 * inter] (gate and up columns
        interleaved: gate j at 2j, up j at 2j + 1), "down" [E, inter, hidden], "down_bias"
        [E, hidden]. This rank reads its experts' rows and keeps its moe_tp shard."""
        hidden, inter = self.hidden_size, self.intermediate_size
        shapes = {"gate_up": (hidden, 2 * inter), "gate_up_bias": (2 * inter,),
                  "down": (inter, hidden), "down_bias": (hidden,)}
        expect_shape(loaded, self.num_experts, *shapes[which])
        mine = take(loaded, 0, self.first, self.local)  # [local, ...] this EP rank's experts
        cut = slice(self.shard_start, self.shard_start + self.shard)
        if which == "down_bias":
            param.data.copy_(mine)
        elif which == "down":  # [local, inter, hidden] -> [local, hidden, shard]
            self.w2.data.copy_(mine[:, cut].transpose(1, 2))
        else:
            if which == "gate_up":
                mine = mine.transpose(1, 2)  # [local, 2 * inter, hidden]
            gate, up = mine[:, 0::2][:, cut], mine[:, 1::2][:, cut]  # [local, shard, ...]
            param.data.copy_(torch.cat((gate, up), dim=1))  # w13's layout: gate, then up

    def weight_loader(self, param, loaded: torch.Tensor, shard_id) -> None:
        if isinstance(shard_id, str):  # every expert's tensor at once (``fused_loader``)
            return self.fused_loader(param, loaded, shard_id)
        expert, which = shard_id
        hidden, inter = self.hidden_size, self.intermediate_size  # one expert, unsharded
        expect_shape(loaded, *((hidden, inter) if which == "down" else (inter, hidden)))
        e = expert - self.first
        if which == "down":
            # the TP group reads each down projection together (shards.read_columns): the
            # moe_tp ranks of the expert's EP shard want their columns, the others none
            owner = expert // self.local
            wants = [((j % self.moe_tp) * self.shard, self.shard) if j // self.moe_tp == owner
                     else (0, 0) for j in range(self.group.size)]
            read_columns(loaded, self.group, wants,
                         self.w2.data[e] if 0 <= e < self.local else None)
            return
        if not 0 <= e < self.local:
            return  # another expert-parallel rank's expert
        if which == "gate" and not self.gated:
            raise RuntimeError("ungated experts have no gate_proj")
        offset = self.shard if which == "up" and self.gated else 0
        self.w13.data[e, offset:offset + self.shard].copy_(
            take(loaded, 0, self.shard_start, self.shard))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                shared_output: torch.Tensor | None = None):
        """x: [T, H]; topk_ids/weights: [T, k]. Returns [T, H] (summed over the TP group unless
        the exit skips it), or a ``MoeFinalize`` handoff under ``defer_moe_finalize`` (a
        ``CombineFinalize`` when dispatched).

        ``shared_output``: another partial over the TP group (shared experts sharded like the
        routed ones) added before the one reduction, wherever that runs. Dispatched: the
        complete output of replicated shared experts, added to the combined rows.
        """
        if self.dispatch:
            return self._dispatched(x, topk_ids, topk_weights, shared_output)
        if torch.compiler.is_compiling() or _capturing(x):
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

    def _dispatched(self, x, topk_ids, topk_weights, shared_output):
        """The all-to-all path: [T, H] on this rank's rows -> [T, H] complete on them, or
        their ``CombineFinalize`` under ``defer_moe_finalize`` (the per-token sums left to
        the next input)."""
        if torch.compiler.is_compiling():
            raise RuntimeError("the all-to-all MoE sizes its dispatch by the routing (host "
                               "counts): it does not run under torch.compile yet")
        group, rows, k = self.group, x.shape[0], topk_ids.shape[1]
        limit = self.num_experts + self.identity_experts
        bad = topk_ids[(topk_ids < 0) | (topk_ids >= limit)]  # refused on every rank below
        routed = (topk_ids >= 0) & (topk_ids < self.num_experts)
        owner = torch.where(routed, topk_ids // self.local, 0)  # [T, k] EP rank
        hits = torch.zeros((rows, self.moe_ep), dtype=torch.long, device=x.device).scatter_add_(
            1, owner, routed.long()) > 0  # [T, moe_ep]: the token goes to that EP rank
        # ranks are ep-major over the TP group: rank d holds EP rank d // moe_tp's experts
        tokens = [torch.nonzero(hits[:, d // self.moe_tp]).squeeze(1) for d in range(group.size)]
        send = [t.numel() for t in tokens]
        recv = self._exchange(send, int(bad[0]) if bad.numel() else None)
        index = torch.cat(tokens)
        meta = torch.cat([topk_ids[index].float(), topk_weights[index].float()], dim=1)
        x_in = all_to_all_rows(x[index], group, send, recv)  # [M, H]
        meta_in = all_to_all_rows(meta, group, send, recv)  # [M, 2k]: ids, weights
        ids_in, weights_in = meta_in[:, :k].long(), meta_in[:, k:]
        partial = x.new_zeros(x_in.shape)  # [M, H]: this rank's experts, router-weighted
        for e in range(self.local):
            token, slot = torch.where(ids_in == self.first + e)
            if token.numel():
                y = self._expert(x_in[token], e)
                partial.index_add_(0, token, y * weights_in[token, slot].unsqueeze(-1).to(y.dtype))
        back = all_to_all_rows(partial, group, recv, send)  # [N, H] in ``index`` order
        identity = None
        if self.zero_experts:
            identity = ((~routed).to(x.dtype) * topk_weights.to(x.dtype)).sum(1, keepdim=True) * x
        combined = CombineFinalize(x.shape, index, back, identity, shared_output)
        return combined if get_forward().defer_moe_finalize else combined.complete()

    def _exchange(self, send: list[int], bad: int | None) -> list[int]:
        """The row counts every rank sends this one, with each rank's check of its router's
        choices (``bad``: an expert id no rank owns, or None): refused on every rank, so none
        waits in an all-to-all its peers left."""
        limit = self.num_experts + self.identity_experts
        table = exchange_counts([[n, bad is not None, bad or 0] for n in send], self.group)
        wrong = [(rank, chosen) for rank, (_, flagged, chosen) in enumerate(table) if flagged]
        if wrong:
            rank, chosen = wrong[0]
            owned = f"experts 0..{self.num_experts - 1}" + (
                f" and identity experts {self.num_experts}..{limit - 1}"
                if self.identity_experts else "")
            raise ValueError(f"the router on TP rank {rank} chose expert {chosen}, which no "
                             f"rank owns ({owned})")
        return [n for n, _, _ in table]

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Local expert ``e`` on rows x: [n, H] -> [n, H] (this rank's moe_tp partial)."""
        bias = None if self.w13_bias is None else self.w13_bias[e]
        h = F.linear(x, self.w13[e], bias)  # [n, 2 * shard] gated, [n, shard] ungated
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            if self.limit is not None:
                gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            if self.alpha is not None:  # GPT-OSS's clamped SwiGLU
                h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
            else:
                h = self.act(gate) * up
        else:
            h = self.act(h)
        return F.linear(h, self.w2[e], self.w2_bias[e] if self.adds_down_bias else None)

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


def _capturing(x: torch.Tensor) -> bool:
    """Whether a CUDA graph is capturing this forward: then, as under torch.compile, no shape
    may depend on the routing (the per-expert path asks the host how many tokens each
    expert got, which a capture cannot)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


FusedMoE.weight_loader.reads_slices = True  # this rank's experts, their moe_tp shard only
FusedMoE.fused_loader.reads_slices = True  # this rank's experts' rows


def fused_expert_params(bias: bool = True) -> list[tuple[str, str, str]]:
    """Loader mapping from the fused per-layer expert tensors (GPT-OSS's ``experts.gate_up_proj``,
    ``experts.down_proj`` and their biases) to a ``FusedMoE`` held as ``experts``; the
    parameters take them through ``fused_loader``."""
    out = [("experts.w13", "experts.gate_up_proj", "gate_up"),
           ("experts.w2", "experts.down_proj", "down")]
    if bias:
        out += [("experts.w13_bias", "experts.gate_up_proj_bias", "gate_up_bias"),
                ("experts.w2_bias", "experts.down_proj_bias", "down_bias")]
    return out


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
