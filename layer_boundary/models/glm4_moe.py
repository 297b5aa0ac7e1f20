"""GLM-4.5 (``glm4_moe``): grouped-query attention with partial rotary, then DeepSeek-V3's
MoE, with layer boundaries. Parameter names follow the Hugging Face checkpoint (q/k/v are
stacked into ``qkv_proj``, the routed experts fused per rank, at load time).

* Attention: ``layers.GqaAttention``, heads over attention TP (kv heads split, or replicated
  over whole ranks), biases on q/k/v only (``attention_bias``; ``o_proj`` has none), an
  optional per-head RMSNorm on q and k before the rotary (``use_qk_norm``), and the
  rotate-half rope on the first ``head_dim * partial_rotary_factor`` dims of each head (0.5
  by default), the rest passed through. PARTIAL: ``o_proj`` never reduces.
* FFN: a gated MLP over TP on the first ``first_k_dense_replace`` layers, then DeepSeek-V3's
  MoE block (imported): the sigmoid router with ``e_score_correction_bias`` steering the
  group-limited choice, ``norm_topk_prob``, ``routed_scaling_factor``, routed experts over
  ``moe_ep x moe_tp`` and the shared experts.

The multi-token-prediction layers stored after the stack (``num_nextn_predict_layers``) are
not loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import declare_attn
from ..runtime.args import BoundaryRuntime
from ..runtime.hf_names import GATE_UP_EXPERTS, MLP_ROUTER
from .config import (BOOL, NON_NEGATIVE_INT, POSITIVE_NUMBER, check_grouped_router,
                     check_heads, check_unquantized_silu)
from .deepseek_v3 import DeepseekV3MoE, ffn_declaration
from .deepseek_v3 import check_parallel as check_experts
from .layers import DecoderLayer, GatedMLP, GqaAttention
from .llama import LlamaForCausalLM
from .moe import expert_stacked_params
from .qwen3_next import rope_fields
from .registry import dense, register_model
from .rope import inverse_frequencies
from .settings import DecoderConfig, Null, setting


@dataclass(frozen=True)
class Glm4MoeConfig(DecoderConfig):
    """The dense decoder's sizes (``intermediate_size``: the dense first layers' MLP), the
    attention's (GQA, partial rotary: ``rotary_dim``, with ``rope_theta`` read by
    ``qwen3_next.rope_fields``) and DeepSeek-V3's MoE block's."""

    rotary_dim: int = 0
    rope_theta: float = 10000.0
    moe_intermediate_size: int = setting()
    # transformers writes num_local_experts beside n_routed_experts (an attribute map)
    n_routed_experts: int = setting(names=("n_routed_experts", "num_local_experts"))
    num_experts_per_tok: int = setting()
    n_shared_experts: int = setting(1)
    first_k_dense_replace: int = setting(1, NON_NEGATIVE_INT, null=Null.DEFAULT)
    n_group: int = setting(1)
    topk_group: int = setting(1)
    norm_topk_prob: bool = setting(True, BOOL)
    routed_scaling_factor: float = setting(1.0, POSITIVE_NUMBER)
    use_qk_norm: bool = setting(False, BOOL)
    attention_bias: bool = setting(False, BOOL)
    rms_norm_eps: float = setting(1e-5)
    tie_word_embeddings: bool = setting(False)
    # MTP layers stored after the stack; not loaded
    num_nextn_predict_layers: int = setting(0, NON_NEGATIVE_INT, null=Null.DEFAULT,
                                            names=("num_nextn_predict_layers", "num_mtp_layers"))
    # Engine option, never read from config.json (DeepSeek-V3's): the shared experts unsharded
    # on every rank, added after the routed experts' sum (a LOCAL_TAIL FFN stage)
    shared_experts_tp1: bool = False
    model_type: str = "glm4_moe"

    expert_fields = ("n_routed_experts", "num_local_experts")
    top_k_fields = ("num_experts_per_tok",)

    def is_moe(self, layer: int) -> bool:
        return self.first_k_dense_replace <= layer < self.num_hidden_layers

    @classmethod
    def read(cls, cfg: dict) -> dict:
        """The declared settings, the rope (transformers' partial_rotary_factor for GLM-4.5
        is 0.5 by default) and the grouped router's check."""
        check_unquantized_silu(cfg)
        values = super().read(cfg)
        check_grouped_router(values["n_routed_experts"], values["n_group"],
                             values["topk_group"], values["num_experts_per_tok"])
        return dict(values, **rope_fields(cfg, values["head_dim"], default_factor=0.5))


def check_parallel(cfg: Glm4MoeConfig, dims) -> None:
    """Query and kv heads over attention TP; the dense MLPs, the shared and the routed experts
    as DeepSeek-V3's (``intermediate_size``, ``n_routed_experts``, ``moe_intermediate_size``)."""
    check_heads(cfg.num_attention_heads, cfg.num_key_value_heads, dims.attn_tp)
    check_experts(cfg, dims)


class Glm4MoeDecoderLayer(DecoderLayer):
    """GQA (partial rotary, optional q/k norm, q/k/v biases), then the dense MLP or
    DeepSeek-V3's MoE."""

    def __init__(self, cfg: Glm4MoeConfig, layer_id: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = GqaAttention.of(
            cfg, layer_id, runtime, dtype, bias=cfg.attention_bias, o_bias=False,
            qk_norm_eps=cfg.rms_norm_eps if cfg.use_qk_norm else None,
            inv_freq=inverse_frequencies(cfg.rope_theta, cfg.rotary_dim),
            rotary_dim=cfg.rotary_dim)
        if cfg.is_moe(layer_id):
            self.mlp = DeepseekV3MoE(cfg, runtime, dtype)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, runtime, dtype)
        self.connect(cfg, layer_id, runtime, fusions=fusions, name=f"layer{layer_id}")

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        """GQA (PARTIAL; its linears move the rows in a sequence-parallel batch), then the
        FFN as DeepSeek-V3 declares it (dense or sparse, its next FFN's kind, a dispatching
        MoE, the shared experts' LOCAL_TAIL)."""
        return declare_attn(sequence_parallel=True), ffn_declaration(cfg, index, runtime)


@register_model("glm4_moe", Glm4MoeConfig, architectures=("Glm4MoeForCausalLM",),
                **dense(check_parallel=check_parallel, moe_a2a=True))
class Glm4MoeForCausalLM(LlamaForCausalLM):
    """Llama's model (stacked q/k/v, a KV cache of head_dim) with GLM-4.5's layers; the
    experts' weights load stacked after q/k/v."""

    layer_cls = Glm4MoeDecoderLayer
    # transformers' qwen2_moe conversion: each layer's experts stacked into
    # experts.gate_up_proj and experts.down_proj; the router is no nn.Linear
    transformers_names = (*GATE_UP_EXPERTS, MLP_ROUTER)

    def stacked_params(self) -> list:
        cfg = self.config
        experts = (expert_stacked_params(cfg.n_routed_experts)
                   if cfg.first_k_dense_replace < cfg.num_hidden_layers else [])
        return super().stacked_params() + experts

    def skipped_params(self) -> tuple:
        cfg = self.config  # its MTP layers are stored as layers after the stack
        mtp = range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
        return super().skipped_params() + tuple(f"model.layers.{i}." for i in mtp)
