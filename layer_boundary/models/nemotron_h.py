"""NVIDIA Nemotron-H (hybrid Mamba2 / attention / MLP / MoE) with layer boundaries.

Every entry of ``layers_block_type`` is one block, ``x + mixer(norm(x))``, and one stage:
Mamba2 (``linear_attention``) and attention (``full_attention``) are single-stage mixers
(``declare_attn(reduction=SCOPED, gathers_tp_input=False)``) on this attention-DP rank's local
rows, the MLP (``mlp``) and the MoE (``moe``) are FFNs (``declare_ffn``) on every DP rank's rows.
Each block appends its one stage to the layer stack, which gives it its real neighbours, so
two consecutive mixers or FFNs hand over directly.

Compute is plain PyTorch; parameter names follow the checkpoint (``backbone.`` prefix,
``backbone.layers.N.mixer.*``), except q/k/v, stacked into ``qkv_proj``, and the routed experts,
fused per rank (``experts.w13``/``experts.w2``) at load time.

Parallelism: Mamba2 heads over attention TP (see ``mamba2.py``); attention heads over
attention TP (kv heads split or replicated), no rotary embedding (Nemotron-H attention has
none); both reduce in ``out_proj``/``o_proj`` unless the exit takes the sum. MLP intermediate
over TP. MoE: a replicated fp32 sigmoid router with correction bias (the DeepSeek-V3 router),
ungated relu2 experts over ``moe_ep x moe_tp`` and a TP-sharded shared expert whose partial
rides on the routed experts' one reduction. ``moe_latent_size`` is not supported (rejected).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .. import ProducerReduction, append_stages, declare_attn, declare_ffn
from ..runtime import (BoundaryRuntime, ColumnParallelLinear, RMSNorm,
                       RowParallelLinear)
from ..runtime.hf_names import NotLinear, Rename, StackExperts
from .base import CausalLM
from .config import (BOOL, DECODER, FINITE_NUMBER, POSITIVE_INT, POSITIVE_NUMBER, CheckedConfig,
                     CheckpointError, check_grouped_router, check_heads)
from .deepseek_v3 import DeepseekV3Router
from .kv_cache import CacheLayout, KVCache
from .layers import QKV_PARAMS, GqaAttention
from .mamba2 import Mamba2Mixer, MambaState, group_split
from .moe import ACTIVATIONS, UNSHARDED, FusedMoE, expert_stacked_params
from .registry import NO_QKV_LATENT, register_model
from .settings import AS_MANY_AS_HEADS, NULL_IS_FALSE, PER_HEAD, Null, setting

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
BLOCK_TYPES = (MAMBA, ATTENTION, MLP, MOE)
MIXERS = (MAMBA, ATTENTION)
# older configs: the pattern string and the legacy block names (transformers remaps both)
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
LEGACY_NAMES = {"mamba": MAMBA, "attention": ATTENTION}
# older configs' field names for the Mamba fields (transformers' __post_init__ renames them)
LEGACY_FIELDS = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel",
                 "mamba_chunk_size": "chunk_size", "mamba_conv_bias": "use_conv_bias",
                 "mamba_dt_min": "time_step_min"}


def _block_types(cfg: dict) -> tuple[str, ...]:
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    field = "layers_block_type"
    if types is None and cfg.get("hybrid_override_pattern"):
        pattern, field = cfg["hybrid_override_pattern"], "hybrid_override_pattern"
        bad = sorted(set(pattern) - set(PATTERN))
        if bad:
            raise CheckpointError(f"config.json hybrid_override_pattern has unknown symbols {bad}")
        types = [PATTERN[c] for c in pattern]
    if not types or not isinstance(types, list):
        raise CheckpointError("config.json has no layers_block_type (nor hybrid_override_pattern)")
    types = tuple(LEGACY_NAMES.get(t, t) for t in types)
    bad = sorted(set(types) - set(BLOCK_TYPES))
    if bad:
        raise CheckpointError(f"config.json {field} has unsupported block types {bad} "
                              f"(supported: {', '.join(BLOCK_TYPES)})")
    return types


@dataclass(frozen=True)
class NemotronHConfig(CheckedConfig):
    """The decoder's sizes, each block's kind and the fields of each kind the config has
    (``BLOCK_FIELDS``; a kind's fields where it has none are unread: their ``unread``
    values), with transformers' defaults."""

    vocab_size: int = setting()
    hidden_size: int = setting()
    layers_block_type: tuple[str, ...] = ()
    num_attention_heads: int = setting(unread=1)
    num_key_value_heads: int = setting(derive=AS_MANY_AS_HEADS, unread=1)
    head_dim: int = setting(derive=PER_HEAD, unread=1)
    intermediate_size: int = setting(unread=1)
    mamba_num_heads: int = setting(check=POSITIVE_INT, unread=1)
    mamba_head_dim: int = setting(check=POSITIVE_INT, unread=1)
    n_groups: int = setting(check=POSITIVE_INT, unread=1)
    ssm_state_size: int = setting(check=POSITIVE_INT, unread=1)
    conv_kernel: int = setting(4, POSITIVE_INT)
    chunk_size: int = setting(128, POSITIVE_INT)
    # transformers clamps prefill time steps at (min, inf)
    time_step_min: float = setting(0.001, FINITE_NUMBER)
    # a null (only legacy mamba_conv_bias's: NOT_NULL) reads as transformers' Conv1d(bias=None)
    use_conv_bias: bool = setting(True, BOOL, null=Null.DERIVE, derive=NULL_IS_FALSE)
    use_bias: bool = setting(False, BOOL)  # Mamba in_proj / out_proj
    mlp_bias: bool = setting(False, BOOL)
    mlp_hidden_act: str = "relu2"
    n_routed_experts: int = setting(unread=0)
    num_experts_per_tok: int = setting(unread=0)
    moe_intermediate_size: int = setting(unread=0)
    moe_shared_expert_intermediate_size: int = setting(check=POSITIVE_INT, unread=0)
    n_group: int = setting(1)
    topk_group: int = setting(1)
    routed_scaling_factor: float = setting(1.0, POSITIVE_NUMBER)
    norm_topk_prob: bool = setting(True, BOOL, null=Null.DERIVE, derive=NULL_IS_FALSE)
    layer_norm_epsilon: float = setting(1e-5)
    tie_word_embeddings: bool = setting(False)
    model_type: str = "nemotron_h"

    checks = DECODER
    expert_fields, top_k_fields = ("n_routed_experts",), ("num_experts_per_tok",)

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layers_block_type)

    @property
    def rms_norm_eps(self) -> float:  # what the shared skeleton's final norm reads
        return self.layer_norm_epsilon

    def has(self, kind: str) -> bool:
        return kind in self.layers_block_type

    @classmethod
    def read(cls, cfg: dict) -> dict:
        """The legacy field names renamed, each block's kind, what the model does not compute
        refused by name (latent experts, a quantized checkpoint, a window, an activation),
        then the declared settings of the kinds the config has and their agreement (Mamba's
        heads over its groups, the grouped router)."""
        cfg = dict(cfg)
        for old, new in LEGACY_FIELDS.items():
            if old in cfg:
                cfg[new] = cfg.pop(old)
        types = _block_types(cfg)
        if cfg.get("moe_latent_size") is not None:
            raise CheckpointError(f"config.json moe_latent_size={cfg['moe_latent_size']} is not "
                                  "supported (experts on the hidden size only)")
        if cfg.get("quantization_config"):
            raise CheckpointError("config.json quantization_config is not supported (unquantized "
                                  "checkpoints only)")
        if cfg.get("sliding_window") is not None:
            raise CheckpointError(f"config.json sliding_window={cfg['sliding_window']} is not "
                                  "supported (full attention only)")
        for field, default, supported in (("mamba_hidden_act", "silu", ("silu",)),
                                          ("mlp_hidden_act", "relu2", tuple(ACTIVATIONS))):
            act = cfg.get(field, default)
            if act not in supported:
                raise CheckpointError(f"config.json {field} {act!r} is not supported "
                                      f"({', '.join(supported)} only)")
        unread = {f for kinds, fields in BLOCK_FIELDS.items() if not set(kinds) & set(types)
                  for f in fields}
        values = super().read(cfg, unread=frozenset(unread))
        if MAMBA in types and values["mamba_num_heads"] % values["n_groups"]:
            raise CheckpointError(f"config.json mamba_num_heads={values['mamba_num_heads']} is "
                                  f"not divisible by n_groups={values['n_groups']}")
        if MOE in types:
            check_grouped_router(*(values[f] for f in ("n_routed_experts", "n_group",
                                                       "topk_group", "num_experts_per_tok")))
        return dict(values, layers_block_type=types,
                    mlp_hidden_act=cfg.get("mlp_hidden_act", cls.default_of("mlp_hidden_act")))


# the fields read where the config has blocks of one of the kinds
BLOCK_FIELDS = {
    (ATTENTION,): ("num_attention_heads", "num_key_value_heads", "head_dim"),
    (MAMBA,): ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel",
               "chunk_size", "time_step_min", "use_conv_bias", "use_bias"),
    (MLP,): ("intermediate_size",),
    (MOE,): ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
             "moe_shared_expert_intermediate_size", "n_group", "topk_group",
             "routed_scaling_factor", "norm_topk_prob"),
    (MLP, MOE): ("mlp_bias",),
}


def check_parallel(cfg: NemotronHConfig, dims) -> None:
    """Reject a topology this config cannot be sharded over, naming the config field."""
    attn_tp, tp = dims.attn_tp, dims.tp
    if cfg.has(ATTENTION):
        check_heads(cfg.num_attention_heads, cfg.num_key_value_heads, attn_tp)
    if cfg.has(MAMBA):
        group_split(cfg.n_groups, cfg.mamba_num_heads, attn_tp)  # names the fields
    if cfg.has(MLP) and cfg.intermediate_size % tp:
        raise ValueError(f"intermediate_size={cfg.intermediate_size} is not divisible by tp={tp}")
    if cfg.has(MOE):
        if cfg.n_routed_experts % dims.moe_ep:
            raise ValueError(f"n_routed_experts={cfg.n_routed_experts} is not divisible by "
                             f"moe_ep={dims.moe_ep}")
        if cfg.moe_intermediate_size % dims.moe_tp:
            raise ValueError(f"moe_intermediate_size={cfg.moe_intermediate_size} is not "
                             f"divisible by moe_tp={dims.moe_tp}")
        if cfg.moe_shared_expert_intermediate_size % tp:
            raise ValueError("moe_shared_expert_intermediate_size="
                             f"{cfg.moe_shared_expert_intermediate_size} is not divisible by "
                             f"tp={tp}")


def block_declaration(cfg: NemotronHConfig, i: int, runtime: BoundaryRuntime):
    """Block ``i``'s declaration; its neighbours describe it with this same call."""
    kind = cfg.layers_block_type[i]
    if kind in MIXERS:
        return declare_attn(reduction=ProducerReduction.SCOPED, gathers_tp_input=False,
                            mixer="mamba2" if kind == MAMBA else None)
    return declare_ffn(sparse=kind == MOE, dispatches=kind == MOE and runtime.dispatches_moe)


def NemotronHAttention(cfg: NemotronHConfig, index: int, runtime: BoundaryRuntime, dtype):
    """Causal GQA without rotary embedding; heads over attention TP; ``index`` is its KV slot;
    SCOPED: ``o_proj`` reduces unless the exit leaves the attention-TP sum to the boundary."""
    return GqaAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                        cfg.head_dim, index, runtime, dtype, partial=False)


class NemotronHMLP(nn.Module):
    """``down(act(up(x)))`` (ungated, relu2) with its intermediate dim over the TP group."""

    def __init__(self, cfg: NemotronHConfig, intermediate_size: int, runtime: BoundaryRuntime,
                 dtype, reduce_results: bool = True, group=None):
        super().__init__()
        group = group if group is not None else runtime.parallel.tp_group
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, intermediate_size, group,
                                            bias=cfg.mlp_bias, dtype=dtype, name="up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, cfg.hidden_size, group,
                                           bias=cfg.mlp_bias, reduce_results=reduce_results,
                                           dtype=dtype, name="down_proj")
        self.act = ACTIVATIONS[cfg.mlp_hidden_act]

    def forward(self, x, forward_batch=None):
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronHMoE(nn.Module):
    def __init__(self, cfg: NemotronHConfig, runtime: BoundaryRuntime, dtype):
        super().__init__()
        # transformers' NemotronHTopkRouter is DeepSeek-V3's: sigmoid scores, correction bias
        # for the choice only, group-limited top-k, normalised, times routed_scaling_factor
        self.gate = DeepseekV3Router(cfg)
        self.experts = FusedMoE(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                runtime.parallel, dtype, gated=False, activation=cfg.mlp_hidden_act,
                                dispatch=runtime.dispatches_moe)
        # beside dispatched experts: whole, on this rank's own rows
        self.shared_experts = NemotronHMLP(cfg, cfg.moe_shared_expert_intermediate_size, runtime,
                                           dtype, reduce_results=False,
                                           group=UNSHARDED if runtime.dispatches_moe else None)

    def forward(self, x, forward_batch=None):
        """x: [T, H] (every DP rank's rows): a partial over TP, a finalize handoff or the
        complete output, as the exit's flags ask; the shared expert shares the one sum."""
        topk_weights, topk_ids = self.gate(x)
        shared = self.shared_experts(x)
        return self.experts(x, topk_ids, topk_weights, shared_output=shared)


class NemotronHBlock(nn.Module):
    """``x + mixer(norm(x))``: one stage; the mixer's ``index`` is its slot among the blocks
    of its kind (its KV cache or Mamba state)."""

    def __init__(self, cfg: NemotronHConfig, i: int, runtime: BoundaryRuntime, dtype,
                 fusions=None):
        super().__init__()
        self.kind = cfg.layers_block_type[i]
        index = cfg.layers_block_type[:i].count(self.kind)
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype=dtype)
        if self.kind == MAMBA:
            self.mixer = Mamba2Mixer(cfg, index, runtime, dtype)
        elif self.kind == ATTENTION:
            self.mixer = NemotronHAttention(cfg, index, runtime, dtype)
        elif self.kind == MLP:
            self.mixer = NemotronHMLP(cfg, cfg.intermediate_size, runtime, dtype)
        else:
            self.mixer = NemotronHMoE(cfg, runtime, dtype)
        options = {} if fusions is None else {"fusions": fusions}
        (decl,) = self.declarations(cfg, i, runtime)
        (self.boundary,) = append_stages((decl, self.norm, options), name=f"layer{i}")

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        """The block's one stage (``block_declaration``)."""
        return (block_declaration(cfg, index, runtime),)

    def stage_compute(self) -> list:
        """(stage, compute module name) of the block's stage."""
        return [(self.boundary, "mixer")]

    def forward(self, positions, hidden_states, forward_batch):
        hidden_states = self.boundary.prepare(hidden_states, forward_batch)
        with self.boundary.exit(forward_batch) as output:  # compute only
            if self.kind == ATTENTION:
                hidden_states = self.mixer(positions, hidden_states, forward_batch)
            else:
                hidden_states = self.mixer(hidden_states, forward_batch)
        return output.finish(hidden_states)


class HybridCache(KVCache):
    """What ``forward_batch.kv_cache`` holds for Nemotron-H: per request slot, the attention
    layers' k/v (``KVCache``) and the Mamba layers' conv and SSM states (``MambaState``)."""

    def __init__(self, kv: KVCache, mamba: MambaState) -> None:
        self.k, self.v, self.max_len = kv.k, kv.v, kv.max_len
        self.conv, self.ssm = mamba.conv, mamba.ssm

    @property
    def positional(self) -> bool:
        return not self.conv  # the Mamba states hold every token seen, rejected ones too

    @property
    def padded_batches(self) -> bool:
        return not self.conv  # a Mamba layer scans each request's own tokens in order

    def snapshot(self):
        if self.positional:
            return None
        return ({i: t.clone() for i, t in self.conv.items()},
                {i: t.clone() for i, t in self.ssm.items()})

    def restore(self, snapshot) -> None:
        if snapshot is None:
            return
        for saved, live in zip(snapshot, (self.conv, self.ssm)):
            for i, t in saved.items():
                live[i].copy_(t)


# on-disk names (transformers' NemotronH: ``backbone.``) -> the shared skeleton's
_ON_DISK = (("backbone.embeddings.", "model.embed_tokens."), ("backbone.layers.", "model.layers."),
            ("backbone.norm_f.", "model.norm."))


NO_CP = "a Mamba2 state cannot be cut over CP ranks (no state handoff)"
NO_SP = ("its Mamba2 mixers consume their own rows, not column- and row-parallel linears on "
         "gathered ones")


@register_model("nemotron_h", NemotronHConfig, architectures=("NemotronHForCausalLM",),
                check_parallel=check_parallel, moe_a2a=True,
                context_parallel=NO_CP, sequence_parallel=NO_SP, boundary_reduction="rs+rsv",
                positional_cache=False,  # its Mamba states fold every token in
                attn_input_scattered=NO_QKV_LATENT,
                batch_invariant=True)
class NemotronHForCausalLM(CausalLM):
    """Nemotron-H: Mamba2, attention, MLP and MoE blocks in the order ``layers_block_type``
    gives, one stage each."""

    layer_cls = NemotronHBlock
    # transformers' nemotron_h conversion: backbone is model, each layer's experts' up_proj
    # and down_proj stacked; the router (mixer.gate) is no nn.Linear
    transformers_names = (Rename(r"^backbone\.", "model."), StackExperts(("up_proj",), "up_proj"),
                          StackExperts(("down_proj",), "down_proj"), NotLinear(r".*\.mixer\.gate"))

    def ties_head(self) -> bool:
        # transformers' Nemotron-H declares no tied weights: it saves and loads lm_head.weight
        # on its own even under tie_word_embeddings (load_weights reads the embedding as the
        # head only where the checkpoint has none)
        return False

    def cache_layout(self) -> CacheLayout:
        """The attention blocks' k/v, by their index among the blocks of their kind."""
        return CacheLayout.of(b.mixer for b in self.model.layers if b.kind == ATTENTION)

    def cache_state(self, kv: KVCache, slots: int, max_len: int) -> HybridCache:
        """The Mamba blocks' states beside the k/v, by their index among the blocks of their
        kind."""
        cfg = self.config
        mamba = [layer.mixer for layer in self.model.layers if layer.kind == MAMBA]
        m = mamba[0] if mamba else None
        state = MambaState([x.index for x in mamba], slots, m.conv_channels if m else 0,
                           cfg.conv_kernel, m.heads if m else 0, cfg.mamba_head_dim,
                           cfg.ssm_state_size, self.dtype, device=self.device)
        return HybridCache(kv, state)

    def stacked_params(self) -> list:
        cfg = self.config
        out = []
        if cfg.has(ATTENTION):
            out += QKV_PARAMS
        if cfg.has(MOE):
            out += expert_stacked_params(cfg.n_routed_experts, gated=False)
        return out

    def skipped_params(self) -> tuple:
        # multi-token-prediction layers are stored under mtp.* (transformers ignores them too)
        return ("mtp.",)

    def checkpoint_name(self, name: str) -> str | None:
        for disk, ours in _ON_DISK:
            if name.startswith(disk):
                return ours + name[len(disk):]
        return name

    def load_weights(self, weights) -> None:
        super().load_weights(self._with_head(weights))

    def _with_head(self, weights):
        """The checkpoint's tensors; a tied checkpoint without lm_head.weight reads the
        embedding as the head."""
        embedding, head = None, False
        for name, tensor in weights:
            head |= name == "lm_head.weight"
            if name == "backbone.embeddings.weight":
                embedding = tensor
            yield name, tensor
        if not head and self.config.tie_word_embeddings and embedding is not None:
            yield "lm_head.weight", embedding
