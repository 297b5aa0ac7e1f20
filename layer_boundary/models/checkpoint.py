"""A checkpoint folder with its config.json read once: the raw dict, the parsed config and
the model class serving it, handed along instead of the folder so nothing reads it again."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from ..runtime.args import resolve_boundary_reduction
from . import config as config_json
from .config import CheckpointError
from .registry import auto_policy, model_class

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """One Hugging Face checkpoint folder, its config.json read and checked once.

    Args:
        folder: the checkpoint folder (config.json + safetensors).
        raw: config.json as read.
        config: the model's config, parsed from ``raw`` after its fields were checked.
        model_class: the class serving ``raw``'s ``model_type``.
        memo: what was checked or read of it once and need not be again
            (``estimate.check_sizes``, ``tensor_facts``).
    """

    folder: str
    raw: dict
    config: object
    model_class: type
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def model_type(self) -> str:
        """config.json's ``model_type`` (the Transformers backend serves many)."""
        if self.model_class.impl == "transformers":
            return self.config.model_type
        return self.model_class.model_type

    @property
    def impl(self) -> str:
        """Which implementation serves it: "native" (our model file) or "transformers"."""
        return self.model_class.impl

    def tensor_facts(self) -> dict:
        """{tensor: (shape, safetensors dtype)} from the safetensors headers, read once."""
        from .loader import header_facts

        if "header_facts" not in self.memo:
            self.memo["header_facts"] = header_facts(self.folder)
        return self.memo["header_facts"]

    def run_dtype(self) -> str:
        """What ``--dtype auto`` runs in: config.json's ``dtype`` (``torch_dtype`` in older
        files), float32 where it names none; another dtype (float16) is refused by name:
        auto means the checkpoint's own dtype, which this library does not compute in."""
        named = self.raw.get("dtype", self.raw.get("torch_dtype"))
        if named in (None, "float32", "bfloat16"):
            return named or "float32"
        raise ValueError(f"{self.folder}/config.json: dtype {named!r}; --dtype auto runs float32 "
                         "or bfloat16 checkpoints: pass --dtype float32 (or bfloat16)")

    def auto_policy(self) -> tuple[str, str]:
        """What ``--boundary-reduction auto`` resolves to, and what decided it
        (``registry.auto_policy``; the Transformers backend's own policy where it serves)."""
        if self.impl == "transformers":
            return self.model_class.boundary_reduction, "the transformers backend"
        return auto_policy(self.raw)

    def boundary_reduction(self, value: str) -> str:
        """``value`` (ar | rs | rsv | rs+rsv | auto) resolved for this checkpoint."""
        return resolve_boundary_reduction(value, self.auto_policy()[0])


def open_checkpoint(path, impl: str = "auto") -> Checkpoint:
    """The checkpoint at ``path``: config.json read once, its fields checked, then parsed.

    Args:
        path: the checkpoint folder, or a ``Checkpoint`` (returned as it is).
        impl: which implementation serves it (``--model-impl``): "native" our model file of
            its ``model_type``, "transformers" the Transformers backend (``models.generic``:
            its probe runs here, once, before any rank starts), "auto" ours where we have
            one, else the Transformers backend.
    """
    if isinstance(path, Checkpoint):
        return path
    impl = _impl(impl)
    raw = config_json.read_config(path)  # the one read of config.json
    cls = _serving_class(raw, impl)
    cls.config_class.validate(raw)
    memo: dict = {}
    config = _tied_as_stored(path, cls.config_class.from_dict(raw), memo,
                             cls.transformers_names)
    if cls.impl == "transformers":
        from .generic.probe import check

        check(config)
    return Checkpoint(str(path), raw, config, cls, memo)


IMPLS = ("auto", "native", "transformers")


def _impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"model impl {impl!r} is not one of {', '.join(IMPLS)}")
    return impl


def _serving_class(raw: dict, impl: str) -> type:
    """The class serving config.json ``raw`` under ``impl``."""
    from .registry import model_types

    model_type = raw.get("model_type")
    if impl == "auto" and model_type in model_types():
        return model_class(model_type)
    if impl == "native":
        try:
            return model_class(model_type)
        except CheckpointError as exc:
            if not _transformers_knows(model_type):
                raise
            raise CheckpointError(f"{exc}; --model-impl auto or transformers serves it "
                                  "through the Transformers backend") from None
    if impl == "auto" and not _transformers_knows(model_type):
        model_class(model_type)  # the error naming the types we serve
    from .generic.model import GenericCausalLM

    return GenericCausalLM


# a head and an input embedding as checkpoints name them (GPT-NeoX: embed_out, embed_in)
_HEADS = ("lm_head.weight", "embed_out.weight")
_EMBEDDINGS = ("embed_tokens.weight", "embeddings.weight", "embed_in.weight")


def _tied_as_stored(folder, config, memo: dict, rules=()):
    """``config``, untied where transformers unties it: a ``tie_word_embeddings`` config whose
    checkpoint holds both a head and an embedding with different values (transformers warns
    and keeps both, ``PreTrainedModel.tie_weights``); equal ones stay tied. The head is the
    one transformers reads (``rules``: the model's ``transformers_names``; GPT-NeoX holding
    ``embed_out`` and ``lm_head``: ``embed_out``). The headers it reads are kept in ``memo``
    (``Checkpoint.tensor_facts``)."""
    if not (getattr(config, "tie_word_embeddings", False) and "tie_word_embeddings" in
            {f.name for f in dataclasses.fields(config)}):
        return config
    from ..runtime.hf_names import transformers_tensors
    from ..runtime.shards import whole
    from .loader import header_facts, iter_weights

    facts = memo.setdefault("header_facts", header_facts(folder))
    heads = [n for n in facts if n.endswith(_HEADS)]
    if len(heads) > 1:  # the one transformers reads as its lm_head
        head = transformers_tensors(rules, facts, config).get("lm_head.weight")
        heads = list(head.sources) if head is not None else heads
    names = list(facts)
    embeddings = [n for n in names if n.endswith(_EMBEDDINGS)]
    if len(heads) != 1 or len(embeddings) != 1:
        return config
    tensors = {name: whole(t) for name, t in iter_weights(folder, lazy=True)
               if name in (heads[0], embeddings[0])}
    head, embedding = tensors[heads[0]], tensors[embeddings[0]]
    if head.shape == embedding.shape and bool((head == embedding).all()):
        return config
    log.warning("%s: config.json ties the head to the embedding, and the checkpoint holds %s "
                "and %s with different values: both are loaded, untied, as transformers does "
                "(set tie_word_embeddings false to say so)", folder, heads[0], embeddings[0])
    return dataclasses.replace(config, tie_word_embeddings=False)


def _transformers_knows(model_type) -> bool:
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return False
    return model_type in CONFIG_MAPPING
