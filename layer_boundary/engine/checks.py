"""What ``run`` and ``plan`` check before any rank starts: the combinations of features, the
adapters, the pipeline split and the prompt lengths (each a one-line ``UsageError``)."""

from __future__ import annotations

from .args import UsageError, compiling, speculative


def refuse_combinations(feature: str, options) -> None:
    """``feature`` against (flag, given) pairs of what it does not combine with yet: one
    line naming every flag given."""
    given = [flag for flag, on in options if on]
    if given:
        raise UsageError(f"{feature} does not combine with {', '.join(given)} yet")


def check_moe_a2a(args, model_cls, attn_tp: int, policy: str) -> None:
    """``--moe-a2a-backend`` against the model, the features it does not combine with yet and
    the resolved ``policy`` (one line each, before any rank starts)."""
    backend = args.moe_a2a_backend
    if backend == "none":
        return
    flag = f"--moe-a2a-backend {backend}"
    try:
        model_cls.check_moe_a2a(backend)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    refuse_combinations(flag, (
        (f"--cp {args.cp}", args.cp > 1), ("--sequence-parallel", args.sequence_parallel),
        ("--attn-input-scattered", args.attn_input_scattered), ("--compile", compiling(args)),
        ("speculative decoding", speculative(args))))
    if attn_tp > 1 and policy == "ar":
        raise UsageError(f"{flag} dispatches from rows no other rank holds: with attention TP "
                         f"{attn_tp} those are the scattered rows, and --boundary-reduction ar "
                         "has none (use rs, rsv or rs+rsv, or --dp equal to --tp)")


def check_variants(args, model_cls, policy: str) -> None:
    """The batch-variant options against each other, the features they do not combine with
    yet, the resolved ``policy`` and the model (one line each, before any rank starts)."""
    features = [name for name, on in ((f"--cp {args.cp}", args.cp > 1),
                                      ("--sequence-parallel", args.sequence_parallel),
                                      ("--attn-input-scattered", args.attn_input_scattered))
                if on]
    if not features:
        return
    if len(features) > 1:
        raise UsageError(f"{features[0]} does not combine with {features[1]} yet")
    feature = features[0]
    refuse_combinations(feature, (
        ("--pp", args.pp > 1), ("--tbo", args.tbo),
        ("--split-prefill", getattr(args, "split_prefill", 1) > 1),
        ("--compile", args.cp > 1 and compiling(args)),
        ("speculative decoding", speculative(args))))
    if args.cp == 1 and policy == "ar":
        raise UsageError(f"{feature} needs a scattered residual: --boundary-reduction ar "
                         "permits no reduce-scatter (use rs, rsv or rs+rsv)")
    from ..contracts import BatchVariant

    model_cls.check_variants({BatchVariant.SEQUENCE_PARALLEL} if args.sequence_parallel
                             else {BatchVariant.INPUT_SCATTERED} if args.attn_input_scattered
                             else set())


def check_lora(args, prompts, cfg, model_cls, dims) -> tuple[tuple, tuple]:
    """``--lora`` and ``--prompt-lora`` against each other, the prompts, the model (each
    adapter attached to a weightless copy of rank 0's model) and the features they do not
    combine with yet: (adapters, each prompt's adapter name)."""
    import torch

    from ..adapters.lora import LoraError, attach_lora, lora_slots
    from ..runtime.args import BoundaryRuntime
    from ..runtime.parallel import virtual_parallel

    adapters = tuple(args.lora or ())
    chosen = tuple(args.prompt_lora or ())
    if not adapters:
        if chosen:
            raise UsageError("--prompt-lora needs adapters: load them with --lora NAME=DIR")
        return (), ()
    if chosen and len(chosen) != len(prompts):
        raise UsageError(f"--prompt-lora is given {len(chosen)} times for {len(prompts)} "
                         "prompts: give it once per prompt, in prompt order")
    refuse_combinations("--lora", (
        (f"--cp {args.cp}", args.cp > 1), ("--sequence-parallel", args.sequence_parallel),
        ("--compile", compiling(args)), ("speculative decoding", speculative(args))))
    try:
        lora_slots([name for name, _ in adapters], chosen)
        with torch.device("meta"):  # the targets and shards checked, no weights materialized
            attach_lora(model_cls(cfg, BoundaryRuntime(virtual_parallel(dims))), adapters)
    except LoraError as exc:
        raise UsageError(str(exc)) from None
    return adapters, chosen


def check_lengths(checkpoint, prompts, max_new_tokens: int) -> None:
    """Prompts and generations that fit the checkpoint's positions (config.json's
    max_position_embeddings, read from the ``Checkpoint``)."""
    limit = checkpoint.raw.get("max_position_embeddings")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        return
    for i, p in enumerate(prompts):
        if len(p) > limit:
            raise UsageError(f"prompt {i} has {len(p)} tokens; the checkpoint's "
                             f"max_position_embeddings is {limit}")
    longest = max(map(len, prompts))
    if longest + max_new_tokens > limit:
        raise UsageError(f"--max-new-tokens {max_new_tokens} after a {longest}-token prompt "
                         f"needs {longest + max_new_tokens} positions; the checkpoint's "
                         f"max_position_embeddings is {limit}")


def check_pipeline(args, cfg, model_cls) -> None:
    """Bad --pp / --pp-layers against the model's layers, before any rank starts."""
    from ..models.pipeline import split_layers

    if args.pp_layers is not None and args.pp == 1 and len(args.pp_layers) != 1:
        raise UsageError(f"--pp-layers {','.join(map(str, args.pp_layers))} needs --pp "
                         f"{len(args.pp_layers)}")
    if getattr(args, "compile", False) or getattr(args, "compile_backend", None):
        if args.pp > 1:
            raise UsageError("--compile does not support --pp > 1 yet")
    split_layers(model_cls.decoder_layers(cfg), args.pp, args.pp_layers)

