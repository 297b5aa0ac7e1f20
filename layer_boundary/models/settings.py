"""Config fields declared once: each field of a model's config dataclass says, where it is
declared, how config.json gives it (``setting``): its check, its default, the names it goes
by, and what a null means. ``CheckedConfig`` (``config.py``) validates config.json with those
checks and reads the fields with them (``CheckedConfig.read``); a model's reader adds what a
setting cannot say (a rope dict, per-layer windows).

``DecoderConfig`` holds the sizes every dense decoder reads alike; Llama's config
(``llama.py``) builds on it, and the other dense models build on Llama's.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass

from .config import (BOOL, FINITE_NUMBER, FRACTION, INT_LIST, POSITIVE_INT, POSITIVE_NUMBER,
                     SETTING, SHARED, Check, CheckedConfig, CheckpointError, require)


@dataclass(frozen=True)
class Derived:
    """A field computed from the fields read before it (``of(values)``), where config.json
    leaves it out or sets null (transformers' None: derive it); ``what`` says how."""

    of: Callable[[dict], object]
    what: str


class Null(enum.Enum):
    """What a config.json null means for a setting (transformers reads it as None)."""

    DEFAULT = "the field's default"  # a flag, a list, a field whose default is None
    DERIVE = "derived"  # a derived field (a head_dim, as many kv heads as heads)
    REFUSE = "refused by name"  # a number no model computes with as None


@dataclass(frozen=True)
class Setting:
    """How one config field is read from config.json (declared with ``setting()``).

    Args:
        check: what a value must be (None: ``SHARED``'s check of that name); ``validate``
            runs it, so does ``read`` (a config read unvalidated refuses it alike), and it
            says how a value reads: a flag as a bool, a number as a float, a
            list of integers as a tuple, anything else as it is.
        default: the value where config.json leaves the field out (unless ``required``).
        required: no default: derived where ``derive`` says how, else refused by name
            (``config.json has no <name>``).
        derive: how the field is computed from the fields before it.
        names: the names config.json gives it, the first present one read (): its own.
        null: what a null means; None: derived where ``derive`` says how, the default for a
            flag, a list or a field defaulting to None, refused for a number or a count.
    """

    check: Check | None = None
    default: object = None
    required: bool = False
    derive: Derived | None = None
    names: tuple = ()
    null: Null | None = None

    def read(self, cfg: dict, name: str, before: dict):
        """Field ``name``'s value in ``cfg`` (``before``: the fields read before it)."""
        names = self.names or (name,)
        given = next((n for n in names if n in cfg), names[-1])
        check = self.check or SHARED.get(given)
        value = cfg.get(given)
        if value is not None:
            if self.check is not None and not self.check.ok(value):  # as ``validate`` says
                raise CheckpointError(f"config.json field {given} must be {self.check.what}, "
                                      f"got {value!r}")
            if check is BOOL:
                return bool(value)
            if check is INT_LIST:
                return tuple(value)
            if check in (POSITIVE_NUMBER, FRACTION, FINITE_NUMBER):
                return float(value)
            return require(cfg, given) if self.required and check is POSITIVE_INT else value
        if given not in cfg:  # left out
            if not self.required:
                return self.default
            if self.derive is not None:
                return self.derive.of(before)
            raise CheckpointError(f"config.json has no {given}")
        null = self.null or (Null.DERIVE if self.derive else Null.DEFAULT
                             if check in (BOOL, INT_LIST) or self.default is None
                             else Null.REFUSE)
        if null is Null.DERIVE:
            return self.derive.of(before)
        if null is Null.DEFAULT and not self.required:
            return self.default
        if self.required and self.derive is None:
            raise CheckpointError(f"config.json has no {given}")
        what = self.derive.what if self.derive else f"the default {self.default}"
        raise CheckpointError(f"config.json field {given} is null: give a number, or leave it "
                              f"out for {what}")


def setting(default=dataclasses.MISSING, check: Check | None = None, *,
            derive: Derived | None = None, names: tuple = (), null: Null | None = None,
            unread=dataclasses.MISSING):
    """A config dataclass field read from config.json as ``Setting`` says; its dataclass
    default is ``default`` (a field without one is keyword-only, so a required or derived
    setting may follow defaulted ones), or ``unread``: the value of a required setting a
    reader leaves unread (``CheckedConfig.read``'s ``unread``: the heads of a hybrid model
    without attention layers)."""
    required = default is dataclasses.MISSING
    spec = Setting(check, None if required else default, required, derive, names, null)
    if required and unread is dataclasses.MISSING:
        return dataclasses.field(kw_only=True, metadata={SETTING: spec})
    return dataclasses.field(default=unread if required else default, metadata={SETTING: spec})


# the derivations transformers applies where config.json leaves a size out
PER_HEAD = Derived(lambda v: v["hidden_size"] // v["num_attention_heads"],
                   "hidden_size / num_attention_heads")
AS_MANY_AS_HEADS = Derived(lambda v: v["num_attention_heads"], "num_attention_heads")
# a flag transformers tests for truth (``if config.norm_topk_prob``): a null reads as false
NULL_IS_FALSE = Derived(lambda v: False, "false")


@dataclass(frozen=True)
class DecoderConfig(CheckedConfig):
    """The sizes of a decoder, read alike by every dense model: the vocabulary, the width,
    the MLP's, the layers, the query heads (required), the key/value heads (as many as the
    query heads where config.json leaves them out) and a head's width (``hidden_size /
    num_attention_heads`` where it does)."""

    vocab_size: int = setting()
    hidden_size: int = setting()
    intermediate_size: int = setting()
    num_hidden_layers: int = setting()
    num_attention_heads: int = setting()
    num_key_value_heads: int = setting(derive=AS_MANY_AS_HEADS)
    head_dim: int = setting(derive=PER_HEAD)
