"""DeepSeek-V3's NextN / multi-token-prediction (MTP) layer as a speculative draft.

Published checkpoints store it as one extra layer, index ``num_hidden_layers``: ``enorm``,
``hnorm``, ``eh_proj`` and a decoder block (attention and MoE), with ``shared_head.norm``
(``shared_head.head`` and ``embed_tokens`` repeat the target's). For the token at position q
it reads the embedding of that token and a hidden state at q - 1 (the target's final-norm
output where the target has run that position, else its own previous output):

    x = eh_proj(cat(enorm(embed(token)), hnorm(hidden)));  h = norm(block(x));  head(h)

The block is a stack of its own (``layer_stack``): its first stage enters it and its last
ends it (one layer); it runs on the target's ranks and topology with its own
boundary-reduction policy, and shares the target's embedding and LM head.
"""

from __future__ import annotations

import re

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .. import layer_stack
from ..residual import batch as residual_batch
from ..runtime.norm import RMSNorm
from .base import check_stage_producers
from .deepseek_v3 import DeepseekV3DecoderLayer, ReplicatedLinear, mla_layout
from .kv_cache import KVCache
from .loader import CheckpointError, dequantized, iter_weights, load_weights, read_config
from .moe import expert_stacked_params


class DeepseekV3NextN(nn.Module):
    needs_target_hidden = True

    def __init__(self, cfg, runtime, target, dtype=torch.float32):
        super().__init__()
        if cfg.num_nextn_predict_layers < 1:
            raise CheckpointError("config.json num_nextn_predict_layers is 0: the checkpoint "
                                  "carries no NextN layer for --speculative-algorithm nextn")
        if target.stage.count > 1:
            raise ValueError("NextN drafting does not support --pp > 1 yet")
        self.config, self.dtype, self.index = cfg, dtype, cfg.num_hidden_layers
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.eh_proj = ReplicatedLinear(2 * h, h, dtype=dtype)
        with layer_stack(runtime) as self.stack:  # a stack of its own
            self.block = DeepseekV3DecoderLayer(cfg, self.index, runtime, dtype)
        check_stage_producers([(self.index, self.block)], "model.layers")
        self.shared_head_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        # the target's, not parameters of this module (the checkpoint repeats them)
        self._target = [target]

    @property
    def device(self) -> torch.device:
        return self.eh_proj.weight.device

    def forward(self, forward_batch, previous_hidden: torch.Tensor):
        """(logits [T, vocab], hidden [T, H]) for this rank's tokens; ``previous_hidden``
        [T, H]: the hidden state before each token."""
        fb, target = forward_batch, self._target[0]
        residual_batch.start(fb)
        embedded = self.enorm(target.model.embed_tokens(fb.input_ids))
        x = self.eh_proj(torch.cat((embedded, self.hnorm(previous_hidden)), dim=-1))  # [T, H]
        h = self.block(fb.positions, x, fb)
        h = residual_batch.norm(h, fb, self.shared_head_norm, skip_empty=True)
        return target.lm_head(h), h

    def make_kv_cache(self, slots: int, max_len: int) -> KVCache:
        return mla_layout(self.config, [self.index]).build(slots, max_len, self.dtype,
                                                           self.device)

    def load_weights(self, weights) -> None:
        prefix = re.compile(rf"^model\.layers\.{self.index}\.(.+)$")
        names = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.",
                 "shared_head.norm.": "shared_head_norm."}

        def mine():
            for name, tensor in weights:
                m = prefix.match(name)
                if m is None:
                    continue  # the target's tensors
                rest = m.group(1)
                if rest.startswith(("embed_tokens.", "shared_head.head.")):
                    continue  # the target's embedding and head serve
                for old, new in names.items():
                    if rest.startswith(old):
                        yield new + rest[len(old):], tensor
                        break
                else:
                    yield f"block.{rest}", tensor

        stacked = expert_stacked_params(self.config.n_routed_experts) if self.block.is_moe else ()
        load_weights(self, mine(), stacked=stacked)


def load_nextn(path, runtime, target, dtype=torch.float32) -> DeepseekV3NextN:
    """The NextN draft of the DeepSeek-V3 checkpoint at ``path`` (``target`` loaded from it)."""
    if target.config.model_type != "deepseek_v3":
        raise ValueError(f"--speculative-algorithm nextn needs a deepseek_v3 target, got "
                         f"{target.config.model_type}")
    draft = DeepseekV3NextN(target.config, runtime, target, dtype)
    draft.load_weights(dequantized(iter_weights(path), target.config.fp8_block))
    return draft.eval()


def add_nextn_layer(path, seed: int = 0, scale: float = 0.1) -> None:
    """Write a NextN layer into the DeepSeek-V3 checkpoint at ``path`` (a tiny one for tests
    and the built-in generator): the last layer's block, perturbed, as the MTP block, random
    ``eh_proj``, norms near one, and copies of the embedding and head."""
    import json
    from pathlib import Path

    path = Path(path)
    cfg = read_config(path)
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    file = path / "model.safetensors"
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(seed)

    def noisy(t):
        return t + scale * t.std() * torch.randn(t.shape, generator=gen, dtype=t.dtype)

    last = f"model.layers.{n - 1}."
    for name, t in list(tensors.items()):
        if name.startswith(last):
            tensors[f"model.layers.{n}." + name[len(last):]] = noisy(t).contiguous()
    mtp = f"model.layers.{n}."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{mtp}{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    tensors[f"{mtp}eh_proj.weight"] = torch.randn(h, 2 * h, generator=gen) * (2 * h) ** -0.5
    tensors[f"{mtp}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    tensors[f"{mtp}shared_head.head.weight"] = head.clone()
    save_file(tensors, file, metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
