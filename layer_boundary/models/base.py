"""The decoder-only skeleton the reference models share: embedding, a stack of layers that
each own their boundaries, the final norm, a vocab-parallel LM head, and checkpoint loading."""

from __future__ import annotations

import torch
from torch import nn

from ..residual import batch as residual_batch
from ..runtime.embedding import ParallelLMHead, VocabParallelEmbedding
from ..runtime.norm import RMSNorm
from .loader import load_weights


class DecoderModel(nn.Module):
    def __init__(self, cfg, runtime, dtype, fusions, layer_cls, num_layers=None):
        super().__init__()
        num_layers = cfg.num_hidden_layers if num_layers is None else num_layers
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size,
                                                   runtime.parallel.attn_tp, dtype=dtype)
        self.layers = nn.ModuleList(layer_cls(cfg, i, runtime, dtype, fusions)
                                    for i in range(num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        # a provider may offer a service that finalizes a terminal MoE handoff in the final norm
        service = getattr(fusions, "handoff_norm", None)
        self.handoff_norm = service() if service is not None else None

    def forward(self, forward_batch):
        residual_batch.start(forward_batch)
        hidden_states = self.embed_tokens(forward_batch.input_ids)
        for layer in self.layers:
            hidden_states = layer(forward_batch.positions, hidden_states, forward_batch)
        return residual_batch.norm(hidden_states, forward_batch, self.norm, skip_empty=True,
                                   handoff_norm=self.handoff_norm)


class CausalLM(nn.Module):
    """Subclasses set ``layer_cls`` and ``check_parallel`` and provide ``make_kv_cache``;
    ``decoder_layers`` counts the ``layer_cls`` modules (``num_hidden_layers`` by default)."""

    layer_cls: type
    check_parallel = None

    def __init__(self, cfg, runtime, dtype=torch.float32, fusions=None):
        super().__init__()
        self.check_parallel(cfg, runtime.parallel.dims)
        self.config, self.dtype = cfg, dtype
        self.model = DecoderModel(cfg, runtime, dtype, fusions, self.layer_cls,
                                  self.decoder_layers(cfg))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, runtime.parallel.attn_tp,
                                      dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    @staticmethod
    def decoder_layers(cfg) -> int:
        return cfg.num_hidden_layers

    def forward(self, forward_batch) -> torch.Tensor:
        """Logits [T, vocab] for every token of this rank's batch."""
        return self.lm_head(self.model(forward_batch))

    def stacked_params(self) -> list:
        """(fused parameter, checkpoint part, shard id) triples for fused parameters."""
        return []

    def skipped_params(self) -> tuple:
        """Checkpoint name prefixes/suffixes this model does not load."""
        return ("lm_head.weight",) if self.config.tie_word_embeddings else ()

    def load_weights(self, weights) -> None:
        load_weights(self, weights, stacked=self.stacked_params(), skip=self.skipped_params())
