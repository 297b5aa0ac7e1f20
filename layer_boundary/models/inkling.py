"""Inkling's text model (``inkling_text``, transformers' ``InklingForCausalLM``) with layer
boundaries.

What transformers' ``modeling_inkling.py`` computes, and this file with it:

* Embedding: the token embedding, then an RMSNorm (``embed_tokens.embed_norm``).
* Each layer: ``h = x + sconv_a(attn(norm_1(x)))``, then ``out = h + sconv_m(mlp(norm_2(h)))``,
  where a short convolution is ``y + conv(y)``, a causal depthwise convolution of
  ``conv_kernel_size`` taps along each request's tokens, its weight and arithmetic in fp32
  (``attn_sconv``/``mlp_sconv``): the residual kind ``residual.short_conv.ShortConvUpdate`` on
  each producer, applied by the consumer before its norm.
* Attention, with no rotary embedding: q, k, v and ``r_proj`` (``d_rel`` relative states per
  head) from the normed input; k and v each through a short convolution of their own
  (``k_sconv``/``v_sconv``, before the cache); per-head RMSNorms on q and k; scores scaled by
  ``1 / head_dim`` (q and k are normalized) plus a relative bias: ``r @ proj`` gives each
  query head a value per backward distance ``0 <= d < extent``, zero beyond; ``extent`` is
  ``rel_extent`` on full layers and ``sliding_window_size`` on sliding ones. Sliding layers
  (``layer_types`` "hybrid_sliding") see their last ``sliding_window_size`` positions and
  have their own head counts and dim (``swa_*``). Full layers with ``log_scaling_n_floor``
  multiply the queries and the bias by ``1 + alpha * log(max((p + 1) / n_floor, 1))`` at
  position p, in fp32. Softmax in fp32, then the model dtype.
* FFN: per ``mlp_layer_types``, a gated SiLU MLP times its ``global_scale``, or a MoE: a
  router over routed and shared experts (sigmoid scores; the top-k routed by score plus
  ``e_score_correction_bias``; weights the normalized sigmoids of the chosen routed and every
  shared expert together, times ``route_scale * global_scale``, in fp32), the routed experts
  (fused ``gate_up_proj``/``down_proj``) and the shared experts, each scaled by its weight.
* Head: the final norm's output divided by ``logits_mup_width_multiplier``, then the untied
  ``lm_head``.

Refused by name: another activation, a quantized checkpoint, an unpadded head
(``unpadded_vocab_size`` below ``vocab_size``), ``shared_expert_sink`` false (transformers
computes the sink only). The multi-token-prediction layers (``model.mtp.*``) are not loaded.

Parallelism: heads over attention TP (kv heads split or replicated, their k/v convolution
channels with them); the dense MLP, the shared experts' intermediate dim and the routed
experts (``moe_ep x moe_tp``) over TP, as the other MoE models. The short convolutions need
each DP rank's complete outputs on its own token rows, so every entry completes its
producer's output there, in every row mode: ``rs``/``rsv`` run, but gain nothing over ``ar``
(what ``auto`` picks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import declare_attn, declare_ffn
from ..residual.short_conv import ShortConv, ShortConvState, ShortConvUpdate, state_of
from ..runtime import (BoundaryRuntime, ColumnParallelLinear, QKVParallelLinear, RMSNorm,
                       RowParallelLinear)
from ..runtime.embedding import VocabParallelEmbedding
from ..runtime.hf_names import MLP_ROUTER
from ..runtime.linear import expect_shape
from .base import CausalLM, vocab_embedding
from .config import (BOOL, DECODER, EXPERTS, INT_LIST, NON_NEGATIVE_INT, POSITIVE_INT,
                     POSITIVE_NUMBER, STRING_LIST, CheckedConfig, CheckpointError, check_divisible,
                     check_heads, check_unquantized_silu, require)
from .head import ScaledLMHead
from .inkling_moe import InklingMLP, InklingMoE
from .kv_cache import KVCache
from .layers import QKV_PARAMS, DecoderLayer
from .registry import NO_QKV_LATENT, register_model
from .settings import setting

SLIDING, FULL = "hybrid_sliding", "hybrid"
HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim")
# transformers' InklingTextConfig defaults for the heads' fields a config.json leaves out
HEAD_DEFAULTS = {"num_key_value_heads": 8, "head_dim": 128, "swa_num_attention_heads": 64,
                 "swa_num_key_value_heads": 16, "swa_head_dim": 128}
# the names transformers reads as its own fields (its ``attribute_map``): where config.json
# sets both, the alias's value is the one read (each setting's names list the alias first)
ALIASES = {"sliding_window": "sliding_window_size", "num_local_experts": "n_routed_experts",
           "sconv_kernel_size": "conv_kernel_size",
           "embedding_multiplier": "logits_mup_width_multiplier"}


@dataclass(frozen=True)
class InklingConfig(CheckedConfig):
    """The decoder's sizes, each layer's kind (sliding, sparse), both attention kinds' heads,
    and the fields read as config.json gives them, with transformers' InklingTextConfig
    defaults (a null reads as left out, but an aliased field's)."""

    vocab_size: int = setting()
    hidden_size: int = setting()
    num_hidden_layers: int = setting()
    sliding: tuple = ()  # per layer: a sliding-window layer
    sparse: tuple = ()  # per layer: a MoE
    # full and sliding layers' attention: (heads, kv heads, head dim)
    full_heads: tuple = ()
    sliding_heads: tuple = ()
    intermediate_size: int = setting(24576)
    sliding_window_size: int = setting(512, POSITIVE_INT,
                                       names=("sliding_window", "sliding_window_size"))
    d_rel: int = setting(16, POSITIVE_INT)
    rel_extent: int = setting(1024, POSITIVE_INT)
    log_scaling_n_floor: int | None = setting(None, POSITIVE_INT)
    log_scaling_alpha: float = setting(0.1, POSITIVE_NUMBER)
    conv_kernel_size: int = setting(4, POSITIVE_INT,
                                    names=("sconv_kernel_size", "conv_kernel_size"))
    rms_norm_eps: float = setting(1e-6)
    moe_intermediate_size: int = setting(3072)
    n_routed_experts: int = setting(256, names=("num_local_experts", "n_routed_experts"))
    num_experts_per_tok: int = setting(6)
    n_shared_experts: int = setting(2)
    route_scale: float = setting(8.0, POSITIVE_NUMBER)
    logits_mup_width_multiplier: float = setting(
        24.0, POSITIVE_NUMBER, names=("embedding_multiplier", "logits_mup_width_multiplier"))
    model_type: str = "inkling_text"

    checks = {**DECODER, **EXPERTS,
              **{f: POSITIVE_INT for f in ("swa_num_attention_heads", "swa_num_key_value_heads",
                                           "swa_head_dim", "unpadded_vocab_size",
                                           "dense_intermediate_size")},
              "layer_types": STRING_LIST, "mlp_layer_types": STRING_LIST,
              "local_layer_ids": INT_LIST, "shared_expert_sink": BOOL,
              "dense_mlp_idx": NON_NEGATIVE_INT, "num_mtp_layers": NON_NEGATIVE_INT}
    expert_fields = ("num_local_experts", "n_routed_experts")  # the alias wins (ALIASES)
    top_k_fields = ("num_experts_per_tok",)

    def heads(self, layer: int) -> tuple:
        return self.sliding_heads if self.sliding[layer] else self.full_heads

    @classmethod
    def read(cls, raw: dict) -> dict:
        """A quantized checkpoint and an activation other than silu refused by name, a null
        dropped (transformers' default stands in) but an aliased field's (refused), the dense
        MLP's own size taken where config.json gives it, then the declared settings, each
        layer's kind and both attention kinds' heads; a padded head and an unsunk shared expert
        refused by name."""
        check_unquantized_silu(raw)
        cfg = {k: v for k, v in raw.items() if v is not None}
        for alias, name in ALIASES.items():
            for key in (alias, name):
                if key in raw and raw[key] is None:  # transformers: None, or its type check
                    raise CheckpointError(f"config.json field {key} is null: give a number, "
                                          f"or leave it out (it sets {name})")
        if "dense_intermediate_size" in cfg:  # as transformers' __post_init__: the experts'
            cfg["moe_intermediate_size"] = cfg.get("intermediate_size",
                                                   cls.default_of("intermediate_size"))
            cfg["intermediate_size"] = cfg["dense_intermediate_size"]
        values = super().read(cfg)
        vocab, unpadded = values["vocab_size"], cfg.get("unpadded_vocab_size")
        if unpadded is not None and unpadded < vocab:
            raise CheckpointError(f"config.json unpadded_vocab_size={unpadded} below "
                                  f"vocab_size={vocab} is not supported (a padded head)")
        if cfg.get("shared_expert_sink") is False:
            raise CheckpointError("config.json shared_expert_sink=false is not supported "
                                  "(transformers scores the shared experts with the routed)")
        layers, heads = values["num_hidden_layers"], {**HEAD_DEFAULTS, **cfg}
        return dict(values, sliding=_sliding(cfg, layers), sparse=_sparse(cfg, layers),
                    full_heads=(require(cfg, HEAD_FIELDS[0]),
                                *(heads[f] for f in HEAD_FIELDS[1:])),
                    sliding_heads=tuple(heads[f"swa_{f}"] for f in HEAD_FIELDS))


def _sliding(cfg: dict, layers: int) -> tuple:
    """Each layer's kind from ``layer_types``, else ``local_layer_ids``, else transformers'
    default (every layer but each sixth slides)."""
    types = cfg.get("layer_types")
    if types is None:
        ids = cfg.get("local_layer_ids")
        local = set(ids) if ids is not None else {i for i in range(layers) if (i + 1) % 6}
        return tuple(i in local for i in range(layers))
    if len(types) != layers or set(types) - {SLIDING, FULL}:
        raise CheckpointError(f"config.json layer_types must list num_hidden_layers={layers} "
                              f"entries of {SLIDING!r} or {FULL!r}, got {types}")
    return tuple(t == SLIDING for t in types)


def _sparse(cfg: dict, layers: int) -> tuple:
    """Each layer's FFN from ``mlp_layer_types``, else the first ``dense_mlp_idx`` dense."""
    types = cfg.get("mlp_layer_types")
    if types is None:
        dense = cfg.get("dense_mlp_idx") or 0
        return tuple(i >= dense for i in range(layers))
    if len(types) != layers or set(types) - {"dense", "sparse"}:
        raise CheckpointError(f"config.json mlp_layer_types must list num_hidden_layers="
                              f"{layers} entries of 'dense' or 'sparse', got {types}")
    return tuple(t == "sparse" for t in types)


def check_parallel(cfg: InklingConfig, dims) -> None:
    """Both attention kinds' heads over attention TP; the dense MLPs and the shared experts
    over TP, the routed experts over ``moe_ep x moe_tp``."""
    for sliding in set(cfg.sliding):
        heads, kv_heads, _ = cfg.sliding_heads if sliding else cfg.full_heads
        check_heads(heads, kv_heads, dims.attn_tp,
                    ("swa_num_attention_heads", "swa_num_key_value_heads") if sliding else
                    ("num_attention_heads", "num_key_value_heads"))
    if not all(cfg.sparse):
        check_divisible("intermediate_size", cfg.intermediate_size, "tp", dims.tp)
    if any(cfg.sparse):
        check_divisible("n_routed_experts", cfg.n_routed_experts, "moe_ep", dims.moe_ep)
        check_divisible("moe_intermediate_size", cfg.moe_intermediate_size, "moe_tp",
                        dims.moe_tp)
        check_divisible("moe_intermediate_size", cfg.moe_intermediate_size, "tp", dims.tp,
                        " (the shared experts)")


class RelativeLogits(nn.Module):
    """A bank of bias-by-distance profiles (``proj`` [d_rel, extent], replicated) that each
    query head's relative state mixes into one bias per backward distance."""

    def __init__(self, d_rel: int, extent: int, dtype) -> None:
        super().__init__()
        self.extent = extent
        self.proj = nn.Parameter(torch.empty(d_rel, extent, dtype=dtype), requires_grad=False)

    def forward(self, rel: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
        """rel [n, H, d_rel], distance [n, L] (query minus key position) -> [H, n, L]."""
        profiles = (rel @ self.proj).transpose(0, 1)  # [H, n, extent]
        index = distance.clamp(0, self.extent - 1).expand(profiles.shape[0], -1, -1)
        bias = profiles.gather(-1, index)
        return bias.masked_fill((distance < 0) | (distance >= self.extent), 0.0)


def _kv_loader(rank: int, replicas: int, size: int, full: int):
    """This rank's ``size`` kv channels (of ``full``) of a k/v convolution weight: its kv
    heads', or those of the one it replicates."""

    def load(param, loaded):
        expect_shape(loaded, full, *param.shape[1:])
        param.data.copy_(loaded.narrow(0, (rank // replicas) * size, size))

    return load


class InklingAttention(nn.Module):
    """The attention of layer ``index`` (full or sliding): PARTIAL, ``o_proj`` never
    reduces. Its k/v convolutions' windows are in the cache's ``ShortConvState``."""

    def __init__(self, cfg: InklingConfig, index: int, runtime: BoundaryRuntime, dtype):
        super().__init__()
        group = runtime.parallel.attn_tp_group
        heads, kv_heads, self.head_dim = cfg.heads(index)
        self.index, self.sliding = index, cfg.sliding[index]
        self.window = cfg.sliding_window_size if self.sliding else None
        d, hd = cfg.hidden_size, self.head_dim
        self.qkv_proj = QKVParallelLinear(d, hd, heads, kv_heads, group, dtype=dtype)
        self.r_proj = ColumnParallelLinear(d, heads * cfg.d_rel, group, dtype=dtype,
                                           name="r_proj")
        self.o_proj = RowParallelLinear(heads * hd, d, group, reduce_results=False, dtype=dtype,
                                        name="o_proj")
        kv_size, replicas = self.qkv_proj.kv_size, self.qkv_proj.kv_replicas
        self.k_sconv = ShortConv(kv_size, cfg.conv_kernel_size)
        self.v_sconv = ShortConv(kv_size, cfg.conv_kernel_size)
        for conv in (self.k_sconv, self.v_sconv):
            conv.conv1d.weight.weight_loader = _kv_loader(group.rank, replicas, kv_size,
                                                          kv_heads * hd)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)
        self.rel_logits_proj = RelativeLogits(
            cfg.d_rel, self.window if self.sliding else cfg.rel_extent, dtype)
        self.scaling = 1.0 / hd  # q and k are normalized: 1/d, not 1/sqrt(d)
        self.log_floor = None if self.sliding else cfg.log_scaling_n_floor
        self.log_alpha = cfg.log_scaling_alpha

    def forward(self, positions, x, forward_batch):
        """x: [T, hidden] (this DP rank's rows) -> [T, hidden], this rank's partial."""
        tokens = x.shape[0]
        heads, kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # local
        q, k, v = self.qkv_proj(x).split([self.qkv_proj.q_size, self.qkv_proj.kv_size,
                                          self.qkv_proj.kv_size], dim=-1)
        k = self.k_sconv(k, state_of(forward_batch, f"layer{self.index}.k_sconv"), forward_batch)
        v = self.v_sconv(v, state_of(forward_batch, f"layer{self.index}.v_sconv"), forward_batch)
        q = self.q_norm(q.view(tokens, heads, self.head_dim))  # [T, H, D]
        k = self.k_norm(k.view(tokens, kv_heads, self.head_dim))  # [T, KVH, D]
        v = v.view(tokens, kv_heads, self.head_dim)
        rel = self.r_proj(x).view(tokens, heads, -1)  # [T, H, d_rel]
        out = torch.empty_like(q)
        cache = forward_batch.kv_cache
        for r in forward_batch.requests():
            slot, prefix, n, start, end = r.slot, r.prefix, r.extend, r.start, r.end
            if prefix + n > cache.max_len:
                raise ValueError(f"request in slot {slot} needs {prefix + n} cache rows; the "
                                 f"cache holds {cache.max_len}")
            cache.k[self.index][slot, :, prefix:prefix + n] = k[start:end].transpose(0, 1)
            cache.v[self.index][slot, :, prefix:prefix + n] = v[start:end].transpose(0, 1)
            out[start:end] = self._request(q[start:end], rel[start:end], slot, prefix, cache)
        return self.o_proj(out.flatten(1))  # [T, H*D] -> [T, hidden]

    def _request(self, q, rel, slot: int, prefix: int, cache) -> torch.Tensor:
        """One request's queries [n, H, D] over its cached keys (those its window keeps)."""
        n, heads = q.shape[0], q.shape[1]
        first = 0 if self.window is None else max(0, prefix - self.window + 1)
        keys = cache.k[self.index][slot, :, first:prefix + n]  # [KVH, L, D]
        values = cache.v[self.index][slot, :, first:prefix + n]
        groups = heads // keys.shape[0]
        keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
        query_pos = torch.arange(prefix, prefix + n, device=q.device)
        distance = query_pos[:, None] - torch.arange(first, prefix + n, device=q.device)
        bias = self.rel_logits_proj(rel, distance)  # [H, n, L]
        if self.log_floor is not None:  # in fp32, as transformers
            tau = 1.0 + self.log_alpha * torch.log(
                ((query_pos + 1).float() / self.log_floor).clamp(min=1.0))
            q = (q.float() * tau[:, None, None]).to(q.dtype)
            bias = (bias.float() * tau[None, :, None]).to(bias.dtype)
        scores = torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * self.scaling + bias
        seen = distance >= 0
        if self.window is not None:
            seen = seen & (distance < self.window)
        scores = scores.masked_fill(~seen, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, values).transpose(0, 1)  # [H, n, D] -> [n, H, D]


class InklingDecoderLayer(DecoderLayer):
    """Attention, then the dense MLP or the MoE, each producer's output through its short
    convolution into the residual (each update is handed the forward batch it runs in; the
    library folds the last layer's in where the stack or a pipeline stage leaves)."""

    def __init__(self, cfg: InklingConfig, layer_id: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = InklingAttention(cfg, layer_id, runtime, dtype)
        self.mlp = (InklingMoE if cfg.sparse[layer_id] else InklingMLP)(cfg, runtime, dtype)
        self.attn_sconv = ShortConv(cfg.hidden_size, cfg.conv_kernel_size)
        self.mlp_sconv = ShortConv(cfg.hidden_size, cfg.conv_kernel_size)
        self.connect(cfg, layer_id, runtime, fusions=fusions, name=f"layer{layer_id}")

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        """The attention (PARTIAL), then the FFN (a dispatching MoE where the runtime asks),
        each with its short convolution as the residual update."""
        sparse = cfg.sparse[index]
        following = index + 1
        return (declare_attn(update=ShortConvUpdate.of(layer, "attn_sconv", index)),
                declare_ffn(sparse=sparse, dispatches=sparse and runtime.dispatches_moe,
                            next_sparse=(cfg.sparse[following]
                                         if following < cfg.num_hidden_layers else None),
                            update=ShortConvUpdate.of(layer, "mlp_sconv", index)))


class NormedEmbedding(VocabParallelEmbedding):
    """The token embedding, then its RMSNorm (``embed_norm``, of epsilon ``eps``)."""

    def __init__(self, *args, eps: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.embed_norm = RMSNorm(self.weight.shape[1], eps, dtype=self.weight.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(super().forward(input_ids))


class InklingCache(KVCache):
    """What ``forward_batch.kv_cache`` holds for Inkling: per layer, k and v [slots, local kv
    heads, positions, head dim] (its own head counts and dim: full or sliding; a sliding
    layer keeps every position too, its mask hides the older ones), and every short
    convolution's windows (``short_conv``: the k/v convolutions' and the residual's)."""

    def __init__(self, kv: KVCache, attention, slots: int, kernel: int, hidden: int,
                 device) -> None:
        self.k, self.v, self.max_len = kv.k, kv.v, kv.max_len
        channels = {}
        for a in attention:
            channels.update({f"layer{a.index}.k_sconv": a.qkv_proj.kv_size,
                             f"layer{a.index}.v_sconv": a.qkv_proj.kv_size,
                             f"layer{a.index}.attn_sconv": hidden,
                             f"layer{a.index}.mlp_sconv": hidden})
        self.short_conv = ShortConvState(slots, channels, kernel, device=device)

    @property
    def positional(self) -> bool:
        return False  # the windows hold every token seen, rejected ones too

    @property
    def padded_batches(self) -> bool:
        return False  # a convolution runs along each request's own tokens

    def snapshot(self):
        return self.short_conv.snapshot()

    def restore(self, snapshot) -> None:
        self.short_conv.restore(snapshot)


NO_CP = ("its short convolutions run along each request's tokens in order, and a CP rank "
         "holds a share of them")
NO_SP = ("its short convolutions need each DP rank's complete outputs on its own token rows, "
         "not scattered ones")


@register_model("inkling_text", InklingConfig, architectures=("InklingForCausalLM",),
                check_parallel=check_parallel,
                # every boundary completes onto the DP rank's rows: a scatter gains nothing
                boundary_reduction="ar",
                positional_cache=False,  # its convolution windows fold every token in
                context_parallel=NO_CP, sequence_parallel=NO_SP,
                attn_input_scattered=NO_QKV_LATENT, moe_a2a=True,
                batch_invariant=True)
class InklingForCausalLM(CausalLM):
    """Inkling (text): a normed embedding, short convolutions as residual updates and on k/v,
    relative-bias attention, dense and MoE layers, a head divided by its muP multiplier."""

    layer_cls = InklingDecoderLayer
    transformers_names = (MLP_ROUTER,)  # its router is no nn.Linear

    def make_embedding(self, cfg, runtime, dtype) -> NormedEmbedding:
        return vocab_embedding(cfg, runtime, dtype, NormedEmbedding, eps=cfg.rms_norm_eps)

    def make_head(self, cfg, runtime, dtype) -> ScaledLMHead:
        return vocab_embedding(cfg, runtime, dtype, ScaledLMHead,
                               divisor=float(cfg.logits_mup_width_multiplier))

    def ties_head(self) -> bool:
        return False  # embed and unembed are separate tensors in every checkpoint

    def cache_state(self, kv: KVCache, slots: int, max_len: int) -> InklingCache:
        """Every short convolution's windows beside the k/v (each layer's own head counts
        and dim: full or sliding; a sliding layer keeps every position too)."""
        cfg = self.config
        return InklingCache(kv, [layer.self_attn for layer in self.model.layers], slots,
                            cfg.conv_kernel_size, cfg.hidden_size, self.device)

    def stacked_params(self) -> list:
        out = list(QKV_PARAMS)
        if any(self.config.sparse):
            out += [("experts.w13", "experts.gate_up_proj", "gate_up"),
                    ("experts.w2", "experts.down_proj", "down")]
        return out

    def skipped_params(self) -> tuple:
        return ("model.mtp.",)  # multi-token-prediction layers (transformers ignores them too)

    def local_name(self, name: str) -> str | None:
        if name.startswith("model.embed_tokens.embed_norm.") and not self.stage.first:
            return None  # the embedding's norm lives with it, on the first stage
        return super().local_name(name)
