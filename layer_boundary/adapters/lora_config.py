"""A PEFT LoRA ``adapter_config.json``, read as peft (0.21) reads it.

The fields, their defaults and their refusals are peft's ``LoraConfig``
(``peft/tuners/lora/config.py``); which modules an adapter adapts is peft's
``check_target_module_exists`` (``peft/tuners/tuners_utils.py``), with ``all-linear`` as
``_maybe_include_all_linear_layers`` and a missing ``target_modules`` as peft's per-model
defaults; a module's rank and alpha are ``rank_pattern``/``alpha_pattern``'s first matching
key (``get_pattern_key``, ``peft/utils/other.py``), its scaling alpha / r (alpha / sqrt(r) with
``use_rslora``). A field peft would apply and this module does not is refused by name.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

try:
    from re import _parser as _sre  # the pattern parser re compiles with (Python 3.11+)
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre


class LoraError(ValueError):
    """An adapter that cannot be applied to this model, named with what is wrong."""


_log = logging.getLogger("layer_boundary.adapters.lora")
_WARNED: set[str] = set()


def warn_once(msg: str, *args) -> None:
    """A warning about an adapter, once per process: the command line reads each adapter in
    its check and again in its world-1 reference run."""
    text = msg % args
    if text not in _WARNED:
        _WARNED.add(text)
        _log.warning("%s", text)


# LoraConfig fields that change what a loaded adapter computes and that are not implemented
# here: each refused by name when set
_REFUSED = ("use_dora", "fan_in_fan_out", "modules_to_save", "layer_replication", "lora_bias",
            "trainable_token_indices", "target_parameters", "velora_config",
            "alora_invocation_tokens", "monteclora_config", "use_bdlora", "arrow_config",
            "kasa_config")
# LoraConfig fields with no effect on a loaded adapter's forward through an unquantized linear
_INERT = {"peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path",
          "revision", "inference_mode", "lora_dropout", "megatron_config", "megatron_core",
          "loftq_config", "eva_config", "corda_config", "lora_ga_config", "use_qalora",
          "qalora_group_size", "runtime_config", "ensure_weight_tying"}
_READ = {"r", "lora_alpha", "use_rslora", "bias", "init_lora_weights", "target_modules",
         "exclude_modules", "layers_to_transform", "layers_pattern", "rank_pattern",
         "alpha_pattern"}
# initializations peft runs again on load that rewrite the base weight (or make a variant)
_BASE_REWRITING = ("pissa", "corda", "olora", "loftq", "lora_ga", "mica")
# peft's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for the model types served here
# (the others have no entry: peft refuses a config without target_modules for them)
_DEFAULT_TARGETS = {"llama": ["q_proj", "v_proj"], "mistral": ["q_proj", "v_proj"],
                    "mixtral": ["q_proj", "v_proj"], "gemma3_text": ["q_proj", "v_proj"],
                    "qwen3": ["q_proj", "v_proj"], "gpt_neox": ["query_key_value"],
                    "nemotron_h": ["q_proj", "k_proj", "v_proj", "o_proj"]}
_OUTPUT_HEAD = "lm_head"  # what all-linear leaves out (the output embedding)
# peft 0.21 on transformers 5 (transformers_weight_conversion._convert_peft_config_moe): on
# these model types a target naming an expert projection or the router (v4 names; all-linear
# names them all) becomes a LoRA on transformers' stacked experts' parameters
# (target_parameters) and no longer names any module, a dense layer's or shared expert's of
# that name included. {model type: {target name: transformers' parameter it becomes}}
_MIXTRAL_MOE = {"gate": "gate.weight", "w1": "gate_up_proj", "w3": "gate_up_proj",
                "w2": "down_proj"}
_QWEN2_MOE = {"gate": "gate.weight", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
              "down_proj": "down_proj"}
MOE_CONVERTED = {"mixtral": _MIXTRAL_MOE, "minimax_m2": _MIXTRAL_MOE,
                 **dict.fromkeys(("deepseek_v2", "deepseek_v3", "glm4_moe", "longcat_flash",
                                  "qwen3_moe", "qwen3_next"), _QWEN2_MOE)}


def _number(x) -> bool:
    """A finite number that a float holds (JSON's integers are unbounded: 10**400 is not)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def _rank(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _strings(x) -> bool:
    return isinstance(x, list) and all(isinstance(s, str) for s in x)


def _backtracks(regex: str) -> bool:
    """Whether ``regex`` repeats (``*``, ``+``, ``{n,}``) a part holding an alternation or
    another repetition: the shape whose backtracking grows exponentially with the name
    (``(.|.)*Z``, ``(a+)+``). Read from the parsed pattern, not its text."""
    repeats = (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", None))

    def walk(items, inside_repeat: bool) -> bool:
        for op, av in items:
            if op in repeats:
                low, high, sub = av
                if high > 1 and (inside_repeat or walk(sub, True)):
                    return True
                if high <= 1 and walk(sub, inside_repeat):
                    return True
            elif op is _sre.BRANCH:
                if inside_repeat or any(walk(b, inside_repeat) for b in av[1]):
                    return True
            elif op is _sre.SUBPATTERN:
                if walk(av[-1], inside_repeat):
                    return True
            elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
                if walk(av[1], inside_repeat):
                    return True
        return False

    try:
        return walk(_sre.parse(regex), False)
    except (re.error, RecursionError):
        return False  # compile() names it


@dataclass(frozen=True)
class AdapterConfig:
    """What ``adapter_config.json`` says an adapter adapts, and by how much."""

    r: int
    alpha: float
    rslora: bool
    init: object
    targets: list | str  # names (exact, or a suffix after a "."), or a full-match regex
    exclude: list | str | None
    layers: list | int | None
    layers_pattern: list | str | None
    rank_pattern: dict
    alpha_pattern: dict

    def targets_module(self, key: str) -> bool:
        """Whether peft adapts the module ``key`` (the base model's name, e.g.
        ``model.layers.0.self_attn.q_proj``)."""
        if isinstance(self.exclude, str):
            if re.fullmatch(self.exclude, key):
                return False
        elif self.exclude and (key in self.exclude or
                               any(key.endswith(f".{e}") for e in self.exclude)):
            return False
        if isinstance(self.targets, str):
            if self.targets.lower() == "all-linear":
                return key != _OUTPUT_HEAD
            return re.fullmatch(self.targets, key) is not None
        if key in self.targets:
            return True
        if not any(key.endswith(f".{t}") for t in self.targets):
            return False
        layers = self.layers
        if layers is None or layers == []:
            return True
        if not self.layers_pattern:  # None, "" or []: the first numbered segment
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            patterns = ([self.layers_pattern] if isinstance(self.layers_pattern, str)
                        else self.layers_pattern)
            for pattern in patterns:
                match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
                if match is not None:
                    break
        if match is None:
            return False
        index = int(match.group("idx"))
        return index == layers if isinstance(layers, int) else index in layers

    def rank_alpha(self, key: str) -> tuple[int, float]:
        """The module's (r, alpha): the first ``rank_pattern``/``alpha_pattern`` key that
        matches the end of its name, else ``r``/``lora_alpha``."""
        def pick(patterns: dict, default):
            for pattern in patterns:
                if re.match(rf"(.*\.)?({pattern})$", key):
                    return patterns[pattern]
            return patterns.get(key, default)

        return pick(self.rank_pattern, self.r), pick(self.alpha_pattern, self.alpha)

    def scaling(self, key: str) -> float:
        r, alpha = self.rank_alpha(key)
        return alpha / (math.sqrt(r) if self.rslora else r)

    def moe_converted(self, model_type: str | None, names=None) -> str | None:
        """The first target peft converts into a LoRA on stacked experts for
        ``model_type`` (``MOE_CONVERTED``), or None. A regex is matched, as peft resolves it,
        against transformers' module and parameter names (``names``: its parameter names;
        None: not known, a regex is not checked) and each stacked parameter's old per-expert
        names."""
        mapping = MOE_CONVERTED.get(model_type)
        if not mapping:
            return None
        if isinstance(self.targets, list):
            return next((t for t in self.targets for old in mapping
                         if t == old or t.endswith(f".{old}")), None)
        if self.targets.lower() == "all-linear":
            return "all-linear"
        if names is None:
            return None
        keys = set()
        for name in names:
            parts = name.split(".")
            keys.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
            container, _, leaf = name.rpartition(".")
            keys.update(f"{container}.{old}" for old, new in mapping.items() if new == leaf)
        return next((k for k in sorted(keys)
                     if k.rpartition(".")[2] in mapping and self.targets_module(k)), None)


def _check_regexes(label: str, targets, exclude, pattern, ranks: dict, alphas: dict) -> None:
    """Every regex the config's matching compiles (its targets and exclusions as given,
    ``layers_pattern`` and the pattern keys as peft wraps them): valid, and none that
    backtracks exponentially."""
    regexes = [("target_modules", targets)] if isinstance(targets, str) else []
    regexes += [("exclude_modules", exclude)] if isinstance(exclude, str) else []
    regexes += [(name, rf"(.*\.)?({k})$") for name, d in (("rank_pattern", ranks),
                                                           ("alpha_pattern", alphas)) for k in d]
    for p in ([pattern] if isinstance(pattern, str) else pattern or []):
        regexes.append(("layers_pattern", rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\."))
    for name, regex in regexes:
        try:
            re.compile(regex)
        except (re.error, RecursionError) as exc:
            raise LoraError(f"{label}: {name} holds an invalid regex ({exc})") from None
        if _backtracks(regex):
            raise LoraError(f"{label}: {name} regex {regex!r} repeats a part that itself "
                            "alternates or repeats, which can take exponential time to match "
                            "a module name (peft would hang on it): write it without the "
                            "nested repetition")


def read_config(folder: Path, label: str, model_type: str | None) -> tuple[AdapterConfig, list]:
    """``folder``'s adapter_config.json: (the config, the keys peft would ignore).

    Args:
        folder: the PEFT adapter folder.
        label: "LoRA adapter NAME", which starts every error.
        model_type: the base model's, for peft's default ``target_modules``.
    """
    if not folder.is_dir():
        raise LoraError(f"{label}: {folder} is not a folder" if folder.exists() else
                        f"{label}: no such folder {folder}")
    f = folder / "adapter_config.json"
    if not f.is_file():
        raise LoraError(f"{label}: no adapter_config.json in {folder}")
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError as exc:
        raise LoraError(f"{label}: {f} is not JSON ({exc.msg} at line {exc.lineno} column "
                        f"{exc.colno})") from None
    except (OSError, UnicodeDecodeError, RecursionError) as exc:
        raise LoraError(f"{label}: {f} is not readable JSON text ({type(exc).__name__})") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{label}: {f} is a JSON {type(cfg).__name__}, not an object")

    def bad(field: str, what: str):
        return LoraError(f"{label}: {field} must be {what}, got {cfg[field]!r}")

    if "peft_type" not in cfg:
        raise LoraError(f"{label}: {f} has no peft_type (peft reads the adapter type there)")
    if cfg["peft_type"] != "LORA":
        raise LoraError(f"{label}: peft_type {cfg['peft_type']!r} is not LORA")
    for key in _REFUSED:
        if cfg.get(key):
            raise LoraError(f"{label}: {key}={cfg[key]!r} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"{label}: bias={cfg['bias']!r} is not supported")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING):
        raise LoraError(f"{label}: init_lora_weights={init!r} is not supported (peft redoes "
                        "that initialization from the base weights when it loads the adapter)")
    if not (isinstance(init, bool) or init in ("eva", "orthogonal") or
            (isinstance(init, str) and init.lower() == "gaussian")):
        raise bad("init_lora_weights", "true, false or an initialization peft knows")
    r, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)  # LoraConfig's defaults
    if not _rank(r):
        raise bad("r", "a positive integer")
    if not _number(alpha):
        raise bad("lora_alpha", "a finite number")
    if not isinstance(cfg.get("use_rslora", False), bool):
        raise bad("use_rslora", "true or false")
    # inert in a forward that does not train, but peft builds torch.nn.Dropout(lora_dropout),
    # which refuses anything but a probability: so does loading it here
    dropout = cfg.get("lora_dropout", 0.0)
    if not (_number(dropout) and 0 <= dropout <= 1):
        raise bad("lora_dropout", "a probability between 0 and 1 (peft builds a "
                                  "torch.nn.Dropout of it)")
    targets = cfg.get("target_modules")
    if targets is None:
        if model_type not in _DEFAULT_TARGETS:
            raise LoraError(f"{label}: target_modules is not set, and peft has no default "
                            f"target modules for model type {model_type!r}")
        targets = _DEFAULT_TARGETS[model_type]
    elif not (isinstance(targets, str) or _strings(targets)):
        raise bad("target_modules", "a list of module names or a regex")
    exclude = cfg.get("exclude_modules")
    if not (exclude is None or isinstance(exclude, str) or _strings(exclude)):
        raise bad("exclude_modules", "a list of module names or a regex")
    layers, pattern = cfg.get("layers_to_transform"), cfg.get("layers_pattern")
    if isinstance(targets, str) and layers is not None:
        raise LoraError(f"{label}: layers_to_transform cannot be used when target_modules is "
                        "a str")
    if isinstance(targets, str) and pattern is not None:
        raise LoraError(f"{label}: layers_pattern cannot be used when target_modules is a str")
    if pattern and layers is None:
        raise LoraError(f"{label}: layers_pattern is set, and layers_to_transform is not")
    if not (layers is None or (isinstance(layers, int) and not isinstance(layers, bool)) or
            (isinstance(layers, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                              for i in layers))):
        raise bad("layers_to_transform", "a layer index or a list of them")
    if not (pattern is None or isinstance(pattern, str) or _strings(pattern)):
        raise bad("layers_pattern", "a name or a list of names")
    ranks, alphas = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    if not (isinstance(ranks, dict) and all(_rank(v) for v in ranks.values())):
        raise bad("rank_pattern", "an object of positive integer ranks")
    if not (isinstance(alphas, dict) and all(_number(v) for v in alphas.values())):
        raise bad("alpha_pattern", "an object of finite numbers")
    _check_regexes(label, targets, exclude, pattern, ranks, alphas)
    ignored = sorted(set(cfg) - set(_REFUSED) - _INERT - _READ)
    return AdapterConfig(r, alpha, cfg.get("use_rslora", False), init, targets, exclude,
                         layers, pattern, ranks, alphas), ignored
