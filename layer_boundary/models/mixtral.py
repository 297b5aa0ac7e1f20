"""Mixtral with layer boundaries: Mistral's attention (GQA, rotary, no biases, an optional
sliding window) before a sparse MoE FFN on every layer: a softmax top-k router over the
experts (its top-k weights always renormalised to sum 1), SwiGLU experts, no shared experts.

``sliding_window`` (null: none) as transformers' Mixtral masks it: a query at position q sees
the keys at positions q - sliding_window + 1 .. q. Every layer is windowed alike; the window
is applied by the attention on a positional KV cache (``cached_attention(window=...)``), so
the cache keeps every position (a draft may use it; CP shares mask their own queries).

Checkpoints name the MoE ``block_sparse_moe`` with experts ``experts.{e}.w1`` (gate), ``w3``
(up) and ``w2`` (down), as transformers' ``save_pretrained`` writes them (it converts its fused
``gate_up_proj``/``down_proj`` back); they load into ``mlp.experts``' stacked ``w13``/``w2``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .. import declare_attn, declare_ffn
from ..runtime.args import BoundaryRuntime
from ..runtime.hf_names import MLP_ROUTER, Rename, StackExperts
from .base import CausalLM
from .config import check_divisible, check_heads
from .layers import QKV_PARAMS, DecoderLayer, GqaAttention
from .mistral import MistralConfig
from .moe import expert_stacked_params
from .qwen3_moe import Qwen3MoeSparseBlock
from .registry import dense, register_model
from .settings import setting

# the routed experts: transformers writes ``num_local_experts`` (``num_experts`` is its alias)
EXPERT_NAMES = ("num_local_experts", "num_experts")


@dataclass(frozen=True)
class MixtralConfig(MistralConfig):
    """Mistral's fields (with transformers' Mixtral defaults), and the experts:
    ``num_experts`` (``num_local_experts``) of ``intermediate_size`` each,
    ``num_experts_per_tok`` chosen per token."""

    rms_norm_eps: float = setting(1e-5)
    rope_theta: float = 1e6
    num_experts: int = setting(names=EXPERT_NAMES)
    num_experts_per_tok: int = setting()
    model_type: str = "mixtral"

    expert_fields, top_k_fields = EXPERT_NAMES, ("num_experts_per_tok",)

    # what the shared MoE block (qwen3_moe.Qwen3MoeSparseBlock) reads: each expert is
    # intermediate_size wide, and the top-k weights are always renormalised
    @property
    def moe_intermediate_size(self) -> int:
        return self.intermediate_size

    @property
    def norm_topk_prob(self) -> bool:
        return True

    def is_sparse(self, layer_id: int) -> bool:
        """Every layer's FFN is the MoE."""
        return 0 <= layer_id < self.num_hidden_layers


def check_moe_parallel(cfg, dims) -> None:
    """Heads over attention TP; experts over EP, each expert's ``intermediate_size`` over the
    MoE tensor-parallel size (there is no dense MLP to split over TP)."""
    check_heads(cfg.num_attention_heads, cfg.num_key_value_heads, dims.attn_tp)
    check_divisible("num_local_experts", cfg.num_experts, "ep", dims.moe_ep)
    check_divisible("intermediate_size", cfg.intermediate_size,
                    "the MoE tensor-parallel size tp/ep", dims.moe_tp)


class MixtralDecoderLayer(DecoderLayer):
    """GQA (PARTIAL: ``o_proj`` never reduces) with the layer's window, then the MoE over
    ``moe_ep x moe_tp`` (a partial over TP, a finalize handoff, or dispatched all-to-all)."""

    def __init__(self, cfg, layer_id: int, runtime: BoundaryRuntime, dtype, fusions=None):
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = self.make_attention(cfg, layer_id, runtime, dtype)
        self.mlp = self.make_moe(cfg, runtime, dtype)
        self.connect(cfg, layer_id, runtime, fusions=fusions, name=f"layer{layer_id}")

    @staticmethod
    def make_attention(cfg: MixtralConfig, layer_id: int, runtime: BoundaryRuntime, dtype):
        return GqaAttention.of(cfg, layer_id, runtime, dtype,
                               inv_freq=cfg.inverse_frequencies(), window=cfg.sliding_window)

    @staticmethod
    def make_moe(cfg: MixtralConfig, runtime: BoundaryRuntime, dtype):
        return Qwen3MoeSparseBlock(cfg, runtime, dtype)  # softmax top-k, renormalised

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        # the attention's linears move the rows in a sequence-parallel batch; the experts do
        # not (the boundary gathers their input and reduce-scatters the sum there)
        return (declare_attn(sequence_parallel=True),
                declare_ffn(sparse=True, next_sparse=cfg.is_sparse(index + 1),
                            dispatches=runtime.dispatches_moe))


# on-disk expert projections -> the names expert_stacked_params maps onto w13 / w2
_EXPERT = re.compile(r"(\.experts\.\d+\.)(w[123])(\.weight)$")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def block_sparse_moe_name(name: str) -> str:
    """A Mixtral-layout checkpoint name as the model's: ``block_sparse_moe`` is ``mlp``, an
    expert's w1/w3/w2 its gate_proj/up_proj/down_proj."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return _EXPERT.sub(lambda m: m[1] + _PROJ[m[2]] + m[3], name)


@register_model("mixtral", MixtralConfig, architectures=("MixtralForCausalLM",),
                **dense(check_parallel=check_moe_parallel, moe_a2a=True))
class MixtralForCausalLM(CausalLM):
    """Mixtral's layers on a positional cache; q/k/v and the experts load stacked."""

    layer_cls = MixtralDecoderLayer
    # transformers' mixtral conversion: block_sparse_moe is mlp, each expert's w1 (gate) and
    # w3 (up) stacked into experts.gate_up_proj, its w2 into experts.down_proj
    transformers_names = (Rename(r"\.block_sparse_moe\.", ".mlp."),
                          StackExperts(("w1", "w3"), "gate_up_proj"),
                          StackExperts(("w2",), "down_proj"), MLP_ROUTER)

    def stacked_params(self) -> list:
        return [*QKV_PARAMS, *expert_stacked_params(self.config.num_experts)]

    def checkpoint_name(self, name: str) -> str | None:
        return block_sparse_moe_name(name)
