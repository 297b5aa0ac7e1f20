"""IBM GraniteMoE (3.x MoE) with layer boundaries: Granite (``granite.py``: the four
multipliers, the scaled residual update on both stages) with a sparse MoE FFN on every layer.

What transformers' ``modeling_granitemoe.py`` computes for the MoE, and where it lives here:

* the router (``block_sparse_moe.router.layer``): fp32 logits ``linear(x, weight)``, the top
  k of the logits, a softmax over those k alone (so the weights always sum to 1), cast to the
  input's dtype (``GraniteMoeRouter``);
* the experts: ``down(silu(gate(x)) * up(x))``, router-weighted and summed per token
  (``moe.FusedMoE``: experts over EP, each expert's ``intermediate_size`` over the MoE TP
  size, gathered or dispatched all-to-all); no shared experts, no biases;
* the checkpoint holds each layer's experts fused: ``block_sparse_moe.input_linear.weight``
  [E, 2 * intermediate, hidden] (gate rows, then up rows) and ``output_linear.weight``
  [E, hidden, intermediate]; each rank reads its experts' rows (``GraniteMoeExperts``).

transformers' GraniteMoE reads no ``mlp_bias``; its expert counts default as its config's
(``num_local_experts`` 8, ``num_experts_per_tok`` 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import declare_attn, declare_ffn
from ..residual.scaled import scaled_update
from ..runtime.args import BoundaryRuntime
from ..runtime.hf_names import NotLinear, Rename
from ..runtime.linear import expect_shape
from ..runtime.shards import take
from .config import CheckpointError
from .granite import GraniteConfig, GraniteForCausalLM, granite_attention
from .layers import DecoderLayer
from .mixtral import check_moe_parallel
from .moe import FusedMoE
from .registry import dense, register_model
from .settings import setting


@dataclass(frozen=True)
class GraniteMoeConfig(GraniteConfig):
    """Granite's fields (no ``mlp_bias``), and the experts (transformers' GraniteMoeConfig
    defaults): ``num_experts`` (``num_local_experts``) of ``intermediate_size`` each,
    ``num_experts_per_tok`` chosen per token."""

    mlp_bias: bool = False
    num_experts: int = setting(8, names=("num_local_experts",))
    num_experts_per_tok: int = setting(2)
    model_type: str = "granitemoe"

    expert_fields, top_k_fields = ("num_local_experts",), ("num_experts_per_tok",)

    @classmethod
    def read(cls, cfg: dict) -> dict:
        values = super().read(cfg)
        experts, k = values["num_experts"], values["num_experts_per_tok"]
        if k > experts:  # validate() checks it where config.json names both
            raise CheckpointError(f"config.json field num_experts_per_tok={k} exceeds the "
                                  f"{experts} experts")
        return values


class GraniteMoeRouter(nn.Module):
    """fp32 logits, their top k, a softmax over the k (transformers' order: the top k of the
    logits, not of a softmax over every expert)."""

    def __init__(self, cfg: GraniteMoeConfig, dtype):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.layer = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False, dtype=dtype)
        self.layer.weight.requires_grad_(False)

    def forward(self, x):
        logits = F.linear(x, self.layer.weight).float()  # [T, E]
        top, ids = logits.topk(self.top_k, dim=-1)  # [T, k]
        return torch.softmax(top, dim=-1).to(x.dtype), ids


class GraniteMoeExperts(FusedMoE):
    """SwiGLU experts loading GraniteMoE's fused tensors (``fused_loader``)."""

    def fused_loader(self, param, loaded: torch.Tensor, which: str) -> None:
        """Every expert's tensor of one kind (``which``): "input_linear" [E, 2 * inter, hidden]
        (gate rows, then up rows) or "output_linear" [E, hidden, inter]. This rank reads its
        experts' rows and keeps its moe_tp shard of the intermediate dim."""
        hidden, inter = self.hidden_size, self.intermediate_size
        cut = slice(self.shard_start, self.shard_start + self.shard)
        if which == "output_linear":
            expect_shape(loaded, self.num_experts, hidden, inter)
            mine = take(loaded, 0, self.first, self.local)  # [local, hidden, inter]
            self.w2.data.copy_(mine[:, :, cut])  # w2's layout: [local, hidden, shard]
            return
        if which != "input_linear":
            raise ValueError(f"GraniteMoE experts load input_linear and output_linear, not "
                             f"{which}")
        expect_shape(loaded, self.num_experts, 2 * inter, hidden)
        mine = take(loaded, 0, self.first, self.local)  # [local, 2 * inter, hidden]
        gate, up = mine[:, :inter][:, cut], mine[:, inter:][:, cut]  # [local, shard, hidden]
        self.w13.data.copy_(torch.cat((gate, up), dim=1))  # w13's layout: gate, then up


class GraniteMoeBlock(nn.Module):
    """The router, then the routed experts (reduced, a partial, a finalize handoff, or
    dispatched and complete, as the exit and the runtime decide)."""

    def __init__(self, cfg: GraniteMoeConfig, runtime: BoundaryRuntime, dtype):
        super().__init__()
        self.router = GraniteMoeRouter(cfg, dtype)
        self.experts = GraniteMoeExperts(cfg.num_experts, cfg.hidden_size,
                                         cfg.intermediate_size, runtime.parallel, dtype,
                                         dispatch=runtime.dispatches_moe)

    def forward(self, x):
        weights, ids = self.router(x)
        return self.experts(x, ids, weights)


class GraniteMoeDecoderLayer(DecoderLayer):
    """Granite's attention, then the MoE (``block_sparse_moe``, the checkpoint's name); both
    outputs join the residual scaled by ``residual_multiplier``."""

    def __init__(self, cfg: GraniteMoeConfig, layer_id: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = granite_attention(cfg, layer_id, runtime, dtype)
        self.block_sparse_moe = GraniteMoeBlock(cfg, runtime, dtype)
        self.connect(cfg, layer_id, runtime, fusions=fusions, name=f"layer{layer_id}")

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        # the attention's linears move the rows in a sequence-parallel batch; the experts do
        # not (the boundary gathers their input and reduce-scatters the sum there)
        update = scaled_update(cfg.residual_multiplier)
        return (declare_attn(sequence_parallel=True, update=update),
                declare_ffn(sparse=True, next_sparse=index + 1 < cfg.num_hidden_layers,
                            dispatches=runtime.dispatches_moe, update=update))

    def stage_compute(self) -> list:
        return [(self.attn_boundary, self.attn_compute), (self.ffn_boundary, "block_sparse_moe")]

    def feed_forward(self, hidden_states, forward_batch):
        return self.block_sparse_moe(hidden_states)


@register_model("granitemoe", GraniteMoeConfig, architectures=("GraniteMoeForCausalLM",),
                **dense(check_parallel=check_moe_parallel, moe_a2a=True))
class GraniteMoeForCausalLM(GraniteForCausalLM):
    """Granite's model (scaled embedding and logits, stacked q/k/v) with MoE layers; each
    layer's fused expert tensors load into its experts' ``w13``/``w2``."""

    layer_cls = GraniteMoeDecoderLayer
    # transformers' granitemoe conversion: the fused expert tensors and the router renamed (the
    # same tensors); the router is no nn.Linear
    transformers_names = (
        Rename(r"block_sparse_moe\.input_linear\.weight$", "block_sparse_moe.experts.gate_up_proj"),
        Rename(r"block_sparse_moe\.output_linear\.weight$", "block_sparse_moe.experts.down_proj"),
        Rename(r"block_sparse_moe\.router\.layer\.weight$", "block_sparse_moe.router.weight"),
        NotLinear(r".*\.block_sparse_moe\.router"))

    def stacked_params(self) -> list:
        return super().stacked_params() + [
            ("experts.w13", "input_linear.weight", "input_linear"),
            ("experts.w2", "output_linear.weight", "output_linear")]
