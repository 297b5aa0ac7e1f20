"""Qwen3.5 (text): Qwen3-Next's hybrid stack (``qwen3_next.py``) with a dense gated MLP in
every layer and the DeltaNet's input projection split (``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``).

Two checkpoint layouts, one model:

* ``qwen3_5_text``: what transformers' ``Qwen3_5ForCausalLM.save_pretrained`` writes (the
  text config at the top, ``model.layers.*``);
* ``qwen3_5``: the released multimodal checkpoint (``Qwen3_5ForConditionalGeneration``): the
  text config nested in ``text_config``, the language model under ``model.language_model.``;
  the vision tower (``model.visual.*``) and the MTP block (``mtp.*``) are not loaded.

Qwen3.5's rotary is multimodal (``mrope_section``); for text its three position rows are
equal, which is plain partial rotary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from ..runtime.hf_names import Alias, Rename
from .config import CheckpointError
from .qwen3_next import (AUTO, NO_CP, NO_SP, Qwen3NextConfig, Qwen3NextForCausalLM,
                         check_parallel)
from .registry import NO_MOE_LAYERS, NO_QKV_LATENT, register_model

LANGUAGE_MODEL, MODEL = "model.language_model.", "model."


def text_config(raw: dict) -> dict:
    """The text model's fields: ``text_config`` where the config nests it (with the top
    level's ``tie_word_embeddings`` where the text config leaves it out), else ``raw``."""
    text = raw.get("text_config")
    if text is None:
        return raw
    if not isinstance(text, dict):
        raise CheckpointError(f"config.json field text_config must be an object, got {text!r}")
    top = {k: raw[k] for k in ("tie_word_embeddings",) if k in raw}
    return {**top, **text}


@dataclass(frozen=True)
class Qwen3_5Config(Qwen3NextConfig):
    """Qwen3-Next's config read from the text config (nested or not), with the fields the
    architecture fixes (``FIXED``) whatever config.json says."""

    model_type: str = "qwen3_5"
    # no experts (transformers' Qwen3_5TextConfig has no MoE fields); the split projections
    FIXED: ClassVar[dict] = dict(num_experts=0, split_projections=True)

    @classmethod
    def validate(cls, raw: dict) -> None:
        super().validate(text_config(raw))

    @classmethod
    def read(cls, cfg: dict) -> dict:
        return super().read(text_config(cfg))


class Qwen3_5Names:
    """Checkpoint names of either layout: ``model.language_model.*`` read as ``model.*``;
    the vision tower and the MTP block skipped."""

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(LANGUAGE_MODEL):
            return MODEL + name[len(LANGUAGE_MODEL):]
        return None if name.startswith("model.visual.") else name


# how transformers names the tensors (Qwen3-Next's experts stacked, its router no nn.Linear):
# a multimodal checkpoint as its ConditionalGeneration class does (model.language_model.*)
# and as AutoModelForCausalLM's text class does (model.*); a text checkpoint as the text class
MULTIMODAL_NAMES = (*Qwen3NextForCausalLM.transformers_names,
                    Alias(rf"^{re.escape(LANGUAGE_MODEL)}", MODEL))
TEXT_NAMES = (*Qwen3NextForCausalLM.transformers_names,
              Rename(rf"^{re.escape(LANGUAGE_MODEL)}", MODEL))

CAPABILITIES = dict(check_parallel=check_parallel, moe_a2a=NO_MOE_LAYERS, context_parallel=NO_CP,
                    sequence_parallel=NO_SP, boundary_reduction=AUTO,
                    positional_cache=False,  # its recurrent states fold every token in
                    attn_input_scattered=NO_QKV_LATENT, batch_invariant=True)


@register_model("qwen3_5", Qwen3_5Config, architectures=("Qwen3_5ForConditionalGeneration",),
                **CAPABILITIES)
class Qwen3_5ForCausalLM(Qwen3_5Names, Qwen3NextForCausalLM):
    """Qwen3.5's language model: gated DeltaNet and gated attention, gated MLPs."""

    transformers_names = MULTIMODAL_NAMES


@register_model("qwen3_5_text", Qwen3_5Config, architectures=("Qwen3_5ForCausalLM",),
                **CAPABILITIES)
class Qwen3_5TextForCausalLM(Qwen3_5Names, Qwen3NextForCausalLM):
    """Qwen3.5's language model as transformers' text-only class saves it."""

    transformers_names = TEXT_NAMES
