"""``GenericCausalLM``: a transformers decoder on the layer boundaries. Each decoder layer is
transformers' own, cut into two stages: its attention and its MLP keep their modules (our
linears inside), its norms become the stages' reads and post-norm updates (``LayerForm``)."""

from __future__ import annotations

import contextvars

import torch
from torch import nn

from ... import PostNormAdd, declare_attn, declare_ffn
from ...capabilities import Feature
from ..base import CausalLM
from ..kv_cache import CacheLayout
from ..layers import DecoderLayer
from ..registry import NO_QKV_LATENT, declare_capabilities
from .attention import position_embeddings, takes_layer_type
from .build import make_ours, our_norm, rotary
from .meta import skeleton
from .config import COLWISE, GenericConfig
from .moe import checkpoint_weights, expert_stacked_params

# transformers' model (meta device) and its rotary module while a GenericCausalLM is built:
# its layers and final norm are taken from it (one object per build, never shared)
_BUILDING: contextvars.ContextVar = contextvars.ContextVar("generic_building")


class GenericDecoderLayer(DecoderLayer):
    """transformers' decoder layer ``layer_id`` as an attention stage and an FFN stage: its
    children (``self_attn``, ``mlp``, its norms) are this module's, named as the checkpoint
    names them."""

    def __init__(self, cfg: GenericConfig, layer_id: int, runtime, dtype, fusions=None):
        super().__init__(cfg.hidden_size, 0.0, dtype, input_norms=False)
        model, self.__dict__["rotary"] = _BUILDING.get()  # shared, not a child of each layer
        layer = model.model.layers[layer_id]
        self.form = cfg.forms[layer_id]
        for name in self.form.norms:  # ours where it computes the same: the fused add+norm read
            setattr(layer, name, our_norm(getattr(layer, name), dtype))
        make_ours(layer, f"layers.{layer_id}", cfg, runtime, dtype)
        for name, child in layer.named_children():
            setattr(self, name, child)
        types = getattr(cfg.hf, "layer_types", None)
        self.layer_type = (types[layer_id] if types and self.rotary is not None
                           and takes_layer_type(self.rotary) else None)
        self.connect(cfg, layer_id, runtime, fusions=fusions, name=f"layer{layer_id}")

    def read_norms(self) -> tuple:
        attn, ffn = self.form.attn_read, self.form.ffn_read
        return (getattr(self, attn) if attn else nn.Identity(),
                getattr(self, ffn) if ffn else nn.Identity())

    @classmethod
    def declarations(cls, cfg, index: int, runtime, layer=None) -> tuple:
        """The attention's sum over attention TP owed (PARTIAL), the MLP's obeying the exit;
        a post norm, where the layer has one, is the stage's residual update."""
        attn_post, ffn_post = cfg.forms[index].attn_post, cfg.forms[index].ffn_post
        return (declare_attn(update=PostNormAdd.of(layer, attn_post, index)
                             if attn_post else None),
                declare_ffn(update=PostNormAdd.of(layer, ffn_post, index)
                            if ffn_post else None))

    def attend(self, positions, hidden_states, forward_batch):
        if hidden_states.shape[0] == 0:  # no rows on this rank: an empty contribution
            return hidden_states.new_zeros((0, self.hidden_size))
        cos_sin = (None if self.rotary is None else
                   position_embeddings(self.rotary, forward_batch, self.layer_type,
                                       hidden_states.dtype))
        out, _ = self.self_attn(hidden_states=hidden_states[None], position_embeddings=cos_sin,
                                attention_mask=None, position_ids=forward_batch.positions[None],
                                forward_batch=forward_batch)
        return out[0]  # [1, T, hidden] -> [T, hidden]

    def feed_forward(self, hidden_states, forward_batch):
        # [T, hidden] as transformers' [1, T, hidden] (a MoE block reads batch and sequence)
        return self.mlp(hidden_states[None])[0]


def check_parallel(cfg: GenericConfig, dims) -> None:
    """Query heads over attention TP; kv heads split over it or replicated on whole ranks."""
    heads, kv, tp = cfg.num_attention_heads, cfg.num_key_value_heads, dims.attn_tp
    if heads % tp:
        raise ValueError(f"num_attention_heads ({heads}) is not divisible by the attention "
                         f"tensor-parallel size {tp}")
    if kv % tp and tp % kv:
        raise ValueError(f"num_key_value_heads ({kv}) neither divides nor is divisible by the "
                         f"attention tensor-parallel size {tp}")


def _final_norm(cfg: GenericConfig, dtype) -> nn.Module:
    norm = our_norm(_BUILDING.get()[0].model.norm, dtype)
    make_ours(norm, "norm", cfg, None, dtype)
    return norm


@declare_capabilities(boundary_reduction="rs+rsv", positional_cache=False,
                      check_parallel=check_parallel,
                      context_parallel="it runs transformers' attention modules on every "
                                       "token's queries (no CP share)",
                      sequence_parallel="it runs transformers' modules on every row of the "
                                        "batch, not on a scattered slice",
                      attn_input_scattered=NO_QKV_LATENT,
                      moe_a2a="it runs MoE experts over TP (no all-to-all dispatch)",
                      batch_invariant="it runs transformers' own ops, whose kernels follow "
                                      "the batch")
class GenericCausalLM(CausalLM):
    """Any transformers decoder ``GenericConfig`` accepts, on the layer boundaries."""

    model_type = "the transformers backend"  # what refusals call it (the checkpoint's
    # own model_type is ``config.model_type``)
    config_class = GenericConfig
    layer_cls = GenericDecoderLayer
    final_norm = staticmethod(_final_norm)
    impl = "transformers"
    # what this path does not serve, beyond the declared capabilities (the capability
    # table's refusal names each)
    refused_features = {
        Feature.LORA: "it attaches no adapters",
        Feature.FP8: "it loads unquantized checkpoints only",
        Feature.SPECULATIVE: "it serves no draft or NextN stack",
        Feature.COMPILE: "it runs transformers' modules eagerly",
        Feature.FUSIONS: "no fusion provider is proven on transformers' modules",
    }

    def __init__(self, cfg: GenericConfig, runtime, dtype=torch.float32, fusions=None):
        model = skeleton(cfg.hf)
        rope = rotary(model, cfg.hf, torch.get_default_device())
        token = _BUILDING.set((model, rope))
        try:
            super().__init__(cfg, runtime, dtype, fusions)
        finally:
            _BUILDING.reset(token)
        self.rotary_emb = rope  # its tables follow the model's device
        attn_tp = runtime.parallel.dims.attn_tp
        kv = cfg.num_key_value_heads
        if cfg.style("layers.0.self_attn.k_proj") != COLWISE:  # every head on every rank
            attn_tp = 1
        self._kv_heads = kv // attn_tp if kv % attn_tp == 0 else 1
        if cfg.embed_scale is not None and self.stage.first:
            # transformers' scaled embedding: the lookup times embed_scale in the weight dtype
            scale = torch.tensor(cfg.embed_scale, dtype=dtype)
            self.model.embed_tokens.register_forward_hook(
                lambda module, args, out: out * scale)

    def forward(self, forward_batch, pp_input=None, return_hidden: bool = False):
        out = super().forward(forward_batch, pp_input, return_hidden)
        cap = self.config.final_logit_softcapping
        if cap is None or not self.stage.last or out is None:
            return out
        logits, hidden = out if return_hidden else (out, None)
        logits = torch.tanh(logits / cap) * cap
        return (logits, hidden) if return_hidden else logits

    def stacked_params(self) -> list:
        return super().stacked_params() + expert_stacked_params(self)

    def load_weights(self, weights) -> None:
        super().load_weights(checkpoint_weights(weights, self))

    def cache_layout(self) -> CacheLayout:
        shape = (self._kv_heads, self.config.head_dim)  # every head where k_proj is replicated
        return CacheLayout(dict.fromkeys(self.stage.layers, shape))
