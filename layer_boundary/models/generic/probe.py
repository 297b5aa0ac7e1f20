"""The proof the Transformers backend runs before any rank starts: a small copy of the model
(fp32, random weights, the vocabulary cut, one layer of each kind, a short window) through our
path at world 1 and through transformers' own forward; logits that differ beyond fp32
rounding refuse the model by name. What it proves is the restructuring (norms as reads and
post-norm updates, the residual kind, attention through our cache, the rotary tables, the
embedding scale and the logit cap), not the sizes, which the tp_plan's linears take as they
are."""

from __future__ import annotations

import copy
import dataclasses

import torch

from ..config import CheckpointError
from .config import GenericConfig, refuse

VOCAB = 96  # the probe's vocabulary: its embedding and head stay small whatever the model
WINDOW = 3  # a sliding window shorter than the probe's longest prompt
PROMPTS = ((5, 17, 3, 88, 41, 9), (60, 2, 33, 71))
RTOL = 1e-4  # of the logits' scale: fp32 rounding, far below any missing or extra op


def _layers_to_probe(hf) -> int:
    """The first layers that hold one of each kind (``layer_types``), at least two."""
    types = list(getattr(hf, "layer_types", None) or [])
    first = max((types.index(t) for t in set(types)), default=0)
    return min(hf.num_hidden_layers, max(2, first + 1))


def probe_config(cfg: GenericConfig) -> GenericConfig:
    """``cfg`` cut to the probe's size (transformers' config copied, not changed)."""
    hf = copy.deepcopy(cfg.hf)
    layers = _layers_to_probe(hf)
    hf.num_hidden_layers, hf.vocab_size = layers, VOCAB
    if getattr(hf, "layer_types", None):
        hf.layer_types = list(hf.layer_types)[:layers]
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(hf, name, None), int) and getattr(hf, name) >= VOCAB:
            setattr(hf, name, None)
    if isinstance(getattr(hf, "sliding_window", None), int):
        hf.sliding_window = WINDOW
    return dataclasses.replace(cfg, hf=hf, vocab_size=VOCAB, num_hidden_layers=layers,
                               forms=cfg.forms[:layers])


def _reference(hf):
    from transformers import AutoModelForCausalLM

    hf = copy.deepcopy(hf)
    model = AutoModelForCausalLM.from_config(hf, attn_implementation="eager",
                                             dtype=torch.float32)
    if hasattr(model, "set_experts_implementation"):  # the oracle's loop over experts
        model.set_experts_implementation("eager")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # every weight random (a norm's around 1, so a zero-centred one is not the
            # identity): no op hides behind a zero or a one
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if param.dim() == 1 and "norm" in name
                        else 0.1 * noise)
    return model.eval()


NEXT = (7, 50)  # one cached decode step's token for each prompt


def _ours(model) -> torch.Tensor:
    """Our logits: every position of the prompts in one prefill, then one decode step."""
    from ...runtime.forward_batch import ForwardBatch, ForwardMode

    cache = model.make_kv_cache(len(PROMPTS), max(map(len, PROMPTS)) + 1)
    prefill = ForwardBatch.build(ForwardMode.EXTEND, [list(p) for p in PROMPTS],
                                 [0] * len(PROMPTS), kv_cache=cache)
    decode = ForwardBatch.build(ForwardMode.DECODE, [[t] for t in NEXT],
                                [len(p) for p in PROMPTS], kv_cache=cache)
    with torch.no_grad():
        return torch.cat((model(prefill), model(decode)))


def _theirs(reference) -> torch.Tensor:
    """transformers' logits of the same: each prompt, then its cached decode step."""
    from transformers import DynamicCache

    prefills, steps = [], []
    with torch.no_grad():
        for prompt, token in zip(PROMPTS, NEXT):
            out = reference(torch.tensor([prompt]), cache=DynamicCache(config=reference.config),
                            use_cache=True)
            prefills.append(out.logits[0])
            steps.append(reference(torch.tensor([[token]]), cache=out.cache,
                                   use_cache=True).logits[0])
    return torch.cat(prefills + steps)


def check(cfg: GenericConfig) -> None:
    """Refuse ``cfg``'s model, naming its decoder-layer classes and the difference, where our
    path's logits (a prefill of two prompts at every position, then a cached decode step)
    differ from transformers' beyond fp32 rounding, or where it fails to run."""
    from ...runtime.args import BoundaryRuntime
    from ...runtime.parallel import ParallelDims, build_parallel
    from .model import GenericCausalLM

    small = probe_config(cfg)
    reference = _reference(small.hf)
    classes = (f"{type(reference).__name__}, layers "
               + ", ".join(sorted({type(layer).__name__ for layer in reference.model.layers})))
    try:
        expected = _theirs(reference)
    except Exception as exc:  # noqa: BLE001 - nothing to compare against
        raise refuse(cfg.model_type, f"transformers' own forward fails on the probe's copy "
                     f"({type(exc).__name__}: {exc})") from None
    try:
        with torch.device("cpu"):
            ours = GenericCausalLM(small, BoundaryRuntime(build_parallel(ParallelDims())),
                                   dtype=torch.float32)
        ours.load_weights(reference.state_dict().items())
        logits = _ours(ours.eval())
    except CheckpointError:
        raise  # a refusal already naming what the backend cannot serve
    except Exception as exc:  # noqa: BLE001 - any failure of our path is the refusal
        raise refuse(cfg.model_type, f"{classes} does not run on the generic path "
                     f"({type(exc).__name__}: {exc})") from None
    diff = (logits - expected).abs().max().item()
    scale = max(1.0, expected.abs().max().item())
    if not diff <= RTOL * scale:  # NaN included
        raise refuse(cfg.model_type, f"{classes}, restructured onto the boundaries, differs "
                     f"from transformers' own forward by {diff:.3g} (logits up to {scale:.3g}): "
                     "an op the generic path does not know (a residual or embedding "
                     "multiplier, an extra norm, another equation)")
