"""The decoder-only skeleton the reference models share: embedding, a stack of layers that
each own their boundaries, the final norm, a vocab-parallel LM head, and checkpoint loading.

A layer class (``layer_cls``) provides ``declarations(cfg, index, runtime, layer=None)`` (its
main-line stage declarations, which it appends to the open layer stack and which the model
asks for the neighbours on other pipeline ranks) and ``stage_compute()`` (each stage it holds,
with the name of the module computing it).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ProducerReduction, install_fusion
from ..capabilities import Feature, check_invariant, check_model
from ..residual import batch as residual_batch
from ..runtime.embedding import ParallelLMHead, VocabParallelEmbedding
from ..runtime.forward_batch import LogitsRows
from ..runtime.hf_names import transformers_tensors
from ..runtime.linear import RowParallelLinear
from ..runtime.norm import RMSNorm
from ..runtime.packed import refresh_packed
from .kv_cache import CacheLayout, KVCache
from .loader import load_weights
from .moe import FusedMoE
from .pipeline import PipelineStage, pipeline_stack, run_stack

EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


class DecoderModel(nn.Module):
    """The stack on this pipeline stage: the embedding on the first stage, this stage's layers
    (global indices, ``stage.layers``), the final norm on the last."""

    def __init__(self, cfg, runtime, dtype, fusions, layer_cls, num_layers=None,
                 final_norm=None, embedding=None):
        """``final_norm(cfg, dtype)``: the model's final norm, built on the last stage
        (``CausalLM.final_norm``; None: an RMSNorm of ``rms_norm_eps``);
        ``embedding(cfg, runtime, dtype)``: its token embedding, built on the first
        (``CausalLM.make_embedding``; None: a ``VocabParallelEmbedding``)."""
        super().__init__()
        num_layers = cfg.num_hidden_layers if num_layers is None else num_layers
        self.stage = PipelineStage.of(runtime, num_layers)
        self.dp_rank = runtime.parallel.attn_dp_rank
        if self.stage.first:
            self.embed_tokens = (embedding or vocab_embedding)(cfg, runtime, dtype)
        # this pipeline rank's part of the stack, knowing its neighbours on the other ranks
        with pipeline_stack(self.stage, runtime,
                            lambda i: layer_cls.declarations(cfg, i, runtime)) as self.stack:
            self.layers = nn.ModuleList(layer_cls(cfg, i, runtime, dtype, fusions)
                                        for i in self.stage.layers)
        check_stage_producers(zip(self.stage.layers, self.layers), "model.layers")
        if self.stage.last:
            self.norm = (final_norm or CausalLM.final_norm)(cfg, dtype)
        self.handoff_norm = None
        if fusions is not None:
            self.take_handoff_norm(fusions)

    def take_handoff_norm(self, fusions) -> None:
        """The service of ``fusions`` that finalizes a terminal MoE handoff in the final norm
        (``fusions.terminal``), if it offers one, for every later forward."""
        service = getattr(fusions, "handoff_norm", None)
        if service is not None and self.stage.last:
            # a final norm without an epsilon (mHC's) has no gemma_weight either: the norm
            # never asks the service there, which declines without an epsilon anyway
            self.handoff_norm = service(getattr(self.norm, "eps", None))

    def forward(self, forward_batch, pp_input=None):
        """The final norm's output on the last stage, the tensors for the next stage on the
        others (None after a split-prefill segment that does not end the stage)."""
        fb = forward_batch
        return run_stack(
            self.stage, self.stack, self.layers, fb, None,
            embed=lambda: self.embed_tokens(fb.input_ids),
            leave=lambda h, mb: residual_batch.norm(h, mb, self.norm, skip_empty=True,
                                                    handoff_norm=self.handoff_norm),
            pp_input=pp_input, dp_rank=self.dp_rank)


def vocab_embedding(cfg, runtime, dtype, cls: type = VocabParallelEmbedding, **attrs):
    """``cls`` (a ``VocabParallelEmbedding``, or the ``ParallelLMHead`` that shares its
    layout) of ``vocab_size`` x ``hidden_size`` over attention TP, with ``attrs`` (a scale, a
    softcap) passed to it."""
    return cls(cfg.vocab_size, cfg.hidden_size, runtime.parallel.attn_tp_group, dtype=dtype,
               **attrs)


def last_rows(hidden: torch.Tensor, forward_batch) -> torch.Tensor:
    """The rows the LM head computes: each request's last where the batch asks
    (``LogitsRows.LAST``) and is not padded, every row otherwise."""
    if forward_batch.logits_rows is LogitsRows.ALL or forward_batch.token_slots is not None:
        return hidden
    return forward_batch.last_rows(hidden)


def sums_its_output(module) -> bool:
    """Whether ``module`` may complete a sum of its own output: a row-parallel linear built
    to reduce, or a MoE's experts (their output reduction)."""
    if isinstance(module, RowParallelLinear):
        return module.reduce_results
    return isinstance(module, FusedMoE)


def check_stage_producers(layers, prefix: str) -> None:
    """A PARTIAL stage's compute never sums its own output: the boundary owns that sum (an
    attention's output projection is built with ``reduce_results=False``). A module that
    would sum it too is refused by name, at construction.

    Args:
        layers: (global index, layer) pairs; each layer's ``stage_compute()`` names the
            module computing each of its stages.
        prefix: the layers' parameter prefix ("model.layers").
    """
    for index, layer in layers:
        for boundary, name in layer.stage_compute():
            if boundary.declaration.reduction is not ProducerReduction.PARTIAL:
                continue
            compute = layer.get_submodule(name)
            for sub_name, sub in compute.named_modules():
                if sums_its_output(sub):
                    where = ".".join(filter(None, (prefix, str(index), name, sub_name)))
                    raise ValueError(
                        f"{where} sums its own output ({type(sub).__name__}), but it computes "
                        f"stage {boundary.name}, which is PARTIAL: the boundary owns that "
                        "stage's sum; build it without one (reduce_results=False)")


class CausalLM(nn.Module):
    """A decoder-only model. Subclasses set ``layer_cls``; ``decoder_layers`` counts the
    ``layer_cls`` modules (``num_hidden_layers`` by default).

    What a model varies, it declares in hooks the skeleton calls (each has a default):

    - ``make_embedding(cfg, runtime, dtype)``, ``final_norm(cfg, dtype)`` and
      ``make_head(cfg, runtime, dtype)``: the stack's two ends, built once (a scaled
      embedding, a LayerNorm, a softcapped head);
    - ``cache_layout()`` and ``cache_state(kv, slots, max_len)``: what ``make_kv_cache``
      keeps (which layers, their heads and widths, a ring; a hybrid's recurrent states);
    - ``stacked_params()``, ``skipped_params()``, ``checkpoint_name(name)``, ``ties_head()``:
      how the checkpoint loads.

    What the rest of the package reads about a model, it reads here (each model declares it
    on its class; ``@register_model`` makes it serve its ``model_type``):

    - ``model_type`` and ``config_class`` (``validate(raw)`` and ``from_dict(raw)``);
    - ``boundary_reduction``: what ``--boundary-reduction auto`` resolves to;
    - ``positional_cache``: a draft may use its cache (a rejected token is overwritten, never
      folded into a state);
    - ``check_parallel(cfg, dims)``: a topology its config cannot be sharded over;
    - ``context_parallel``: True where its attention runs on a CP share, or why it cannot;
    - ``sequence_parallel``, ``attn_input_scattered``: likewise, for sequence-parallel and
      input-scattered batches (``capabilities.py`` holds what each feature needs of them);
    - ``nextn_layers(cfg)``: NextN/MTP layers the checkpoint carries for drafting;
    - ``checkpoint_name(name)``: its parameter name for an on-disk tensor;
    - ``transformers_names``: how transformers names its parameters relative to the
      checkpoint's tensors (``runtime.hf_names`` rules; an adapter's tensors are read by them).
    """

    model_type: str  # these are declared through register_model
    config_class: type
    boundary_reduction: str
    positional_cache: bool
    layer_cls: type
    # how transformers 5 names this model's parameters, relative to its checkpoint's tensors
    # (runtime.hf_names: renames, stacked experts, matrix weights that are no nn.Linear);
    # none: as the checkpoint names them
    transformers_names: tuple = ()
    # why the batch-invariant mode cannot hold under attention DP where the model declares
    # batch_invariant (None: it holds on every layout): an output added on its DP rank's
    # ranks before a sum over TP enters that sum where the batch put the request
    batch_invariant_dp: str | None = None
    # features this model refuses beyond its declared capabilities ({Feature: why}; the
    # capability table names each): the Transformers backend's
    refused_features: dict = {}
    impl = "native"  # which implementation it is (``--model-impl``): our own model file
    # the caches ``make_kv_cache`` builds decode in place (``KVCache.decode_in_place``): set by
    # ``install_fusion`` where the provider declares ``decode_attention_in_place`` (its
    # Triton decode attention), else the gathering path
    decode_in_place: bool = False

    @staticmethod
    def nextn_layers(cfg) -> int:
        return 0

    @classmethod
    def batch_invariant_layout(cls, cfg, dims) -> str | None:
        """Why the batch-invariant mode cannot hold for ``cfg`` on ``dims`` (None: it holds,
        where the model declares ``batch_invariant``): ``batch_invariant_dp`` under attention
        DP."""
        return cls.batch_invariant_dp if dims.attn_dp > 1 else None

    @staticmethod
    def final_norm(cfg, dtype) -> torch.nn.Module:
        """The norm after the last layer, built on the last pipeline stage (Llama's RMSNorm;
        a model whose final norm is another kind, Cohere's or GPT-NeoX's LayerNorm, says so
        here)."""
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def __init__(self, cfg, runtime, dtype=torch.float32, fusions=None):
        super().__init__()
        check_model(type(self), cfg, runtime)  # what it declares against the runtime's features
        self.config, self.dtype = cfg, dtype
        self._dims = runtime.parallel.dims  # what each forward in the batch-invariant mode asks
        self.model = DecoderModel(cfg, runtime, dtype, fusions, self.layer_cls,
                                  self.decoder_layers(cfg), self.final_norm,
                                  self.make_embedding)
        self.stage = self.model.stage
        if self.stage.last:
            self.lm_head = self.make_head(cfg, runtime, dtype)
            if self.ties_head() and self.stage.first:
                self.lm_head.tie(self.model.embed_tokens)

    def make_embedding(self, cfg, runtime, dtype) -> VocabParallelEmbedding:
        """The token embedding, built on the first pipeline stage (a
        ``VocabParallelEmbedding``; a model whose embedding scales or normalises its rows
        returns that one: ``head.ScaledEmbedding``)."""
        return vocab_embedding(cfg, runtime, dtype)

    def make_head(self, cfg, runtime, dtype) -> ParallelLMHead:
        """The LM head, built on the last pipeline stage (a ``ParallelLMHead``, tied to the
        embedding where ``ties_head()``; a model whose logits scale or softcap returns that
        one: ``head.ScaledLMHead``)."""
        return vocab_embedding(cfg, runtime, dtype, ParallelLMHead)

    def cache_layout(self) -> CacheLayout:
        """What the KV cache keeps on this stage (``make_kv_cache``): by default every
        layer's ``self_attn``'s keys and values (its kv heads on this rank, its head dim) at
        every position. A model declares what differs: the layers (a hybrid's attention
        ones), their shapes (MLA's latent), a ring (``window``: Mistral)."""
        return CacheLayout.of(layer.self_attn for layer in self.model.layers)

    def cache_state(self, kv: KVCache, slots: int, max_len: int) -> KVCache:
        """The cache ``make_kv_cache`` returns around ``kv``: where a model keeps more per
        request than keys and values (a hybrid's recurrent states, Inkling's convolution
        windows), the cache holding both; ``kv`` itself by default."""
        return kv

    def make_kv_cache(self, slots: int, max_len: int) -> KVCache:
        """The cache of ``slots`` requests of up to ``max_len`` positions on this stage, as
        ``cache_layout`` and ``cache_state`` declare it."""
        kv = self.cache_layout().build(slots, max_len, self.dtype, self.device)
        cache = self.cache_state(kv, slots, max_len)
        if self.decode_in_place:
            cache.decode_in_place = True
        return cache

    def install_fusion(self, provider):
        """Install a fusion provider on this built model (``install_fusion``: every
        decoder layer's stages, their plans rebuilt once) and take its terminal service, if
        it offers one, for the final norm; each module takes the model compute it fuses
        (``take_fusions``), and the caches made after decode in place where the provider
        declares ``decode_attention_in_place``. Before the first forward and the first
        ``make_kv_cache``.

        Args:
            provider: the fusion provider.

        Returns the terminal service (None: the provider offers none).
        """
        install_fusion(self, provider)
        self.model.take_handoff_norm(provider)
        self.decode_in_place = bool(getattr(provider, "decode_attention_in_place", False))
        for module in self.modules():  # the model compute a provider fuses (q/k norm + rope)
            take = getattr(module, "take_fusions", None)
            if take is not None:
                take(provider)
        return self.model.handoff_norm

    def ties_head(self) -> bool:
        """The LM head is the embedding (``tie_word_embeddings``)."""
        return self.config.tie_word_embeddings

    @property
    def stack(self):
        """The layer stack of this pipeline rank's layers."""
        return self.model.stack

    @staticmethod
    def decoder_layers(cfg) -> int:
        return cfg.num_hidden_layers

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def forward(self, forward_batch, pp_input=None, return_hidden: bool = False):
        """Logits on the last pipeline stage: [T, vocab] for every token of this rank's batch,
        or [requests, vocab] for each request's last token where the batch asks
        (``forward_batch.logits_rows``, unpadded batches); the tensors for the next stage on
        the others (``pp_input``: what this stage received); None after a split-prefill
        segment that does not end the stage. With ``return_hidden``: (logits, the final
        norm's output on every token) (a NextN draft reads it)."""
        # in the batch-invariant mode: a model that declares it cannot, or a two-batch forward,
        # is refused by name before anything runs (a model built outside the mode included)
        check_invariant(type(self), (Feature.TBO,) if forward_batch.tbo else (),
                        self.config, self._dims)
        out = self.model(forward_batch, pp_input)
        if not self.stage.last or out is None:
            return out
        logits = self.lm_head(last_rows(out, forward_batch))
        return (logits, out) if return_hidden else logits

    def stacked_params(self) -> list:
        """(fused parameter, checkpoint part, shard id) triples for fused parameters."""
        return []

    def skipped_params(self) -> tuple:
        """Checkpoint name prefixes/suffixes this model does not load."""
        tied_here = self.ties_head() and self.stage.first
        return ("lm_head.weight",) if tied_here else ()

    def load_weights(self, weights) -> None:
        load_weights(self, weights, stacked=self.stacked_params(), skip=self.skipped_params(),
                     locate=self.local_name)

    def rewrite_weights(self, weights) -> None:
        """Load ``weights`` ((checkpoint name, tensor) pairs) again over this loaded model,
        through the checkpoint's own loader (sharded and placed as the checkpoint's tensor of
        that name; another stage's skipped), then re-pack the CPU weights they rewrote (an
        adapter's base-model tensors, ``adapters.lora_base``)."""
        load_weights(self, weights, stacked=self.stacked_params(), locate=self.local_name,
                     complete=False)
        refresh_packed(self)

    def local_name(self, name: str) -> str | None:
        """This pipeline stage's name for an on-disk tensor name (None: not on this stage, or
        not loaded)."""
        ours = self.checkpoint_name(name)
        if ours is None:
            return None
        on_stage = self.stage.locator("model.layers.", first_only={EMBEDDING},
                                      last_only=("model.norm.", HEAD), embedding=EMBEDDING,
                                      head=HEAD if self.ties_head() else None)
        return on_stage(ours)

    def checkpoint_name(self, name: str) -> str | None:
        """This model's name for an on-disk tensor name (None: not loaded); errors still name
        the tensor as it is on disk."""
        return name

    def transformers_tensors(self, facts: dict) -> dict:
        """{transformers' parameter name: ``runtime.hf_names.HfTensor``} of the checkpoint
        whose safetensors headers are ``facts`` ({name: (shape, dtype)}), as this model's
        ``transformers_names`` declare them. The layers this model never loads (the MTP/NextN
        layers a checkpoint stores after its stack: its ``skipped_params`` prefixes) are no
        parameter of transformers' model either, which ignores them on load."""
        skipped = tuple(p for p in self.skipped_params() if p.endswith("."))
        return transformers_tensors(self.transformers_names,
                                    {n: f for n, f in facts.items() if not n.startswith(skipped)}
                                    if skipped else facts, self.config)
