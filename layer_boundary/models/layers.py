"""The blocks several architectures share: grouped-query attention, the gated (SwiGLU) MLP,
and the decoder layer of an attention stage followed by an FFN stage.

A model file composes these with its own config; what differs between architectures (a
per-head q/k norm, the rotary frequencies, biases, whether the output projection reduces) is
an argument, not a copy.

A layer's stages are declared by one function, ``declarations(cfg, index, runtime)``: the
layer appends what it returns to the open layer stack, and the model asks it for the layers
on other pipeline ranks (``pipeline.pipeline_stack``), so neighbours have one source of truth.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import PostNormAdd, append_stages, cp_view, declare_attn, declare_ffn
from ..runtime.args import BoundaryRuntime
from ..runtime.context import sequence_parallel_scope
from ..runtime.linear import (ColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                              expect_shape)
from ..runtime.norm import HeadsRMSNorm, RMSNorm
from .attention import cached_attention
from .rope import apply_rope, forward_cos_sin, rope_key, rotate_half


# a checkpoint's q, k and v projections, loaded stacked into ``GqaAttention.qkv_proj``
# (``CausalLM.stacked_params``)
QKV_PARAMS = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
              ("qkv_proj", "v_proj", "v"))


class GqaAttention(nn.Module):
    """Grouped-query attention with q/k/v projected together (``qkv_proj``, heads over
    attention TP; kv heads split, or replicated over whole ranks) and ``o_proj``.

    Args:
        hidden_size, num_heads, num_kv_heads, head_dim: the shapes.
        index: its layer in the KV cache.
        runtime, dtype: where it runs.
        bias: biases on qkv_proj and o_proj (``attention_bias``).
        qk_norm_eps: a per-head RMSNorm on q and k (``q_norm``/``k_norm``, Qwen3) with this
            eps; None: none.
        qk_norm_width: the q/k norms span every head (OLMo-2's, MiniMax-M2's: ``HeadsRMSNorm``
            over the projected width, its squares summed over attention TP); "hf" rounds then
            scales (Llama's order), "fp32" scales in fp32 and rounds once (OLMo-2's); None:
            per head, as ``qk_norm_eps`` says.
        window: this layer's sliding attention window (None: every position).
        inv_freq: the rotary inverse frequencies [head_dim / 2] (None: no rotary embedding).
        partial: True for a PARTIAL stage (``o_proj`` never reduces: the boundary owns the
            attention-TP sum); False for a SCOPED mixer (``o_proj`` obeys the exit's flags).
        sinks: a learned logit per head joining the softmax (``sinks``, GPT-OSS's; fp32,
            this rank's heads' slice).
        rope_scale: cos and sin multiplied by it (YaRN's attention factor; 1: none).
        rotary_dim: the leading dims of each head that rotate (rotate-half form over them, the
            rest passed through: a partial rotary factor, GLM-4.5's); None: the whole head.
        o_bias: a bias on o_proj (None: as ``bias``; GLM-4.5 biases q/k/v only).
        qk_norm_cls: the per-head q/k norm's class (``RMSNorm``; ``GemmaRMSNorm``: Gemma-3's
            ``1 + w`` scaled in fp32).
        scaling: the softmax scale (None: ``head_dim ** -0.5``; Gemma-3's
            ``query_pre_attn_scalar ** -0.5``).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 index: int, runtime: BoundaryRuntime, dtype, *, bias: bool = False,
                 qk_norm_eps: float | None = None, inv_freq: torch.Tensor | None = None,
                 partial: bool = True, qk_norm_width: str | None = None,
                 window: int | None = None, sinks: bool = False,
                 rope_scale: float = 1.0, rotary_dim: int | None = None,
                 o_bias: bool | None = None, qk_norm_cls: type = RMSNorm,
                 scaling: float | None = None, interleaved: bool = False) -> None:
        super().__init__()
        group = runtime.parallel.attn_tp_group
        self.index, self.head_dim = index, head_dim
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, group,
                                          bias=bias, dtype=dtype)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, group,
                                        bias=bias if o_bias is None else o_bias,
                                        reduce_results=not partial, dtype=dtype, name="o_proj")
        self.window = window
        self.qk_norm_width = qk_norm_width is not None
        if self.qk_norm_width:
            fp32 = {"hf": False, "fp32": True}[qk_norm_width]
            self.q_norm = HeadsRMSNorm(num_heads, head_dim, group, qk_norm_eps,
                                       scale_fp32=fp32, dtype=dtype)
            self.k_norm = HeadsRMSNorm(num_kv_heads, head_dim, group, qk_norm_eps,
                                       replicas=self.qkv_proj.kv_replicas, scale_fp32=fp32,
                                       dtype=dtype)
        elif qk_norm_eps is not None:
            self.q_norm = qk_norm_cls(head_dim, qk_norm_eps, dtype=dtype)
            self.k_norm = qk_norm_cls(head_dim, qk_norm_eps, dtype=dtype)
        self.qk_norm = qk_norm_eps is not None and not self.qk_norm_width
        self.rotary = inv_freq is not None
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        # pairs (x0, x1), (x2, x3), ... rotate together (Cohere's rotary; ``apply_rope``)
        self.interleaved = interleaved
        if self.rotary:
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            self.rope_key = rope_key(inv_freq)
        self.scaling = head_dim ** -0.5 if scaling is None else scaling
        self.rope_scale, self.sinks = rope_scale, None
        if sinks:
            self.sinks = nn.Parameter(torch.empty(self.qkv_proj.num_heads, dtype=torch.float32),
                                      requires_grad=False)
            self.sinks.weight_loader = self._sinks_loader

    @classmethod
    def of(cls, cfg, index: int, runtime: BoundaryRuntime, dtype, **options) -> GqaAttention:
        """The attention of layer ``index`` of a config with a dense decoder's sizes
        (``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``);
        ``options``: the rest of the arguments."""
        return cls(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                   cfg.head_dim, index, runtime, dtype, **options)

    norm_rope = None  # a fusion provider's per-head norm + RoPE kernel (``take_fusions``)
    norm_rope_dtypes: tuple = ()

    def take_fusions(self, provider) -> None:
        """Take ``provider``'s fused per-head RMSNorm + rotate-half RoPE (``head_norm_rope``,
        the Triton provider's), where this attention computes exactly those: per-head
        ``RMSNorm`` q/k norms and a whole-head, non-interleaved rotary over a power-of-two
        head; else keep its own ops."""
        kernel = getattr(provider, "head_norm_rope", None)
        fits = (self.qk_norm and self.rotary and type(self.q_norm) is RMSNorm
                and type(self.k_norm) is RMSNorm and self.rotary_dim == self.head_dim
                and not self.interleaved and self.head_dim & (self.head_dim - 1) == 0)
        self.norm_rope = kernel if fits else None
        self.norm_rope_dtypes = getattr(provider, "kernel_dtypes", ()) if fits else ()

    def _sinks_loader(self, param, loaded: torch.Tensor) -> None:
        heads = self.qkv_proj.num_heads  # this rank's q heads, as qkv_proj takes them
        expect_shape(loaded, self.qkv_proj.total_heads)  # every head's sink
        param.data.copy_(loaded.narrow(0, self.qkv_proj.group.rank * heads, heads))

    def rope(self, x, cos, sin):
        """Rotary over x [T, H, D]'s first ``rotary_dim`` dims (cos/sin [T, rotary_dim], or
        [T, rotary_dim / 2] where the pairs interleave)."""
        if self.rotary_dim == self.head_dim:
            return apply_rope(x, cos, sin, True) if self.interleaved else rotate_half(x, cos, sin)
        rot, rest = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        rot = apply_rope(rot, cos, sin, True) if self.interleaved else rotate_half(rot, cos, sin)
        return torch.cat((rot, rest), dim=-1)

    def forward(self, positions, hidden_states, forward_batch):
        """hidden_states: the attention rows (in a CP batch this CP rank's share of the DP
        rank's tokens; in a sequence-parallel batch its scattered slice, which ``qkv_proj``
        gathers and ``o_proj`` reduce-scatters back); positions: every token's of the DP
        rank."""
        cp = cp_view(forward_batch)
        qkv = self.qkv_proj(hidden_states)  # on scattered rows: gathered to every token
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.qk_norm_width:  # over this rank's heads, squares summed over attention TP
            q, k = self.q_norm(q), self.k_norm(k)
        tokens = qkv.shape[0]
        heads, kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # local
        q = q.view(tokens, heads, self.head_dim)  # [T, H, D] (T may be 0: no -1 in views)
        k = k.view(tokens, kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(tokens, kv_heads, self.head_dim)
        fused = self.norm_rope is not None and q.dtype in self.norm_rope_dtypes
        if self.qk_norm and not fused:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:
            cos, sin = forward_cos_sin(forward_batch, self.rope_key, positions, self.inv_freq,
                                       q.dtype, None if cp is None else cp.share,
                                       full_width=not self.interleaved, scale=self.rope_scale)
            if fused:  # the provider's kernel: a head's norm and rope in one launch
                q = self.norm_rope(q, self.q_norm.weight, self.q_norm.eps, cos, sin)
                k = self.norm_rope(k, self.k_norm.weight, self.k_norm.eps, cos, sin)
            else:
                q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        if cp is not None:  # every token of the DP rank as keys and values, in token order
            k, v = cp.gather(torch.cat((k, v), dim=-1)).split(self.head_dim, dim=-1)
        out = cached_attention(self.index, q, k, v, forward_batch, self.scaling,
                               queries=None if cp is None else cp.queries, window=self.window,
                               sinks=self.sinks)
        return self.o_proj(out.flatten(1))  # [T, H*D] -> [T, hidden], a partial or a sum


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with its intermediate dim split over ``group``
    (default: the full TP group); ``down_proj`` obeys the exit's flags unless
    ``reduce_results=False`` (a partial that joins another sum)."""

    def __init__(self, hidden_size: int, intermediate_size: int, runtime: BoundaryRuntime,
                 dtype, *, bias: bool = False, reduce_results: bool = True, group=None) -> None:
        super().__init__()
        group = group if group is not None else runtime.parallel.tp_group
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, group, bias=bias,
                                              dtype=dtype, name="gate_proj")
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, group, bias=bias,
                                            dtype=dtype, name="up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, group, bias=bias,
                                           reduce_results=reduce_results, dtype=dtype,
                                           name="down_proj")

        self.silu_mul, self.silu_mul_dtypes = None, ()

    def take_fusions(self, provider) -> None:
        """Take ``provider``'s fused ``silu(gate) * up`` (``silu_mul``, the Triton
        provider's), one launch for the two ops, where this module computes through
        ``GatedMLP.forward`` (a subclass with its own forward, a GELU gate or a clamped
        SwiGLU, takes nothing it would not run); a provider without it leaves them as they
        are."""
        fits = type(self).forward is GatedMLP.forward
        self.silu_mul = getattr(provider, "silu_mul", None) if fits else None
        self.silu_mul_dtypes = getattr(provider, "kernel_dtypes", ()) if self.silu_mul else ()

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.silu_mul is not None and gate.dtype in self.silu_mul_dtypes and gate.dim() == 2:
            return self.down_proj(self.silu_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """An attention stage (``self_attn`` behind ``attn_boundary``, read through
    ``input_layernorm``) then an FFN stage (``mlp`` behind ``ffn_boundary``, read through
    ``post_attention_layernorm``). Subclasses build the compute, define ``declarations`` and
    call ``connect``; ``attend``/``feed_forward`` are the compute calls, overridable.
    ``input_norms=False``: the subclass makes the norms its stages read through
    (``read_norms``) itself (a post-norm model reads the residual as it is)."""

    attn_compute = "self_attn"  # the module computing the attention stage (its output checks)

    def __init__(self, hidden_size: int, eps: float, dtype, *, input_norms: bool = True) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        if input_norms:
            self.input_layernorm = RMSNorm(hidden_size, eps, dtype=dtype)
            self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype=dtype)

    def read_norms(self) -> tuple:
        """The norms the attention and the FFN stage read the residual through."""
        return self.input_layernorm, self.post_attention_layernorm

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        """Layer ``index``'s main-line stage declarations, in order: what it appends, and what
        its neighbours (on this pipeline rank or another) say of it.

        Args:
            cfg: the model's config.
            index: the layer's global index.
            runtime: the ``BoundaryRuntime`` (engine options such as expert dispatch).
            layer: the layer being built, whose per-layer objects (a hyper-connection, a
                post-norm) its declarations hold; None for a neighbour's declaration,
                where such objects never run (a neighbour's read runs on its own rank, and
                an update holding per-layer state is not portable across a cut).
        """
        raise NotImplementedError

    def connect(self, cfg, index: int, runtime: BoundaryRuntime, *, name: str, fusions=None,
                attn_options=None) -> None:
        """Append the layer's two stages to the open layer stack: ``declarations``' attention
        and FFN, each read through its norm of ``read_norms`` (the attention with
        ``attn_options``: a ``qkv_latent_func``). The stack supplies both neighbours."""
        attn, ffn = self.declarations(cfg, index, runtime, layer=self)
        options = {} if fusions is None else {"fusions": fusions}
        attn_norm, ffn_norm = self.read_norms()
        self.attn_boundary, self.ffn_boundary = append_stages(
            (attn, attn_norm, {**options, **(attn_options or {})}),
            (ffn, ffn_norm, options), name=name)

    def stage_compute(self) -> list:
        """(stage, compute module name) of each stage this layer holds."""
        return [(self.attn_boundary, self.attn_compute), (self.ffn_boundary, "mlp")]

    def attend(self, positions, hidden_states, forward_batch):
        # no rows on this rank: an empty contribution (in a CP batch the rank still joins
        # its DP rank's gather of keys and values; on scattered rows, its linears' gathers)
        if (hidden_states.shape[0] == 0 and cp_view(forward_batch) is None
                and sequence_parallel_scope() is None):
            return hidden_states.new_zeros((0, self.hidden_size))
        return self.self_attn(positions, hidden_states, forward_batch)

    def feed_forward(self, hidden_states, forward_batch):
        return self.mlp(hidden_states)

    def forward(self, positions, h, forward_batch):
        """The layer's two residual steps, each one ``run`` of its stage's boundary::

            h = h + self_attn(input_layernorm(h))
            h = h + mlp(post_attention_layernorm(h))

        ``run`` reads the residual through the stage's norm (``read_norms``), computes inside
        the stage's exit scope (in a sequence-parallel batch the scope lets the linears
        gather the scattered input and reduce-scatter the output) and adds the output by the
        stage's declared update: ``+`` is the plain add, a post norm's ``h + norm(out)``
        (OLMo-2) or a scaled ``h + m * out`` (Granite); a parallel block's FFN reads the
        residual its attention read (Cohere). ``h`` is what the stage before left: the
        residual, or an output whose sum is still owed (``OwedOutput``)."""
        h = self.attn_boundary.run(h, forward_batch, self.attend, positions)  # h + attn(norm h)
        return self.ffn_boundary.run(h, forward_batch, self.feed_forward)  # h + mlp(norm h)


class PostNormDecoderLayer(DecoderLayer):
    """A decoder layer whose producers add their output through their own post norms
    (``post_attention_layernorm``, ``post_feedforward_layernorm``: the post-norm residual kind,
    ``PostNormAdd``), read as the residual is (OLMo-2, EXAONE-4) unless a subclass names its
    input norms in ``read_norms`` (Gemma-3's sandwich). Subclasses build the compute and the
    two post norms, then call ``connect``."""

    def __init__(self, hidden_size: int, eps: float, dtype) -> None:
        super().__init__(hidden_size, eps, dtype, input_norms=False)

    def read_norms(self) -> tuple:
        return nn.Identity(), nn.Identity()  # the residual as it is

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        """Each producer's post norm is its residual update; both stages sequence-parallel
        (their linears move the rows; the post norm runs on whatever rows the output is)."""
        return (declare_attn(sequence_parallel=True, update=PostNormAdd.of(
                    layer, "post_attention_layernorm", index)),
                declare_ffn(sequence_parallel=True, update=PostNormAdd.of(
                    layer, "post_feedforward_layernorm", index)))
