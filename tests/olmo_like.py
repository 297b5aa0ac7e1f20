"""OLMo-2 with its post norms declared the other way: as each stage's after-sum
``OutputTransform`` (a per-layer transform holding its layer's weights) on the plain add, where
the model file (``layer_boundary/models/olmo2.py``) declares them as the post-norm residual
kind (``PostNormAdd``). Everything else is the model file's; the tests prove both routes give
transformers' numbers, and that a stack takes per-layer transforms as neighbours.
"""

from __future__ import annotations

from layer_boundary import OutputTransform, declare_attn, declare_ffn
from layer_boundary.models import iter_weights, open_checkpoint
from layer_boundary.models.olmo2 import Olmo2DecoderLayer, Olmo2ForCausalLM


def _elsewhere(name: str):
    def post_norm(x):
        raise RuntimeError(f"{name} holds another rank's weights: its declaration here only "
                           "describes that stage")
    return post_norm


class OlmoLikeLayer(Olmo2DecoderLayer):
    """OLMo-2's layer with each post norm as its stage's after-sum output transform."""

    @classmethod
    def declarations(cls, cfg, index: int, runtime, layer=None) -> tuple:
        """For a neighbour (``layer`` None) the post norm is a stand-in that never runs:
        that layer's weights are on its own rank."""
        def post_norm(name: str) -> OutputTransform:
            fn = getattr(layer, name) if layer is not None else _elsewhere(f"layer{index}.{name}")
            return OutputTransform(fn, before_reduce_scatter=False, name=f"layer{index}.{name}")

        return (declare_attn(output_transform=post_norm("post_attention_layernorm")),
                declare_ffn(output_transform=post_norm("post_feedforward_layernorm")))


class OlmoLike(Olmo2ForCausalLM):
    layer_cls = OlmoLikeLayer


def load_olmo_like(path, runtime) -> OlmoLike:
    """The OLMo-2 checkpoint at ``path`` as ``OlmoLike``, this rank's shard."""
    model = OlmoLike(open_checkpoint(path).config, runtime)
    model.load_weights(iter_weights(path))
    return model.eval()
