"""``layer-boundary run | plan``: the main job and its report.

``run`` spawns its own CPU ranks (gloo on loopback), or joins the ranks ``torchrun`` started.
Only rank 0 reports, through logging.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys

# only what parsing needs: a command imports torch and the package when it runs, so --help
# and --version answer before torch loads
from .runtime.defaults import BOUNDARY_REDUCTIONS, START_TIMEOUT_S

log = logging.getLogger("layer_boundary")


class UsageError(ValueError):
    """A bad command-line argument."""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive, finite number of seconds")
    return value


def _prompt_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids {text!r} must be comma-separated integers") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"--prompt-ids {text!r} needs non-negative token ids")
    return ids


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help states its default, unless the text already says it (a default
    derived from other flags is written out there) or the option is a switch."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, False, argparse.SUPPRESS)
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="layer-boundary", description="Stage boundaries for parallel transformer inference: "
        "run a checkpoint on CPU ranks and check it against one rank (run), print the "
        "boundary paths a batch takes (plan), or time the boundary against a hand-written "
        "forward (bench).",
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"layer-boundary {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", formatter_class=_HelpFormatter,
                         help="generate on parallel CPU ranks and check parity with world 1")
    _topology_args(run)
    _variant_args(run)
    _policy_arg(run)
    run.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                     help="the dtype weights and activations run in")
    run.add_argument("--prompt-ids", type=_prompt_ids, action="append", default=None,
                     help='token ids of one prompt, e.g. "1,2,3" (repeatable)')
    run.add_argument("--prompt", action="append", default=None,
                     help="a text prompt (repeatable; needs tokenizer.json in the checkpoint)")
    run.add_argument("--lora", type=_lora_arg, action="append", default=None,
                     metavar="NAME=DIR", help="load a PEFT LoRA adapter folder under NAME "
                                              "(repeatable)")
    run.add_argument("--prompt-lora", action="append", default=None, metavar="NAME|none",
                     help="the adapter of one prompt, given once per prompt in prompt order "
                          "(none: the base model; default: every prompt on the base model)")
    run.add_argument("--max-new-tokens", type=_positive, default=4,
                     help="tokens generated per prompt, the prefill's included")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    run.add_argument("--logits-out", help="write per-prompt, per-step logits (safetensors)")
    run.add_argument("--no-reference", action="store_true", help="skip the world-1 parity run")
    run.add_argument("--no-allreduce-fusion", action="store_true",
                     help="complete every FFN all-reduce in compute instead of deferring it")
    run.add_argument("--no-rs-padding", action="store_true",
                     help="forbid padding rows for fixed-size reduce-scatter (rs falls back)")
    run.add_argument("--compile", action="store_true",
                     help="run each rank's forward under torch.compile(fullgraph=True) "
                          "(inductor); parity is checked against eager world 1")
    run.add_argument("--compile-backend", choices=("inductor", "aot_eager", "eager"),
                     default=None, help="the torch.compile backend (implies --compile)")
    _pipeline_args(run)
    run.add_argument("--split-prefill", type=_positive, default=1,
                     help="run each stage's prefill in this many layer-range segments")
    run.add_argument("--collective-timeout", type=_positive_seconds, default=None,
                     metavar="SECONDS",
                     help="how long a collective waits for a silent peer before the job ends "
                          "(default 45 s; 15 s under torchrun; 900 s with --compile)")
    run.add_argument("--start-timeout", type=_positive_seconds, default=None, metavar="SECONDS",
                     help="how long a rank may take to start (import, load, join) before the "
                          f"job ends naming it; start-up is not silence (default "
                          f"{START_TIMEOUT_S:.0f} s)")
    run.add_argument("--tbo", action="store_true",
                     help="two-batch overlap: each forward as two interleaved microbatches")
    run.add_argument("--draft-model", default=None,
                     help="speculative decoding: a draft checkpoint with the target's vocabulary")
    run.add_argument("--speculative-algorithm", choices=("draft", "nextn"), default=None,
                     help="draft: --draft-model proposes; nextn: the target DeepSeek-V3's own "
                          "NextN/MTP layer proposes (default: draft with --draft-model)")
    run.add_argument("--speculative-steps", type=_positive, default=3,
                     help="draft tokens proposed per verification forward")
    run.add_argument("--speculative-boundary-reduction", choices=BOUNDARY_REDUCTIONS,
                     default="auto", help="the draft stack's own boundary-reduction policy")

    plan = sub.add_parser("plan", formatter_class=_HelpFormatter,
                          help="print the per-stage boundary paths for a batch shape")
    _topology_args(plan)  # the same flags as run's: plan shows the topology run would run
    _variant_args(plan)
    _policy_arg(plan)
    plan.add_argument("--tokens", type=_token_counts, default=None,
                      help='tokens per attention-DP rank, e.g. "5,0,3,1" (default: 4 per rank)')
    plan.add_argument("--no-allreduce-fusion", action="store_true",
                      help="plan every FFN all-reduce completed in compute, as run")
    plan.add_argument("--no-rs-padding", action="store_true",
                      help="forbid padding rows for fixed-size reduce-scatter, as run")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--tbo", action="store_true",
                      help="also show the rows of both two-batch-overlap microbatches (each "
                           "DP rank's tokens taken as one-token requests)")
    _pipeline_args(plan)

    bench = sub.add_parser("bench", formatter_class=_HelpFormatter, help="boundary overhead against a hand-written decoder")
    bench.add_argument("--hidden", type=_positive, default=256,
                       help="the benchmark model's hidden size (a multiple of 8)")
    bench.add_argument("--layers", type=_positive, default=8, help="its decoder layers")
    bench.add_argument("--requests", type=_positive, default=16,
                       help="requests in the decode step")
    bench.add_argument("--repeats", type=_positive, default=30,
                       help="timed forwards of each kind, interleaved")
    bench.add_argument("--compile", choices=("inductor", "aot_eager", "eager"), default=None,
                       help="run both forwards under torch.compile(fullgraph=True)")
    return parser


def _topology_args(parser) -> None:
    parser.add_argument("--model",
                        help="Hugging Face checkpoint folder (default: built-in tiny Qwen3)")
    parser.add_argument("--tp", type=_positive, default=None,
                        help="tensor-parallel size (default 4)")
    parser.add_argument("--dp", type=_positive, default=None,
                        help="attention data-parallel size, dividing tp (default 2 with the "
                             "default tp, else 1); prompt i runs on DP rank i mod dp")
    parser.add_argument("--ep", type=_positive, default=1,
                        help="expert parallelism of MoE layers over the TP ranks (dividing tp)")
    parser.add_argument("--cp", type=_positive, default=1,
                        help="attention context parallelism: each DP rank's tokens split over "
                             "this many ranks of its attention group (dp x cp divides tp)")


def _policy_arg(parser) -> None:
    parser.add_argument("--boundary-reduction", choices=BOUNDARY_REDUCTIONS, default="auto",
                        help="which row modes the boundaries may use: ar (all-reduce only), rs, "
                             "rsv, rs+rsv, or auto (the architecture's policy, chosen per batch "
                             "by rows moved)")


def _variant_args(parser) -> None:
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="prefill as a sequence-parallel batch: residual and norms on "
                             "token slices, rows moved inside the column- and row-parallel "
                             "linears (decode runs ordinary batches)")
    parser.add_argument("--attn-input-scattered", action="store_true",
                        help="input-scattered attention (MLA models): the qkv latent runs on "
                             "the scattered rows and only the latent is gathered")
    parser.add_argument("--moe-a2a-backend", choices=("none", "all_to_all"), default="none",
                        help="how MoE layers reach their experts: none (default: the boundary "
                             "gathers every DP rank's rows) or all_to_all (the MoE stays on "
                             "the attention rows and dispatches each routed token)")


def _compiling(args) -> bool:
    return bool(getattr(args, "compile", False) or getattr(args, "compile_backend", None))


def _speculative(args) -> bool:
    return bool(getattr(args, "draft_model", None) or getattr(args, "speculative_algorithm", None))


def _refuse_combinations(feature: str, options) -> None:
    """``feature`` against (flag, given) pairs of what it does not combine with yet: one
    line naming every flag given."""
    given = [flag for flag, on in options if on]
    if given:
        raise UsageError(f"{feature} does not combine with {', '.join(given)} yet")


def _asked(value: str, model_dir) -> str:
    """The policy asked for, as the run and plan headers show it: ``auto`` with what chose
    its policy (the checkpoint's ``architectures`` entry, ``model_type`` or
    ``text_config``)."""
    if value != "auto":
        return value
    from .models import auto_policy, read_config

    return f"auto, by {auto_policy(read_config(model_dir))[1]}"


def _check_moe_a2a(args, model_cls, attn_tp: int, policy: str) -> None:
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
    _refuse_combinations(flag, (
        (f"--cp {args.cp}", args.cp > 1), ("--sequence-parallel", args.sequence_parallel),
        ("--attn-input-scattered", args.attn_input_scattered), ("--compile", _compiling(args)),
        ("speculative decoding", _speculative(args))))
    if attn_tp > 1 and policy == "ar":
        raise UsageError(f"{flag} dispatches from rows no other rank holds: with attention TP "
                         f"{attn_tp} those are the scattered rows, and --boundary-reduction ar "
                         "has none (use rs, rsv or rs+rsv, or --dp equal to --tp)")


def _tp_dp(args) -> tuple[int, int]:
    """The topology ``run`` and ``plan`` derive from the same flags: the default job is tp=4
    dp=2; an explicit --tp alone means pure tensor parallelism."""
    return args.tp or 4, args.dp or (1 if args.tp else 2)


def _a2a_note(backend: str) -> str:
    return "" if backend == "none" else f"  MoE {backend} dispatch"


def _check_variants(args, model_cls, policy: str) -> None:
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
    _refuse_combinations(feature, (
        ("--pp", args.pp > 1), ("--tbo", args.tbo),
        ("--split-prefill", getattr(args, "split_prefill", 1) > 1),
        ("--compile", args.cp > 1 and _compiling(args)),
        ("speculative decoding", _speculative(args))))
    if args.cp == 1 and policy == "ar":
        raise UsageError(f"{feature} needs a scattered residual: --boundary-reduction ar "
                         "permits no reduce-scatter (use rs, rsv or rs+rsv)")
    from .contracts import BatchVariant

    model_cls.check_variants({BatchVariant.SEQUENCE_PARALLEL} if args.sequence_parallel
                             else {BatchVariant.INPUT_SCATTERED} if args.attn_input_scattered
                             else set())


def _pipeline_args(parser) -> None:
    parser.add_argument("--pp", type=_positive, default=1,
                        help="pipeline stages (world = pp x tp, stage-major ranks)")
    parser.add_argument("--pp-layers", type=_layer_counts, default=None,
                        help='layers per stage, e.g. "3,2,2" (default: an even split, the '
                             "remainder on the first stages)")


def _layer_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--pp-layers {text!r} must be comma-separated integers") from None
    return counts


def _token_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens {text!r} must be comma-separated integers") from None
    if min(counts) < 0:
        raise argparse.ArgumentTypeError(f"--tokens {text!r} has a negative count")
    return counts


def _setup_logging(rank: int) -> None:
    logging.raiseExceptions = False  # a closed pipe (e.g. `| head`) is not an error to report
    log.handlers.clear()
    log.propagate = False
    if rank == 0:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    else:
        log.addHandler(logging.NullHandler())
        log.setLevel(logging.CRITICAL + 1)


def _lora_arg(text: str) -> tuple[str, str]:
    name, sep, folder = text.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"--lora {text!r} must be NAME=DIR")
    return name, folder


def _check_lora(args, prompts, cfg, model_cls, dims) -> tuple[tuple, tuple]:
    """``--lora`` and ``--prompt-lora`` against each other, the prompts, the model (each
    adapter attached to a weightless copy of rank 0's model) and the features they do not
    combine with yet: (adapters, each prompt's adapter name)."""
    import torch

    from .adapters.lora import LoraError, attach_lora, lora_slots
    from .runtime.args import BoundaryRuntime
    from .runtime.parallel import virtual_parallel

    adapters = tuple(args.lora or ())
    chosen = tuple(args.prompt_lora or ())
    if not adapters:
        if chosen:
            raise UsageError("--prompt-lora needs adapters: load them with --lora NAME=DIR")
        return (), ()
    if chosen and len(chosen) != len(prompts):
        raise UsageError(f"--prompt-lora is given {len(chosen)} times for {len(prompts)} "
                         "prompts: give it once per prompt, in prompt order")
    _refuse_combinations("--lora", (
        (f"--cp {args.cp}", args.cp > 1), ("--sequence-parallel", args.sequence_parallel),
        ("--compile", _compiling(args)), ("speculative decoding", _speculative(args))))
    try:
        lora_slots([name for name, _ in adapters], chosen)
        with torch.device("meta"):  # the targets and shards checked, no weights materialized
            attach_lora(model_cls(cfg, BoundaryRuntime(virtual_parallel(dims))), adapters)
    except LoraError as exc:
        raise UsageError(str(exc)) from None
    return adapters, chosen


def _tokenizer(model_dir):
    """The checkpoint's ``tokenizer.json`` (what ``--prompt`` encodes with and the report
    decodes with), or the one-line error naming what is missing."""
    from pathlib import Path

    tok_file = Path(model_dir) / "tokenizer.json"
    if not tok_file.is_file():
        raise UsageError(f"--prompt needs {tok_file}; pass --prompt-ids instead")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError("--prompt needs the 'tokenizers' package (pip install "
                         "'layer_boundary[tokenizer]'); or pass --prompt-ids") from None
    return Tokenizer.from_file(str(tok_file))


def _prompts(args, model_dir) -> tuple[tuple[int, ...], ...]:
    prompts = list(args.prompt_ids or [])
    if args.prompt:
        tok = _tokenizer(model_dir)
        prompts += [tuple(tok.encode(text).ids) for text in args.prompt]
    return tuple(prompts)


def _texts(args, spec, run) -> dict | None:
    """With ``--prompt``: each request's prompt and completion decoded by the checkpoint's
    tokenizer (request index -> (prompt text, completion text)); else None."""
    if not args.prompt:
        return None
    tok = _tokenizer(spec.model_dir)
    return {i: (tok.decode(list(spec.prompts[i])), tok.decode(g))
            for i, g in zip(run.request_ids, run.generated)}


# Used when no prompt is given; ids are taken modulo the checkpoint's vocabulary.
DEFAULT_PROMPTS = ((1, 2, 3, 4, 5), (7, 11, 13), (42, 17, 5, 99, 123, 7, 8))


def _spec(args):
    from .runtime.parallel import ParallelDims

    from .models import boundary_reduction, load_config, model_class_of
    from .models.loader import check_fp8_tensors, safetensors_files
    from .models.tiny import builtin_checkpoint
    from .runner import RunSpec

    model_dir = args.model or str(builtin_checkpoint())
    cfg = load_config(model_dir)
    safetensors_files(model_dir)  # a missing weights file is a one-line error before any rank
    check_fp8_tensors(model_dir, getattr(cfg, "fp8_block", None))  # headers only
    if getattr(cfg, "fp8_block", None) and args.sequence_parallel:
        raise UsageError("--sequence-parallel does not combine with an FP8 checkpoint's "
                         "quantized reads yet")
    prompts = _prompts(args, model_dir) or tuple(
        tuple(t % cfg.vocab_size for t in p) for p in DEFAULT_PROMPTS)
    for i, p in enumerate(prompts):
        bad = [t for t in p if t >= cfg.vocab_size]
        if bad:
            raise UsageError(f"prompt {i} has token ids {bad} outside vocab_size={cfg.vocab_size}")
    _check_lengths(model_dir, prompts, args.max_new_tokens)
    if args.logits_out:  # refused now, not after the whole run
        import os
        from pathlib import Path

        target = Path(args.logits_out).resolve()
        if target.is_dir() or not target.parent.is_dir() or not os.access(target.parent,
                                                                           os.W_OK):
            raise UsageError(f"--logits-out {args.logits_out}: cannot write a file there")
    experts = getattr(cfg, "n_routed_experts", 0) or getattr(cfg, "num_experts", 0)
    if args.ep > 1 and not experts:
        raise UsageError(f"--ep {args.ep} splits MoE experts over ranks; the {cfg.model_type} "
                         f"checkpoint {model_dir} has none")
    tp, dp = _tp_dp(args)
    dims = ParallelDims(world_size=args.pp * tp, tp=tp, pp=args.pp, attn_dp=dp,
                        attn_cp=args.cp, moe_ep=args.ep)  # names bad factors
    model_cls = model_class_of(model_dir)
    model_cls.check_topology(cfg, dims)
    _check_pipeline(args, cfg, model_cls)
    policy = boundary_reduction(args.boundary_reduction, model_dir)
    _check_variants(args, model_cls, policy)
    _check_moe_a2a(args, model_cls, dims.attn_tp, policy)
    if args.tbo and (args.pp > 1 or args.split_prefill > 1 or args.compile
                     or args.compile_backend):
        raise UsageError("--tbo runs the whole stack eagerly on one pipeline stage: it does "
                         "not combine with --pp, --split-prefill or --compile yet")
    algorithm = args.speculative_algorithm or ("draft" if args.draft_model else None)
    if algorithm is not None:
        from .runner import check_draft

        if args.tbo or args.pp > 1 or args.split_prefill > 1:
            raise UsageError("speculative decoding does not combine with --tbo, --pp or "
                             "--split-prefill yet")
        if algorithm == "draft":
            if args.draft_model is None:
                raise UsageError("--speculative-algorithm draft needs --draft-model")
            safetensors_files(args.draft_model)
            check_draft(cfg, load_config(args.draft_model), model_class_of(args.draft_model),
                        dims)
        elif args.draft_model is not None:
            raise UsageError("--speculative-algorithm nextn drafts with the target's own NextN "
                             "layer: drop --draft-model")
        elif not model_cls.nextn_layers(cfg):
            raise UsageError(f"--speculative-algorithm nextn needs a checkpoint with its own "
                             f"NextN layer (config.json num_nextn_predict_layers > 0); "
                             f"{model_dir} ({cfg.model_type}) has none")
    lora, prompt_lora = _check_lora(args, prompts, cfg, model_cls, dims)
    return RunSpec(model_dir=str(model_dir), tp=tp, dp=dp, ep=args.ep, cp=args.cp,
                   sequence_parallel=args.sequence_parallel,
                   attn_input_scattered=args.attn_input_scattered,
                   moe_a2a_backend=args.moe_a2a_backend, lora=lora, prompt_lora=prompt_lora,
                   pp=args.pp,
                   pp_layers=args.pp_layers, split_prefill=args.split_prefill, tbo=args.tbo,
                   draft_model=args.draft_model, speculative_algorithm=algorithm,
                   speculative_steps=args.speculative_steps,
                   speculative_boundary_reduction=args.speculative_boundary_reduction,
                   boundary_reduction=args.boundary_reduction, dtype=args.dtype,
                   prompts=prompts, max_new_tokens=args.max_new_tokens,
                   allreduce_fusion=not args.no_allreduce_fusion,
                   rs_padding=not args.no_rs_padding,
                   compile=args.compile_backend or ("inductor" if args.compile else None))


def _check_lengths(model_dir, prompts, max_new_tokens: int) -> None:
    """Prompts and generations that fit the checkpoint's positions (max_position_embeddings)."""
    from .models.loader import read_config

    limit = read_config(model_dir).get("max_position_embeddings")
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


def _check_pipeline(args, cfg, model_cls) -> None:
    """Bad --pp / --pp-layers against the model's layers, before any rank starts."""
    from .models.pipeline import split_layers

    if args.pp_layers is not None and args.pp == 1 and len(args.pp_layers) != 1:
        raise UsageError(f"--pp-layers {','.join(map(str, args.pp_layers))} needs --pp "
                         f"{len(args.pp_layers)}")
    if getattr(args, "compile", False) or getattr(args, "compile_backend", None):
        if args.pp > 1:
            raise UsageError("--compile does not support --pp > 1 yet")
    split_layers(model_cls.decoder_layers(cfg), args.pp, args.pp_layers)


def _report(args, spec, results, reference) -> int:
    from .runtime.ledger import summarize

    from .runner import forward_variants, merge, parity, speculative_summary, verdict_ok

    run = merge(results)
    speculative = speculative_summary(results)
    rank0 = results[0]
    verdict = parity(run, reference) if reference is not None else None
    collectives = summarize(rank0.ledger)
    if args.logits_out:
        from safetensors.torch import save_file

        save_file({f"prompt{i}.step{j}": logit.float().contiguous()
                   for i, steps in zip(run.request_ids, run.logits)
                   for j, logit in enumerate(steps)}, args.logits_out)
    ok, how = (True, "") if verdict is None else verdict_ok(verdict, spec.dtype, run, reference)
    texts = _texts(args, spec, run)
    if args.json:
        log.info(json.dumps({
            "tp": spec.tp, "dp": spec.dp, "ep": spec.ep, "pp": spec.pp,
            "boundary_reduction": rank0.resolved_reduction,
            "dtype": spec.dtype,
            "prompts": [{"prompt_ids": list(spec.prompts[i]), "generated_ids": g,
                         **({"prompt_text": texts[i][0], "generated_text": texts[i][1]}
                            if texts else {})}
                        for i, g in zip(run.request_ids, run.generated)],
            "parity": verdict, "collectives": collectives,
            **({"speculative": speculative} if speculative else {}),
            **({"cp": spec.cp} if spec.cp > 1 else {}),
            **({"moe_a2a_backend": spec.moe_a2a_backend}
               if spec.moe_a2a_backend != "none" else {}),
            **({"variants": [v.value for v in forward_variants(spec)]}
               if forward_variants(spec)[0].value != "ordinary" else {}),
            **({"compile": spec.compile, "compiled_graphs": rank0.compiled_graphs}
               if spec.compile else {})}))
        return 0 if ok else 1
    log.info("layer-boundary run: %s  %stp=%d dp=%d %sep=%d  boundary_reduction=%s (asked %s)  "
             "dtype=%s%s", spec.model_dir, f"pp={spec.pp} " if spec.pp > 1 else "", spec.tp,
             spec.dp, f"cp={spec.cp} " if spec.cp > 1 else "", spec.ep,
             rank0.resolved_reduction, _asked(spec.boundary_reduction, spec.model_dir),
             spec.dtype,
             ("  sequence-parallel prefill" if spec.sequence_parallel else
              "  input-scattered attention" if spec.attn_input_scattered else "")
             + _a2a_note(spec.moe_a2a_backend) + _modes_on(spec)
             + (f"  compiled ({spec.compile}, fullgraph) into {rank0.compiled_graphs} "
                f"graph{'s' * (rank0.compiled_graphs != 1)} on rank 0" if spec.compile else ""))
    for i, g in zip(run.request_ids, run.generated):
        adapter = f" (LoRA {spec.prompt_lora[i]})" if spec.prompt_lora else ""
        log.info("prompt %d %s%s -> generated %s", i, list(spec.prompts[i]), adapter, g)
        if texts:
            log.info("  text: %r -> %r", *texts[i])
    if speculative:
        log.info("speculative (%d draft steps): acceptance %.2f, %.2f tokens per target forward "
                 "per request, %d verification forwards, %d reruns", spec.speculative_steps,
                 speculative["acceptance_rate"], speculative["tokens_per_target_forward"],
                 speculative["target_forwards"], speculative["reruns"])
    if verdict is None:
        log.info("parity: not checked")
    else:
        log.info("parity vs world 1: %s (tokens %s, max |logit diff| %.3g, %s)",
                 "PASS" if ok else "FAIL", "match" if verdict["tokens_match"] else "DIFFER",
                 verdict["max_abs_diff"], how)
    log.info("\nboundary paths (per stage; row mode per forward: %s):",
             ", ".join(f"step {i} {m}" for i, m in enumerate(rank0.modes)))
    for head in (r for r in results if r.rank % spec.tp == 0):  # one rank per pipeline stage
        if spec.pp > 1:
            log.info("pipeline stage %d (ranks %d-%d): layers %d-%d", head.pp_rank, head.rank,
                     head.rank + spec.tp - 1, head.layers[0], head.layers[-1])
        _plan_table(head.plan)
    if spec.compile:
        log.info("\ncollectives: not observed (a compiled forward runs no Python to report "
                 "from; run without --compile for the ledger)")
        return 0 if ok else 1
    log.info("\ncollectives per forward on rank 0 (count x kind, bytes; step 0 = prefill):")
    lines = {}  # step -> its per-site lines
    for step in sorted({e.step for e in rank0.ledger}):
        per_site: dict[str, list] = {}
        for e in rank0.ledger:
            if e.step == step:
                per_site.setdefault(e.site, []).append(e)
        lines[step] = [f"    {site:<22} " + ", ".join(
            f"{v['count']}x {k} {v['bytes']} B" for k, v in summarize(entries).items())
            for site, entries in per_site.items()]
    steps = sorted(lines)
    for step in steps[:2]:
        log.info("  step %d:", step)
        for line in lines[step]:
            log.info("%s", line)
    if len(steps) > 2:  # decode steps past the first: say whether they repeat it
        same = [s for s in steps[2:] if lines[s] == lines[steps[1]]]
        other = [s for s in steps[2:] if s not in same]
        if same:
            log.info("  step%s %s repeat%s step %d", "s" * (len(same) > 1), _span(same),
                     "" if len(same) > 1 else "s", steps[1])
        for step in other:
            log.info("  step %d:", step)
            for line in lines[step]:
                log.info("%s", line)
    log.info("\ncollectives over the run: %s", ", ".join(
        f"{k}: {v['count']} ({v['bytes']} B)" for k, v in collectives.items()) or "none")
    if rank0.ledger:  # the figures above are the logical (ring) bytes
        from .runtime.ledger import wire_total

        log.info("on gloo's wire (its reduce-scatter is an all-reduce, its variable gather is "
                 "padded to the widest rank): %d B, against %d B logical",
                 wire_total(rank0.ledger), sum(e.bytes for e in rank0.ledger))
    return 0 if ok else 1


def _modes_on(spec) -> str:
    """The header's words for the run's other modes that are on."""
    words = []
    if spec.tbo:
        words.append("two-batch overlap")
    if spec.split_prefill > 1:
        words.append(f"prefill in {spec.split_prefill} segments")
    if spec.speculative:
        source = ("its NextN layer" if spec.speculative_algorithm == "nextn"
                  else f"draft {spec.draft_model}")
        words.append(f"speculative ({source}, {spec.speculative_steps} steps)")
    if spec.lora:
        words.append(f"LoRA {', '.join(name for name, _ in spec.lora)}")
    return "".join(f"  {w}" for w in words)


def _span(steps: list[int]) -> str:
    """``2-3`` for consecutive steps, else ``2, 4``."""
    if steps == list(range(steps[0], steps[-1] + 1)) and len(steps) > 1:
        return f"{steps[0]}-{steps[-1]}"
    return ", ".join(map(str, steps))


def _plan_table(rows) -> None:
    labels = [r["stage"] + (f" ({r['mixer']})" if "mixer" in r else "") for r in rows]
    names = max(map(len, labels))
    width = max(len(r["entry"]) for r in rows)
    log.info("  %-*s %-*s  %s", names, "stage", width, "prepare", "exit")
    for label, row in zip(labels, rows):
        log.info("  %-*s %-*s  %s", names, label, width, row["entry"], row["exit"])


PLAN_LEGEND = (
    "legend:",
    "  rows per rank a/b/c: this rank's local rows (its DP rank's tokens) / its scattered "
    "slice of them / every DP rank's rows (CP: local / share / scattered / global)",
    "  replicated: every DP rank's rows on every rank; attn_dp: this DP rank's rows; "
    "attn_tp_scatter: a slice of them per attention-TP rank",
    "  partial: attn_tp sum owed: compute left its sum over attention TP to the next prepare; "
    "X sum left to the next input: the same, by the exit's decision",
    "  all_reduce(g) / reduce_scatter(g) / all_gather(g): one collective over group g; _v: "
    "variable rows per rank; -> : the steps in order",
)


def cmd_plan(args) -> int:
    """The per-stage path table for a batch shape, from construction alone (no ranks run)."""
    import torch

    from .runtime.ledger import summarize
    from .runtime.parallel import ParallelDims

    from .construction import select_mode
    from .contracts import BatchVariant
    from .layout import RowMode
    from .ops import row_facts, table_rows
    from .models import boundary_reduction, load_config, model_class_of
    from .models.tiny import builtin_checkpoint
    from .runner import handoff_contract, plan_rows
    from .runtime.args import BoundaryRuntime
    from .runtime.parallel import virtual_parallel

    _setup_logging(0)
    args.tp, args.dp = _tp_dp(args)
    model_dir = args.model or str(builtin_checkpoint())
    cfg = load_config(model_dir)
    dims = ParallelDims(world_size=args.pp * args.tp, tp=args.tp, pp=args.pp, attn_dp=args.dp,
                        attn_cp=args.cp, moe_ep=args.ep)
    model_cls = model_class_of(model_dir)
    model_cls.check_topology(cfg, dims)
    _check_pipeline(args, cfg, model_cls)
    policy = boundary_reduction(args.boundary_reduction, model_dir)
    _check_variants(args, model_cls, policy)
    _check_moe_a2a(args, model_cls, dims.attn_tp, policy)
    counts = args.tokens if args.tokens is not None else (4,) * args.dp
    if len(counts) != args.dp:
        raise UsageError(f"--tokens gives {len(counts)} DP token counts but --dp is {args.dp}")
    cp = dims.attn_cp > 1
    variant = (BatchVariant.CP if cp else BatchVariant.SEQUENCE_PARALLEL if args.sequence_parallel
               else BatchVariant.INPUT_SCATTERED if args.attn_input_scattered
               else BatchVariant.ORDINARY)
    variants = (variant,) if cp else tuple(dict.fromkeys((BatchVariant.ORDINARY, variant)))
    runtimes, models = [], []
    for stage in range(dims.pp):  # each pipeline stage as its first rank builds it
        runtimes.append(BoundaryRuntime(virtual_parallel(dims, stage * dims.tp),
                                        boundary_reduction=policy,
                                        allreduce_fusion=not args.no_allreduce_fusion,
                                        rs_padding=not args.no_rs_padding,
                                        pp_layers=args.pp_layers, batch_variants=variants,
                                        moe_a2a_backend=args.moe_a2a_backend,
                                        choose_by_bytes=args.boundary_reduction == "auto"))
        with torch.device("meta"):  # boundaries are built at construction; no weights needed
            models.append(model_cls(cfg, runtimes[-1]))
    runtime = runtimes[0]
    # a CP plan takes each DP rank's tokens as one request (the CP mapping cuts requests)
    lens = tuple((c,) if c else () for c in counts) if cp else None
    parts = row_facts(RowMode.AR, counts, runtime.parallel, lens).parts
    try:
        mode, reason = select_mode(runtime, counts, parts, cp, variant)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    table = [dict(row, pp_stage=s) if dims.pp > 1 else row
             for s, m in enumerate(models) for row in plan_rows(m, mode, variant)]
    pipeline = [{"stage": s, "ranks": [s * dims.tp, (s + 1) * dims.tp - 1],
                 "layers": [m.stage.layers[0], m.stage.layers[-1]],
                 "handoff": handoff_contract(models[s + 1], mode) if s + 1 < dims.pp else None}
                for s, m in enumerate(models)] if dims.pp > 1 else None
    def rows_per_rank(mode, counts):
        out = []
        for rank in range(dims.tp):
            rows = row_facts(mode, counts, virtual_parallel(dims, rank), lens)
            out.append({"rank": rank, "dp_rank": rows.dp_rank, "local": rows.local,
                        **({"cp_rank": rows.parallel.attn_cp_rank, "attention": rows.share}
                           if cp else {}),
                        "scattered": rows.scattered, "global": rows.total})
        return out

    per_rank = rows_per_rank(mode, counts)
    microbatches = None
    if args.tbo:
        from .adapters.tbo import split_counts

        microbatches = []
        for name, part in zip("AB", split_counts(tuple((1,) * c for c in counts))):
            part_mode, _ = select_mode(runtime, part)
            microbatches.append({"microbatch": name, "tokens": list(part),
                                 "mode": part_mode.value,
                                 "ranks": rows_per_rank(part_mode, part)})
    movements = table_rows(runtime.parallel, mode, cp)
    if args.json:
        log.info(json.dumps({"tp": dims.tp, "dp": dims.attn_dp, "cp": dims.attn_cp,
                             "attn_tp": dims.attn_tp, "variant": variant.value,
                             "moe_a2a_backend": args.moe_a2a_backend,
                             "boundary_reduction": policy, "tokens": list(counts),
                             "mode": mode.value, "reason": reason, "ranks": per_rank,
                             "stages": table, "movements": movements,
                             **({"pp": dims.pp, "pipeline": pipeline} if pipeline else {}),
                             **({"microbatches": microbatches} if microbatches else {})}))
        return 0
    log.info("layer-boundary plan: %s  tp=%d dp=%d cp=%d attn_tp=%d  boundary_reduction=%s "
             "(asked %s)%s", model_dir, dims.tp, dims.attn_dp, dims.attn_cp, dims.attn_tp, policy,
             _asked(args.boundary_reduction, model_dir), _a2a_note(args.moe_a2a_backend))
    log.info("tokens per DP rank %s -> row mode %s (%s)%s", list(counts), mode.value, reason,
             "" if variant is BatchVariant.ORDINARY else f", {'an' if variant.value[0] in 'aeiou' else 'a'} {variant.value} batch")
    if cp:
        log.info("CP batch: each DP rank's tokens as one request, cut in %d chunks; CP rank r "
                 "attends chunks r and %d-r", 2 * dims.attn_cp, 2 * dims.attn_cp - 1)
        log.info("rows per rank (local / attention / scattered / global): %s", ", ".join(
            f"r{r['rank']} {r['local']}/{r['attention']}/{r['scattered']}/{r['global']}"
            for r in per_rank))
    else:
        log.info("rows per rank (local / scattered / global): %s", ", ".join(
            f"r{r['rank']} {r['local']}/{r['scattered']}/{r['global']}" for r in per_rank))
    for mb in microbatches or ():
        log.info("two-batch overlap, microbatch %s: tokens per DP rank %s -> %s; rows %s",
                 mb["microbatch"], mb["tokens"], mb["mode"], ", ".join(
                     f"r{r['rank']} {r['local']}/{r['scattered']}/{r['global']}"
                     for r in mb["ranks"]))
    if pipeline is None:
        _plan_table(table)
    for p in pipeline or ():
        log.info("pipeline stage %d (ranks %d-%d): layers %d-%d", p["stage"], *p["ranks"],
                 *p["layers"])
        _plan_table([row for row in table if row["pp_stage"] == p["stage"]])
        if p["handoff"]:
            log.info("  -> stage %d: %s", p["stage"] + 1, p["handoff"])
    for line in PLAN_LEGEND:
        log.info("%s", line)
    log.info("\nthe movement table these paths come from (%s mode, this topology):", mode.value)
    for m in movements:
        owed = f"sum over {m['owed']}" if m["owed"] else "complete"
        log.info("  %-16s %-24s -> %-24s %-26s %s", owed, m["from"], m["to"], m["movement"],
                 m["contract"])
    return 0


def _rank_entry(spec):
    import torch

    from .runner import run_rank

    torch.manual_seed(0)
    return run_rank(spec)


def cmd_run(args) -> int:
    from .runtime.parallel import TopologyError

    from .runtime.launch import init_distributed, launched_by_torchrun, spawn
    from .runner import run_rank

    timeout = args.collective_timeout or (
        COMPILE_COLLECTIVE_TIMEOUT_S if (args.compile or args.compile_backend) else None)
    if launched_by_torchrun():
        # no spawner watches these ranks: a silent peer is found by the collective timeout,
        # and torchrun then needs about half a minute to stop the group
        rank, world = init_distributed(timeout_s=timeout or TORCHRUN_COLLECTIVE_TIMEOUT_S,
                                       join_timeout_s=args.start_timeout)
        _setup_logging(rank)
        if args.tp is None:
            args.tp = world // args.pp
        spec = _spec(args)
        if spec.world_size != world:
            raise TopologyError(f"--pp {spec.pp} x --tp {spec.tp} != torchrun world size {world}")
        import torch.distributed as dist

        result = run_rank(spec, world)
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        code = 0
        if rank == 0:
            reference = None if args.no_reference else _reference(spec)
            code = _report(args, spec, gathered, reference)
        dist.barrier()
        dist.destroy_process_group()
        return code
    _setup_logging(0)
    spec = _spec(args)
    if spec.tbo and not args.json:  # spawned gloo ranks on this machine's shared cores
        log.info("note: --tbo on gloo ranks that share CPU cores runs slower than the plain "
                 "forward (docs/features.md, Two-batch overlap); it proves the overlapped schedule's "
                 "numbers, not a speed-up here")
    world = spec.world_size
    if world > 1 and not args.json:  # before the wait: how many processes this starts
        log.info("starting %d rank processes (%stp %d)", world,
                 f"pp {spec.pp} x " if spec.pp > 1 else "", spec.tp)
        log.info("each loads its shard of %s%s", spec.model_dir,
                 f", then compiles its forward with {spec.compile} (the first forward of each "
                 "token bucket; minutes with cold caches)" if spec.compile else "")
    with _stop_on_sigterm():
        options = {"collective_timeout_s": timeout} if timeout else {}
        if args.start_timeout:
            options["start_timeout_s"] = args.start_timeout
        results = [run_rank(spec)] if world == 1 else spawn(_rank_entry, world, spec, **options)
    # world 1 needs no reference of itself, unless it ran compiled or in segments
    own = (world == 1 and spec.compile is None and spec.split_prefill == 1 and not spec.tbo
           and not spec.speculative)
    reference = None if args.no_reference or own else _reference(spec)
    return _report(args, spec, results, reference)


# a compiling rank may reach its first collective minutes after a peer (cold inductor caches)
COMPILE_COLLECTIVE_TIMEOUT_S = 900.0
TORCHRUN_COLLECTIVE_TIMEOUT_S = 15.0


@contextlib.contextmanager
def _stop_on_sigterm():
    """SIGTERM ends the job like Ctrl-C: the spawner stops every rank on its way out."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _reference(spec):
    """The same requests on one rank, in this process (size-1 groups need no torch.distributed)."""
    from dataclasses import replace

    from .runner import merge, run_rank

    return merge([run_rank(replace(spec, tp=1, dp=1, ep=1, cp=1, pp=1, pp_layers=None,
                               split_prefill=1, tbo=False, draft_model=None, speculative_algorithm=None,
                               compile=None), world_size=1)])


def main(argv=None) -> int:
    """The ``layer-boundary`` command (``argv`` None: the process's own arguments, and the
    process ends after it: multiprocessing's resource tracker, which spawned ranks start, is
    stopped and reaped first, so nothing of the run outlives it in its process group)."""
    try:
        return _main(argv)
    finally:
        if argv is None:
            _stop_resource_tracker()


def _stop_resource_tracker() -> None:
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)  # CPython's own
    if stop is not None:
        try:
            stop()
        except (OSError, ChildProcessError):  # already gone
            pass


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    from .construction import UnsupportedBoundary
    from .models.loader import CheckpointError
    from .runtime.parallel import TopologyError
    from .runtime.launch import RankError

    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "bench":
            from .bench import BENCH_HEADS, overhead_with_noise

            if args.hidden % BENCH_HEADS:
                raise UsageError(f"--hidden {args.hidden} must be a multiple of {BENCH_HEADS}, "
                                 "the benchmark model's attention heads")
            _setup_logging(0)
            log.info("timing %d paired decode steps (hidden %d, %d layers, %d requests%s) ...",
                     args.repeats, args.hidden, args.layers, args.requests,
                     f", compiling with {args.compile} first" if args.compile else "")
            result = overhead_with_noise(args.hidden, args.layers, args.requests,
                                         repeats=args.repeats, compile=args.compile)
            log.info("decode step, world 1, hidden %d, %d layers, %d requests%s: boundary %.3f "
                     "ms, hand-written %.3f ms, overhead %+.1f%% (%.1f us per stage)",
                     result["hidden"], result["layers"], result["requests"],
                     f", compiled ({args.compile})" if args.compile else ", eager",
                     result["boundary_ms"], result["hand_written_ms"], 100 * result["overhead"],
                     result["per_stage_us"])
            for kind, (low, mid, high) in result["spread_ms"].items():
                log.info("  %-12s min %.3f / median %.3f / max %.3f ms", kind, low, mid, high)
            if abs(result["overhead"]) <= result["noise"]:
                log.info("warning: the overhead is within the noise (the hand-written forward's "
                         "interquartile range is %.1f%% of its median): raise --repeats or run "
                         "on an idle machine", 100 * result["noise"])
            return 0
    except (CheckpointError, TopologyError, UnsupportedBoundary, UsageError, ValueError) as exc:
        print(f"layer-boundary: error: {exc}", file=sys.stderr)
        return 2
    except RankError as exc:  # a rank crashed, died or fell silent: the job is over
        hint = (" (a rank that imports or loads slowly: --start-timeout SECONDS widens the "
                "start-up window)" if "did not start within" in str(exc) else "")
        print(f"layer-boundary: error: {exc}{hint}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
