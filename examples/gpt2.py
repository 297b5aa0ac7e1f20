"""GPT-2 on layer boundaries: the worked example of docs/adding-a-model.md.

Plain PyTorch in the style of the package's models. Parameter names are the checkpoint's
(``transformers.GPT2LMHeadModel.save_pretrained``: ``transformer.wte``, ``transformer.h.N.*``,
``transformer.ln_f``; the head is tied to ``wte`` and not saved), so loading needs no renaming
beyond the hub's older prefix-less layout (``checkpoint_name``).

What GPT-2 brings that the reference models do not:

- learned position embeddings (``wpe``) added to the token embeddings before the stack;
- pre-LayerNorm blocks whose norms (``ln_1``, ``ln_2``, ``ln_f``) are plain ``nn.LayerNorm``
  with a bias: no ``normalize_fp32``, so the boundary rounds its fp32 residual sum to the model
  dtype and calls the norm on that (exactly what transformers' GPT-2 does: add, then norm);
- ``Conv1D`` projections, whose weights are stored [in, out]: loaded transposed into linears;
- one fused ``c_attn`` holding q | k | v column blocks, each cut into this rank's heads.

The model owns its compute; the boundaries own every sum a row-parallel output leaves, every
row movement and the residual adds. Built directly, not registered (see the guide: a model
registered from a test module is unknown to ``layer-boundary run`` in a fresh process).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from layer_boundary import declare_attn, declare_ffn, layer_stack, make_stages
from layer_boundary.models.config import (BOOL, POSITIVE_INT, CheckedConfig, CheckpointError,
                                          check_divisible, read_config, require, required)
from layer_boundary.models.kv_cache import KVCache, cached_attention
from layer_boundary.models.loader import iter_weights, load_weights
from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime.args import BoundaryRuntime, resolve_boundary_reduction
from layer_boundary.runtime.embedding import ParallelLMHead, VocabParallelEmbedding
from layer_boundary.runtime.linear import (ColumnParallelLinear, QKVParallelLinear,
                                           RowParallelLinear, expect_shape)

# what ``--boundary-reduction auto`` means for this model (a registered model declares it with
# ``@register_model(..., boundary_reduction=...)``): a dense decoder, like Qwen3
BOUNDARY_REDUCTION = "rs+rsv"
# transformers' ACT2FN names this model computes, and how
ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class GPT2Config(CheckedConfig):
    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True
    model_type: str = "gpt2"

    # every field read below, checked before from_dict reads it (a string where a count
    # belongs is an error naming the field, never a misread)
    # GPT-2's own names (vocab_size, layer_norm_epsilon, tie_word_embeddings and
    # quantization_config are shared fields, checked for every model)
    fields = {
        **{f: POSITIVE_INT for f in ("n_positions", "n_embd", "n_layer", "n_head", "n_inner")},
        **{f: BOOL for f in ("scale_attn_weights", "scale_attn_by_inverse_layer_idx",
                             "reorder_and_upcast_attn", "add_cross_attention")},
    }

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_dict(cls, cfg: dict) -> GPT2Config:
        # what this model does not compute is refused by name, never silently ignored
        if cfg.get("quantization_config"):
            raise CheckpointError("config.json quantization_config is not supported")
        for flag, why in (("add_cross_attention", "decoder-only GPT-2"),
                          ("reorder_and_upcast_attn", "scores in the model dtype")):
            if cfg.get(flag):
                raise CheckpointError(f"config.json {flag}=true is not supported ({why})")
        act = cfg.get("activation_function", "gelu_new")
        if act not in ACTIVATIONS:
            raise CheckpointError(f"config.json activation_function {act!r} is not supported "
                                  f"(supported: {', '.join(ACTIVATIONS)})")
        hidden, heads = require(cfg, "n_embd"), require(cfg, "n_head")
        if hidden % heads:
            raise CheckpointError(f"config.json n_embd={hidden} is not divisible by "
                                  f"n_head={heads}")
        return cls(**required(cfg, "vocab_size", "n_positions", "n_layer"),
                   n_embd=hidden, n_head=heads,
                   n_inner=cfg.get("n_inner") or 4 * hidden,
                   layer_norm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
                   activation_function=act,
                   scale_attn_weights=bool(cfg.get("scale_attn_weights", True)),
                   scale_attn_by_inverse_layer_idx=bool(
                       cfg.get("scale_attn_by_inverse_layer_idx", False)),
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))


def check_parallel(cfg: GPT2Config, dims) -> None:
    """Reject a topology this config cannot be sharded over, naming the field: heads split
    over attention TP, the MLP's inner dim over the whole TP group."""
    check_divisible("n_head", cfg.n_head, "attention tp", dims.attn_tp)
    check_divisible("n_inner", cfg.n_inner, "tp", dims.tp)


def conv1d(linear: nn.Module) -> nn.Module:
    """``linear`` loading a Conv1D checkpoint weight: Conv1D stores [in, out], a linear
    [out, in]; the linear's own ``weight_loader`` then cuts its shard from the transpose.
    Biases are [out] either way."""
    shard = linear.weight.weight_loader
    linear.weight.weight_loader = lambda param, loaded: shard(param, loaded.t())
    return linear


class FusedQKV(QKVParallelLinear):
    """GPT-2's ``c_attn``: one Conv1D whose output columns are q | k | v, each [n_embd]. Each
    rank keeps its heads of each block (``QKVParallelLinear``'s per-rank layout: local q,
    then local k, then local v), so one checkpoint tensor feeds three shards."""

    def __init__(self, cfg: GPT2Config, group, dtype):
        super().__init__(cfg.n_embd, cfg.head_dim, cfg.n_head, cfg.n_head, group, bias=True,
                         dtype=dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.dim() == 2:
            loaded = loaded.t()  # Conv1D [n_embd, 3 * n_embd] -> [3 * n_embd, n_embd]
        expect_shape(loaded, 3 * self.total_heads * self.head_dim, *param.shape[1:])
        for shard_id, block in zip("qkv", loaded.chunk(3, dim=0)):
            super().weight_loader(param, block, shard_id)  # this rank's heads of the block


class GPT2Attention(nn.Module):
    """Causal multi-head attention, heads over attention TP. A PARTIAL producer: ``c_proj``
    never reduces (``reduce_results=False``) and adds its bias on attention-TP rank 0 only,
    so the sum the boundary completes holds the bias once."""

    def __init__(self, cfg: GPT2Config, layer_id: int, runtime: BoundaryRuntime, dtype):
        super().__init__()
        group = runtime.parallel.attn_tp_group
        self.layer_id, self.head_dim = layer_id, cfg.head_dim
        self.c_attn = FusedQKV(cfg, group, dtype)
        self.c_proj = conv1d(RowParallelLinear(cfg.n_embd, cfg.n_embd, group, bias=True,
                                               reduce_results=False, dtype=dtype,
                                               name="c_proj"))
        self.scaling = cfg.head_dim ** -0.5 if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            self.scaling /= float(layer_id + 1)

    def forward(self, hidden_states: torch.Tensor, forward_batch) -> torch.Tensor:
        tokens, heads = hidden_states.shape[0], self.c_attn.num_heads  # local heads
        qkv = self.c_attn(hidden_states)  # [T, 3 * H * D]
        q, k, v = qkv.split([self.c_attn.q_size] * 3, dim=-1)  # [T, H * D] each
        q = q.view(tokens, heads, self.head_dim)  # [T, H, D] (T may be 0: no -1 in views)
        k = k.view(tokens, heads, self.head_dim)
        v = v.view(tokens, heads, self.head_dim)
        out = cached_attention(self.layer_id, q, k, v, forward_batch, self.scaling)  # [T, H, D]
        return self.c_proj(out.flatten(1))  # [T, H * D] -> [T, n_embd], this rank's partial


class GPT2MLP(nn.Module):
    """``c_proj(gelu(c_fc(x)))``, the inner dim over the TP group. ``c_proj`` obeys the exit's
    flags: it all-reduces unless the boundary took the sum over (then it returns a partial
    with the bias on TP rank 0)."""

    def __init__(self, cfg: GPT2Config, runtime: BoundaryRuntime, dtype):
        super().__init__()
        group = runtime.parallel.tp_group
        self.c_fc = conv1d(ColumnParallelLinear(cfg.n_embd, cfg.n_inner, group, bias=True,
                                                dtype=dtype, name="c_fc"))
        self.c_proj = conv1d(RowParallelLinear(cfg.n_inner, cfg.n_embd, group, bias=True,
                                               dtype=dtype, name="c_proj"))
        self.approximate = ACTIVATIONS[cfg.activation_function]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.c_fc(x), approximate=self.approximate)  # [T, n_inner / tp]
        return self.c_proj(h)  # [T, n_embd]: a sum, or a partial the boundary completes


class GPT2Block(nn.Module):
    """``x + attn(ln_1(x))``, then ``+ mlp(ln_2(.))``: an attention stage read through
    ``ln_1`` and an FFN stage read through ``ln_2``. The residual adds are the boundaries'."""

    def __init__(self, cfg: GPT2Config, layer_id: int, runtime: BoundaryRuntime, dtype):
        super().__init__()
        self.n_embd = cfg.n_embd
        eps = cfg.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=eps, dtype=dtype)
        self.attn = GPT2Attention(cfg, layer_id, runtime, dtype)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=eps, dtype=dtype)
        self.mlp = GPT2MLP(cfg, runtime, dtype)
        # previous: the real producer before this layer's attention (the last layer's MLP, a
        # dense FFN), None where the stack starts; terminal: the stack's last layer only
        self.attn_boundary, self.ffn_boundary = make_stages(
            (declare_attn(), self.ln_1),
            (declare_ffn(), self.ln_2),
            previous=declare_ffn() if layer_id else None,
            terminal=layer_id == cfg.n_layer - 1,
            runtime=runtime, name=f"layer{layer_id}")

    def forward(self, hidden_states, forward_batch):
        # completes what the previous MLP owes, adds it to the residual, returns ln_1(residual)
        hidden_states = self.attn_boundary.prepare(hidden_states, forward_batch)
        if hidden_states.shape[0] != 0:
            out = self.attn(hidden_states, forward_batch)
        else:  # no rows on this DP rank: an empty contribution (its peers still sum theirs)
            out = hidden_states.new_zeros((0, self.n_embd))
        hidden_states = self.attn_boundary.finish(out, forward_batch)  # the partial is owed
        hidden_states = self.ffn_boundary.prepare(hidden_states, forward_batch)  # ln_2(...)
        with self.ffn_boundary.exit(forward_batch) as output:  # publishes c_proj's flags
            hidden_states = self.mlp(hidden_states)
        return output.finish(hidden_states)


class GPT2Model(nn.Module):
    def __init__(self, cfg: GPT2Config, runtime: BoundaryRuntime, dtype):
        super().__init__()
        par = runtime.parallel
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd, par.attn_tp_group,
                                          dtype=dtype)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd, dtype=dtype)  # replicated
        self.wpe.weight.requires_grad_(False)
        # inside a layer stack each layer's ``previous`` is checked against the stage built
        # before it
        with layer_stack(runtime) as self.stack:
            self.h = nn.ModuleList(GPT2Block(cfg, i, runtime, dtype) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon, dtype=dtype)

    def forward(self, forward_batch) -> torch.Tensor:
        fb = forward_batch
        residual_batch.start(fb)  # a fresh residual stream for this forward
        hidden_states = self.wte(fb.input_ids) + self.wpe(fb.positions)  # [T, n_embd]
        for block in self.h:
            hidden_states = block(hidden_states, fb)
        # completes the last MLP's sum, adds it, applies ln_f; back on local rows, released
        return residual_batch.norm(hidden_states, fb, self.ln_f, skip_empty=True)


class GPT2LMHeadModel(nn.Module):
    """Logits for every token of this rank's batch; the head is ``wte`` unless untied."""

    def __init__(self, cfg: GPT2Config, runtime: BoundaryRuntime, dtype=torch.float32):
        super().__init__()
        check_parallel(cfg, runtime.parallel.dims)
        self.config, self.dtype = cfg, dtype
        self.transformer = GPT2Model(cfg, runtime, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.n_embd, runtime.parallel.attn_tp_group,
                                      dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.tie(self.transformer.wte)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def forward(self, forward_batch) -> torch.Tensor:
        return self.lm_head(self.transformer(forward_batch))  # [T, vocab]

    def make_kv_cache(self, slots: int, max_len: int) -> KVCache:
        cfg = self.config
        if max_len > cfg.n_positions:
            raise ValueError(f"{max_len} positions exceed n_positions={cfg.n_positions} "
                             "(GPT-2's learned position embeddings)")
        heads = self.transformer.h[0].attn.c_attn.num_heads  # this rank's
        return KVCache(cfg.n_layer, slots, max_len, heads, cfg.head_dim, self.dtype,
                       device=self.device)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Our parameter name for an on-disk tensor (None: not loaded). The hub's original
        GPT-2 files carry no ``transformer.`` prefix, and older files store the causal-mask
        buffers ``attn.bias`` (some also ``attn.masked_bias``) beside the weights."""
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return None
        if name.startswith(("wte.", "wpe.", "h.", "ln_f.")):
            return f"transformer.{name}"
        return name

    def load_weights(self, weights) -> None:
        # a tied head is wte: transformers does not save it; ignore it where a file has it
        skip = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        load_weights(self, weights, skip=skip, locate=self.checkpoint_name)


def load_gpt2(path, runtime: BoundaryRuntime, dtype=torch.float32) -> GPT2LMHeadModel:
    """Build GPT-2 for the checkpoint at ``path`` on ``runtime`` and load this rank's shard."""
    raw = read_config(path)
    if raw.get("model_type") != "gpt2":
        raise CheckpointError(f"config.json model_type {raw.get('model_type')!r} is not gpt2")
    GPT2Config.validate(raw)
    model = GPT2LMHeadModel(GPT2Config.from_dict(raw), runtime, dtype)
    model.load_weights(iter_weights(path))
    return model.eval()


# -- one rank's run, as an engine worker does it (the multi-rank tests send this to the pool)

class _Forwards:
    """The model as ``greedy_generate`` calls it, noting each forward's row mode and whether
    it released its residual stream."""

    def __init__(self, model) -> None:
        self.model, self.modes, self.released = model, [], True

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, forward_batch):
        logits = self.model(forward_batch)
        self.released &= forward_batch.residual_stream is None
        self.modes.append(forward_batch.rows.mode.value)
        return logits


def run_rank(path: str, prompts, steps: int, *, tp: int = 1, dp: int = 1,
             boundary_reduction: str = "ar") -> dict:
    """This rank's greedy generation of ``prompts`` (request i on DP rank i mod dp): its
    requests, tokens and per-step logits, each forward's row mode, whether every stream was
    released, this rank's heads, and the collectives it ran (kind, group, site). World size is
    ``tp``; torch.distributed is initialised where it exceeds 1."""
    from layer_boundary.engine.generate import greedy_generate
    from layer_boundary.runtime.ledger import LEDGER
    from layer_boundary.runtime.parallel import ParallelDims, build_parallel

    par = build_parallel(ParallelDims(world_size=tp, tp=tp, attn_dp=dp))
    policy = resolve_boundary_reduction(boundary_reduction, BOUNDARY_REDUCTION)
    runtime = BoundaryRuntime(par, boundary_reduction=policy)
    model = _Forwards(load_gpt2(path, runtime))
    with LEDGER.recording() as collectives:
        gen = greedy_generate(model, [list(p) for p in prompts], steps, dp=dp,
                              dp_rank=par.attn_dp_rank)
    return {"rank": par.rank, "attn_tp_rank": par.attn_tp_rank, "requests": gen.request_ids,
            "generated": gen.generated, "logits": gen.logits, "modes": model.modes,
            "released": model.released, "heads": model.make_kv_cache(1, 1).k[0].shape[1],
            "collectives": sorted({(e.kind, e.group, e.site) for e in collectives})}


# -- run on its own: a tiny random GPT-2 (or --model's), on --tp ranks, against transformers

TINY = dict(vocab_size=97, n_positions=32, n_embd=64, n_layer=3, n_head=4, bos_token_id=0,
            eos_token_id=0)


def randomize(model) -> None:
    """Every weight random at unit-scale activations. GPT-2's names defeat a generic
    randomizer: its norms are ``ln_*`` (no "norm" in the name) and a Conv1D's fan-in is its
    weight's first dim, not its last."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name:  # LayerNorm weight ~1, bias ~0
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
            elif name.endswith(("wte.weight", "wpe.weight")):
                p.normal_(0.0, 0.3)
            elif name.endswith("weight"):  # Conv1D [in, out]
                p.normal_(0.0, p.shape[0] ** -0.5)
            else:  # projection biases
                p.normal_(0.0, 0.1)


def tiny_checkpoint(path, *, seed: int = 0, **overrides) -> str:
    """A random tiny GPT-2 (``TINY`` with ``overrides``) written by transformers'
    ``save_pretrained``, the layout of a hub checkpoint."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**dict(TINY, **overrides)))
    randomize(model)
    model.save_pretrained(path)
    return str(path)


def transformers_greedy(path: str, prompt, steps: int) -> list[int]:
    """What transformers' GPT-2 generates greedily for ``prompt``."""
    import transformers

    model = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=steps,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _tp_rank(path: str, prompts, steps: int, tp: int) -> dict:
    return run_rank(path, prompts, steps, tp=tp)


def main() -> None:
    import argparse
    import tempfile

    from layer_boundary.runtime import spawn

    parser = argparse.ArgumentParser(description="GPT-2 on layer boundaries, against "
                                     "transformers' GPT-2")
    parser.add_argument("--model", help="a GPT-2 checkpoint (default: a tiny random one)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    args = parser.parse_args()
    prompts, steps = ((1, 2, 3, 4, 5), (7, 8, 9)), 4
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or tiny_checkpoint(tmp)
        ranks = ([run_rank(path, prompts, steps)] if args.tp == 1
                 else spawn(_tp_rank, args.tp, path, prompts, steps, args.tp))
        ours = dict(zip(ranks[0]["requests"], ranks[0]["generated"]))
        print(f"GPT-2 at tp {args.tp} ({'random tiny checkpoint' if args.model is None else path}"
              f"), row modes {ranks[0]['modes']}:")
        for i, prompt in enumerate(prompts):
            theirs = transformers_greedy(path, prompt, steps)
            print(f"prompt {list(prompt)} -> {ours[i]} (transformers: "
                  f"{'the same' if ours[i] == theirs else theirs})")


if __name__ == "__main__":
    main()
