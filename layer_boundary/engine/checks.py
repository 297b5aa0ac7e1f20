"""What ``run`` and ``plan`` check of their arguments beyond the table of combination rules
(``engine.features.check_spec``, which both ask too): the adapters against the prompts and the
model, the pipeline split and the prompt lengths, each a one-line ``UsageError`` before any
rank starts."""

from __future__ import annotations

from .args import UsageError


def check_lora(spec) -> None:
    """``--lora`` and ``--prompt-lora`` against each other, the prompts and the model: each
    adapter is attached to a weightless copy of rank 0's model, built as the run builds it.

    Args:
        spec: the run, its combination already checked.
    """
    import torch

    from ..adapters.lora import LoraError, attach_lora, lora_slots
    from ..runtime.parallel import virtual_parallel
    from .runner import runtime_of

    adapters, chosen = spec.lora, spec.prompt_lora
    if not adapters:
        if chosen:
            raise UsageError("--prompt-lora needs adapters: load them with --lora NAME=DIR")
        return
    if chosen and len(chosen) != len(spec.prompts):
        raise UsageError(f"--prompt-lora is given {len(chosen)} times for {len(spec.prompts)} "
                         "prompts: give it once per prompt, in prompt order")
    try:
        lora_slots([name for name, _ in adapters], chosen)
        runtime = runtime_of(spec, virtual_parallel(spec.dims()))
        with torch.device("meta"):  # the targets and shards checked, no weights materialized
            model = spec.checkpoint.model_class(spec.checkpoint.config, runtime)
            attach_lora(model, adapters, spec.checkpoint)
    except LoraError as exc:
        raise UsageError(str(exc)) from None


def check_ep(args, checkpoint) -> None:
    """``--ep`` on a checkpoint without routed experts: the library runs it (there is nothing
    to split), so it is no combination rule, but the flag does nothing here and is refused as
    a usage error."""
    cfg = checkpoint.config
    dense = not (getattr(cfg, "n_routed_experts", 0) or getattr(cfg, "num_experts", 0))
    if dense and getattr(args, "enable_expert_parallel", False):
        args.ep = 1  # vLLM's switch: MoE layers only, a dense model is served as it is
    if args.ep > 1 and dense:
        raise UsageError(f"--ep {args.ep} splits MoE experts over ranks; the "
                         f"{checkpoint.model_type} checkpoint {checkpoint.folder} has none")


def check_token_ids(checkpoint, prompts) -> None:
    """Every prompt's token ids inside the checkpoint's vocabulary."""
    vocab = checkpoint.config.vocab_size
    for i, p in enumerate(prompts):
        bad = [t for t in p if t >= vocab]
        if bad:
            raise UsageError(f"prompt {i} has token ids {bad} outside vocab_size={vocab}")


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


def check_pipeline(args, checkpoint) -> None:
    """Bad --pp / --pp-layers against the model's layers, before any rank starts."""
    from ..models.pipeline import split_layers

    if args.pp_layers is not None and args.pp == 1 and len(args.pp_layers) != 1:
        raise UsageError(f"--pp-layers {','.join(map(str, args.pp_layers))} needs --pp "
                         f"{len(args.pp_layers)}")
    split_layers(checkpoint.model_class.decoder_layers(checkpoint.config), args.pp,
                 args.pp_layers)


def job_memory(spec, reference: bool = True):
    """``spec``'s memory on this machine (``models.estimate``): each pipeline stage's first
    rank built on the meta device of a virtual topology, for the run's prompts and tokens,
    plus the world-1 reference run where ``reference``; its checkpoint's config.json checked
    against its tensors first.

    Args:
        spec: the run, its combination already checked.
        reference: whether a world-1 reference runs beside the ranks.
    """
    from ..models.estimate import estimate
    from ..runtime.parallel import virtual_parallel
    from .runner import DTYPES, runtime_of

    dims = spec.dims()
    runtimes = [runtime_of(spec, virtual_parallel(dims, stage * dims.tp))
                for stage in range(dims.pp)]
    longest = max(len(p) for p in spec.prompts)
    steps = min(spec.speculative_steps, spec.max_new_tokens)  # speculative_generate's bound
    positions = longest + spec.max_new_tokens + (steps + 1 if spec.speculative else 0)
    return estimate(spec.checkpoint, runtimes, DTYPES[spec.dtype], len(spec.prompts),
                    positions, sum(len(p) for p in spec.prompts), spec.world_size, reference,
                    packed=spec.device == "cpu")


def check_speculative_steps(checkpoint, prompts, max_new_tokens: int, steps: int) -> None:
    """Room for the verification's extra positions within max_position_embeddings: a round
    proposes ``min(steps, max_new_tokens)`` draft tokens (``speculative_generate``: a proposal
    past the tokens emitted is never used)."""
    steps = min(steps, max_new_tokens)
    limit = checkpoint.raw.get("max_position_embeddings")
    need = max(map(len, prompts)) + max_new_tokens + steps + 1  # the verification's rows
    if isinstance(limit, int) and not isinstance(limit, bool) and need > limit:
        raise UsageError(f"--speculative-steps {steps} needs {need} positions (the longest "
                         f"prompt, --max-new-tokens and a verification of {steps + 1}); the "
                         f"checkpoint's max_position_embeddings is {limit}")
