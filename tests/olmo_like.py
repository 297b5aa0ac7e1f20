"""An OLMo-2-style decoder written in the tests: a model whose stages each carry a per-layer
output transform.

OLMo-2 (transformers' ``Olmo2ForCausalLM``) has no input norms: each layer is

    h = x + post_attention_layernorm(attn(x));  out = h + post_feedforward_layernorm(mlp(h))

so the attention's and the MLP's contributions pass through that layer's own RMSNorm (with its
own weights) after their sum and before the residual add. Here that norm is each stage's
after-sum ``OutputTransform``, and each stage reads the residual as it is (an identity norm).
Compute is plain PyTorch on the runtime's tensor-parallel linears; q/k/v are stacked into
``qkv_proj`` at load time, the q/k norms span every head (each rank holds its heads' slice of
their weights and sums its squares with the other attention-TP ranks'). Layers append their
stages from one declaration function (``OlmoLayer.declarations``), which the model also asks
for the neighbours of its pipeline rank's stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from layer_boundary import OutputTransform, append_stages, declare_attn, declare_ffn
from layer_boundary.models.layers import GatedMLP
from layer_boundary.models.loader import iter_weights, load_weights
from layer_boundary.models.pipeline import PipelineStage, pipeline_stack, run_stack
from layer_boundary.models.rope import apply_rope, inverse_frequencies, rope_cos_sin
from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime import (ParallelLMHead, QKVParallelLinear, RMSNorm,
                                    RowParallelLinear, VocabParallelEmbedding, all_reduce_rows)

# 4 layers (pp 2 and 3 split them), 4 heads of 8 over 2 kv heads: attention tp 2 holds whole
# kv heads, so each rank's q/k norm squares are its own heads'
TINY_OLMO = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                 max_position_embeddings=64, eos_token_id=0, pad_token_id=1)
EMBEDDING, NORM, HEAD = "model.embed_tokens.weight", "model.norm.", "lm_head.weight"


@dataclass(frozen=True)
class OlmoConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def read(cls, path) -> OlmoConfig:
        import json

        raw = json.loads((Path(path) / "config.json").read_text())
        rope = raw.get("rope_parameters") or {}
        return cls(**{f: raw[f] for f in ("vocab_size", "hidden_size", "intermediate_size",
                                          "num_hidden_layers", "num_attention_heads",
                                          "num_key_value_heads", "rms_norm_eps")},
                   rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))))


def hf_olmo2(path: Path, seed: int = 0) -> Path:
    """save_pretrained of a random transformers Olmo2ForCausalLM, every weight (norms
    included) random."""
    import transformers
    from checkpoints import randomize

    torch.manual_seed(seed)
    model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**TINY_OLMO))
    randomize(model)
    model.save_pretrained(path)
    return Path(path)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a feature dim split over ``group`` (OLMo-2's q/k norm over every head):
    this rank's slice of the weight; the squares summed over the group."""

    def __init__(self, features: int, group, eps: float, dtype) -> None:
        super().__init__()
        self.group, self.eps, self.features = group, eps, features
        self.local = features // group.size
        self.weight = nn.Parameter(torch.empty(self.local, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded[self.group.rank * self.local:][:self.local])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = all_reduce_rows(x.float().pow(2).sum(-1, keepdim=True), self.group)
        return (self.weight * (x.float() * torch.rsqrt(squares / self.features + self.eps))).to(
            x.dtype)


def causal_attention(q, k, v, lens, scaling: float) -> torch.Tensor:
    """Each request's causal attention (eager, softmax in fp32): q [T, H, D], k/v [T, KVH, D]
    for requests of ``lens`` tokens in order -> [T, H, D]."""
    groups = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in lens:
        qi, ki, vi = (t[start:start + n].transpose(0, 1) for t in (q, k, v))  # [heads, n, D]
        ki, vi = ki.repeat_interleave(groups, 0), vi.repeat_interleave(groups, 0)
        scores = (qi @ ki.transpose(1, 2)) * scaling
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        weights = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32)
        out.append((weights.to(vi.dtype) @ vi).transpose(0, 1))
        start += n
    return torch.cat(out) if out else q.new_zeros(q.shape)


class OlmoAttention(nn.Module):
    """q/k/v column-parallel over attention TP, q/k norms over every head, rotary, causal
    attention, ``o_proj`` row-parallel without a reduction (PARTIAL: the boundary sums)."""

    def __init__(self, cfg: OlmoConfig, runtime, dtype) -> None:
        super().__init__()
        group, d = runtime.parallel.attn_tp_group, cfg.head_dim
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = d
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, heads, kv_heads, group, dtype=dtype)
        self.q_norm = ShardedRMSNorm(heads * d, group, cfg.rms_norm_eps, dtype)
        self.k_norm = ShardedRMSNorm(kv_heads * d, group, cfg.rms_norm_eps, dtype)
        self.o_proj = RowParallelLinear(heads * d, cfg.hidden_size, group, reduce_results=False,
                                        dtype=dtype, name="o_proj")
        self.register_buffer("inv_freq", inverse_frequencies(cfg.rope_theta, d), persistent=False)
        self.scaling = d ** -0.5

    def forward(self, positions, x, forward_batch):
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        tokens, d = x.shape[0], self.head_dim  # T may be 0 (an idle DP rank): no -1 in views
        heads, kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        q, k, v = q.view(tokens, heads, d), k.view(tokens, kv_heads, d), v.view(tokens, kv_heads, d)
        cos, sin = rope_cos_sin(positions, self.inv_freq, q.dtype)
        q, k = apply_rope(q, cos, sin, interleave=False), apply_rope(k, cos, sin, interleave=False)
        out = causal_attention(q, k, v, forward_batch.extend_lens, self.scaling)
        return self.o_proj(out.flatten(1))  # [T, hidden]: this rank's partial


def _elsewhere(name: str):
    def post_norm(x):
        raise RuntimeError(f"{name} holds another rank's weights: its declaration here only "
                           "describes that stage")
    return post_norm


class OlmoLayer(nn.Module):
    """Attention then MLP, each stage reading the residual as it is and its contribution
    passing through the layer's own post-norm after its sum."""

    def __init__(self, cfg: OlmoConfig, index: int, runtime, dtype) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = OlmoAttention(cfg, runtime, dtype)
        self.mlp = GatedMLP(h, cfg.intermediate_size, runtime, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype=dtype)
        self.post_feedforward_layernorm = RMSNorm(h, eps, dtype=dtype)
        attn, ffn = self.declarations(cfg, index, runtime, layer=self)
        self.attn_boundary, self.ffn_boundary = append_stages(
            (attn, nn.Identity()), (ffn, nn.Identity()), name=f"layer{index}")

    @classmethod
    def declarations(cls, cfg: OlmoConfig, index: int, runtime, layer=None) -> tuple:
        """The attention (PARTIAL) and the MLP, each with the layer's post-norm after its
        sum; for a neighbour (``layer`` None) the post-norm is a stand-in that never runs:
        that layer's weights are on its own rank."""
        def post_norm(name: str) -> OutputTransform:
            fn = getattr(layer, name) if layer is not None else _elsewhere(f"layer{index}.{name}")
            return OutputTransform(fn, before_reduce_scatter=False, name=f"layer{index}.{name}")

        return (declare_attn(output_transform=post_norm("post_attention_layernorm")),
                declare_ffn(output_transform=post_norm("post_feedforward_layernorm")))

    def stage_compute(self) -> list:
        return [(self.attn_boundary, "self_attn"), (self.ffn_boundary, "mlp")]

    def forward(self, positions, hidden_states, forward_batch):
        fb = forward_batch
        x = self.attn_boundary.prepare(hidden_states, fb)
        h = self.attn_boundary.finish(self.self_attn(positions, x, fb), fb)
        x = self.ffn_boundary.prepare(h, fb)
        with self.ffn_boundary.exit(fb) as output:
            y = self.mlp(x)
        return output.finish(y)


class OlmoLike(nn.Module):
    """This pipeline rank's part of the model: the embedding on the first, its layers (a
    layer stack that knows its neighbours on the other ranks), the final norm and the head
    on the last."""

    def __init__(self, cfg: OlmoConfig, runtime, dtype=torch.float32) -> None:
        super().__init__()
        group = runtime.parallel.attn_tp_group
        self.stage = stage = PipelineStage.of(runtime, cfg.num_hidden_layers)
        if stage.first:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group,
                                                       dtype=dtype)
        with pipeline_stack(stage, runtime,
                            lambda i: OlmoLayer.declarations(cfg, i, runtime)) as self.stack:
            self.layers = nn.ModuleList(OlmoLayer(cfg, i, runtime, dtype) for i in stage.layers)
        if stage.last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, group, dtype=dtype)

    def forward(self, forward_batch, pp_input=None):
        """Logits [T, vocab] of this rank's tokens on the last pipeline rank; the tensors for
        the next rank on the others."""
        fb = forward_batch
        return run_stack(self.stage, self.stack, self.layers, fb, None,
                         embed=lambda: self.embed_tokens(fb.input_ids),
                         leave=lambda h, mb: self.lm_head(residual_batch.norm(
                             h, mb, self.norm, skip_empty=True)),
                         pp_input=pp_input)

    def load(self, path) -> OlmoLike:
        """This rank's shard of the checkpoint at ``path``."""
        stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                   ("qkv_proj", "v_proj", "v")]
        locate = self.stage.locator("model.layers.", first_only={EMBEDDING},
                                    last_only=(NORM, HEAD))

        def ours(name):  # this module holds what the checkpoint keeps under "model."
            local = locate(name)
            return local[len("model."):] if local and local.startswith("model.") else local

        load_weights(self, iter_weights(path), stacked=stacked, locate=ours)
        return self.eval()
