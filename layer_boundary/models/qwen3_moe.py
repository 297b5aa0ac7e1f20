"""Qwen3-MoE: Qwen3 attention with sparse (softmax top-k) expert FFNs on most layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import declare_attn, declare_ffn, make_stages
from ..residual import batch as residual_batch
from ..runtime.args import BoundaryRuntime
from ..runtime.embedding import ParallelLMHead, VocabParallelEmbedding
from ..runtime.norm import RMSNorm
from .kv_cache import KVCache
from .loader import load_weights, require
from .moe import FusedMoE, expert_stacked_params
from .qwen3 import Qwen3Attention, Qwen3Config, Qwen3MLP, check_tp


@dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    moe_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    model_type: str = "qwen3_moe"

    @classmethod
    def from_dict(cls, cfg: dict) -> "Qwen3MoeConfig":
        base = Qwen3Config.from_dict(cfg).__dict__
        base.pop("model_type")
        return cls(**base,
                   moe_intermediate_size=require(cfg, "moe_intermediate_size"),
                   # transformers writes num_local_experts; released checkpoints num_experts
                   num_experts=require(cfg, "num_experts" if "num_experts" in cfg
                                       else "num_local_experts"),
                   num_experts_per_tok=require(cfg, "num_experts_per_tok"),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                   decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
                   mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))

    def is_sparse(self, layer_id: int) -> bool:
        return (0 <= layer_id < self.num_hidden_layers and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)


def check_parallel(cfg: Qwen3MoeConfig, dims) -> None:
    check_tp(cfg, dims.attn_tp, dims.tp)
    if cfg.num_experts % dims.moe_ep:
        raise ValueError(f"num_experts={cfg.num_experts} is not divisible by ep={dims.moe_ep}")
    if cfg.moe_intermediate_size % dims.moe_tp:
        raise ValueError(f"moe_intermediate_size={cfg.moe_intermediate_size} is not divisible by "
                         f"the MoE tensor-parallel size tp/ep={dims.moe_tp}")


class Qwen3MoeRouter(nn.Module):
    """Softmax over experts, top-k, optionally renormalised; scores in fp32 as HF."""

    def __init__(self, cfg: Qwen3MoeConfig, dtype):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype),
                                   requires_grad=False)

    def forward(self, x):
        logits = F.linear(x, self.weight)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, runtime: BoundaryRuntime, dtype):
        super().__init__()
        self.gate = Qwen3MoeRouter(cfg, dtype)
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                runtime.parallel, dtype)

    def forward(self, x):
        weights, ids = self.gate(x)
        return self.experts(x, ids, weights)  # reduced, partial, or a finalize handoff


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, layer_id: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__()
        sparse = cfg.is_sparse(layer_id)
        self.self_attn = Qwen3Attention(cfg, layer_id, runtime, dtype)
        self.mlp = (Qwen3MoeSparseBlock(cfg, runtime, dtype) if sparse
                    else Qwen3MLP(cfg, runtime, dtype))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        options = {} if fusions is None else {"fusions": fusions}
        self.attn_boundary, self.ffn_boundary = make_stages(
            (declare_attn(), self.input_layernorm, options),
            (declare_ffn(sparse=sparse, next_sparse=cfg.is_sparse(layer_id + 1)),
             self.post_attention_layernorm, options),
            previous=(declare_ffn(sparse=cfg.is_sparse(layer_id - 1), next_sparse=sparse)
                      if layer_id != 0 else None),
            terminal=layer_id == cfg.num_hidden_layers - 1,
            runtime=runtime,
            name=f"layer{layer_id}",
        )

    def forward(self, positions, hidden_states, forward_batch):
        hidden_states = self.attn_boundary.prepare(hidden_states, forward_batch)
        if hidden_states.shape[0] != 0:
            hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        hidden_states = self.attn_boundary.finish(hidden_states, forward_batch)

        hidden_states = self.ffn_boundary.prepare(hidden_states, forward_batch)
        with self.ffn_boundary.exit(forward_batch) as output:
            hidden_states = self.mlp(hidden_states)
        return output.finish(hidden_states)


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, runtime: BoundaryRuntime, dtype, fusions=None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size,
                                                   runtime.parallel.attn_tp, dtype=dtype)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(cfg, i, runtime, dtype, fusions)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.handoff_norm = None if fusions is None else fusions.handoff_norm()

    def forward(self, forward_batch):
        residual_batch.start(forward_batch)
        hidden_states = self.embed_tokens(forward_batch.input_ids)
        for layer in self.layers:
            hidden_states = layer(forward_batch.positions, hidden_states, forward_batch)
        return residual_batch.norm(hidden_states, forward_batch, self.norm, skip_empty=True,
                                   handoff_norm=self.handoff_norm)


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, runtime: BoundaryRuntime, dtype=torch.float32,
                 fusions=None):
        super().__init__()
        check_parallel(cfg, runtime.parallel.dims)
        self.config, self.dtype = cfg, dtype
        self.model = Qwen3MoeModel(cfg, runtime, dtype, fusions)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, runtime.parallel.attn_tp,
                                      dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def make_kv_cache(self, slots: int, max_len: int) -> KVCache:
        kv_heads = self.model.layers[0].self_attn.qkv_proj.num_kv_heads
        return KVCache(self.config.num_hidden_layers, slots, max_len, kv_heads,
                       self.config.head_dim, self.dtype, device=self.lm_head.weight.device)

    def forward(self, forward_batch) -> torch.Tensor:
        return self.lm_head(self.model(forward_batch))

    def load_weights(self, weights) -> None:
        stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                   ("qkv_proj", "v_proj", "v")] + expert_stacked_params(self.config.num_experts)
        skip = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        load_weights(self, weights, stacked=stacked, skip=skip)
