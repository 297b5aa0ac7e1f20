"""The command line's arguments: the parser of ``layer-boundary run | plan | bench`` and the
readers of its values. Only what parsing needs is imported here, so ``--help`` and
``--version`` answer before torch loads."""

from __future__ import annotations

import argparse

from ..runtime.defaults import BOUNDARY_REDUCTIONS, START_TIMEOUT_S
from .fusion_providers import FUSION_PROVIDERS
from .logs import LEVELS


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


def _bounded(most: int, why: str, multiple: int = 1, why_multiple: str = ""):
    """A positive integer of at most ``most`` (``why``: what the refusal adds after the bound)
    and a multiple of ``multiple`` (``why_multiple``: after that refusal)."""
    def parse(text: str) -> int:
        value = _positive(text)
        if value > most:
            raise argparse.ArgumentTypeError(f"{value} is more than {most}{why}")
        if value % multiple:
            raise argparse.ArgumentTypeError(f"{value} is not a multiple of {multiple}"
                                             f"{why_multiple}")
        return value
    return parse


# a sweep starts each layout's ranks as processes on this one machine (and lists every
# layout up to the bound before it starts one): more ranks than this are not a one-host job
MAX_SWEEP_WORLD = 64

# the longest wait either timeout takes: past it a timedelta overflows, and a job that waits
# a week on a silent peer has not been watched
LONGEST_WAIT_S = 7 * 24 * 3600.0


def _seconds(low: float, why: str = ""):
    """A number of seconds in [``low``, a week]."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not value > 0 or value > LONGEST_WAIT_S:
            raise argparse.ArgumentTypeError(f"{text} must be a positive number of seconds, at "
                                             f"most {LONGEST_WAIT_S:.0f} (a week)")
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} must be at least {low:g} s{why}")
        return value
    return parse


_positive_seconds = _seconds(0.0)
# a collective on a busy machine can wait longer than this for a healthy peer; gloo then fails
# every rank at once
_collective_seconds = _seconds(1.0, " (shorter waits end healthy jobs on a busy machine)")


def _prompt_ids(text: str) -> tuple[int, ...]:
    items = text.split(",")
    if len(items) > 1 and not all(t.strip() for t in items):  # "1,,2" was read as 1,2
        raise argparse.ArgumentTypeError(f"--prompt-ids {text!r} has an empty id between "
                                         "its commas")
    try:
        ids = tuple(int(t) for t in items if t.strip())
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
    """The ``layer-boundary`` parser: ``run``, ``plan``, ``sweep`` and ``bench``."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="layer-boundary", description="Stage boundaries for parallel transformer inference: "
        "run a checkpoint on CPU ranks and check it against one rank (run), print the "
        "boundary paths a batch takes (plan), run every accepted layout against one rank "
        "(sweep), or time the boundary against a hand-written forward (bench).",
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"layer-boundary {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    log_level = argparse.ArgumentParser(add_help=False)  # every command takes it
    log_level.add_argument("--log-level", choices=LEVELS, default="info", type=str.lower,
                           help="what the command says while it works (its report always "
                                "prints)")
    _run_parser(sub, log_level)
    _plan_parser(sub, log_level)
    _sweep_parser(sub, log_level)
    _bench_parser(sub, log_level)
    return parser


def _run_parser(sub, log_level) -> None:
    """``run``'s options (the order here is --help's)."""
    run = sub.add_parser("run", formatter_class=_HelpFormatter, parents=[log_level],
                         help="generate on parallel CPU ranks and check parity with world 1")
    _topology_args(run)
    _variant_args(run)
    _policy_arg(run)
    _request_args(run)
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
    _device_args(run)
    _fusion_arg(run)
    _check_args(run)
    _pipeline_args(run)
    run.add_argument("--split-prefill", type=_positive, default=1,
                     help="run each stage's prefill in this many layer-range segments")
    _timeout_args(run)
    run.add_argument("--tbo", nargs="?", const="auto", choices=("auto", "always"),
                     default=None,
                     help="two-batch overlap: a forward as two interleaved microbatches where "
                          "the overlap pays (auto, the default: collectives on their own "
                          "hardware, NCCL, and tokens in both halves on every DP rank; never "
                          "on gloo's CPU ranks), or every forward (always)")
    _speculative_args(run)


def _request_args(run) -> None:
    """What ``run`` generates: the prompts, their adapters, the dtype and the length."""
    run.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                     help="the dtype weights and activations run in (auto: the checkpoint's "
                          "config.json dtype, float32 where it names none)")
    run.add_argument("--prompt-ids", type=_prompt_ids, action="append", default=None,
                     help='token ids of one prompt, e.g. "1,2,3" (repeatable)')
    run.add_argument("--prompt", action="append", default=None,
                     help="a text prompt (repeatable; needs tokenizer.json in the checkpoint)")
    run.add_argument("--lora", type=_lora_arg, action="append", default=None,
                     metavar="NAME=DIR", help="load a PEFT LoRA adapter under NAME: a folder "
                                              "or a Hugging Face repo id, as --model takes "
                                              "(repeatable)")
    run.add_argument("--prompt-lora", action="append", default=None, metavar="NAME|none",
                     help="the adapter of one prompt, given once per prompt in prompt order "
                          "(none: the base model; default: every prompt on the base model)")
    run.add_argument("--max-new-tokens", type=_positive, default=4,
                     help="tokens generated per prompt, the prefill's included")


def _fusion_arg(run) -> None:
    run.add_argument("--fusions", "--fusion-provider", dest="fusion_provider",
                     choices=FUSION_PROVIDERS,
                     default=None, help="install a fusion provider on every rank's model: "
                                        "triton (add + RMSNorm kernels after each arriving "
                                        "sum, on every row mode, and the terminal service; "
                                        "on the CPU under the Triton interpreter), reference "
                                        "(torch-op all-reduce + add + norm candidates), "
                                        "reference-terminal (also the final norm's terminal "
                                        "service), decline (asked, declines every candidate)")


def _timeout_args(run) -> None:
    """How long ``run`` waits on a silent peer and on a starting rank."""
    run.add_argument("--collective-timeout", type=_collective_seconds, default=None,
                     metavar="SECONDS",
                     help="how long a collective waits for a silent peer before the job ends "
                          "(default 45 s; 15 s under torchrun; 900 s with --compile)")
    run.add_argument("--start-timeout", type=_positive_seconds, default=None, metavar="SECONDS",
                     help="how long a rank may take to start (import, load, join) before the "
                          f"job ends naming it; start-up is not silence (default "
                          f"{START_TIMEOUT_S:.0f} s)")


def _speculative_args(run) -> None:
    run.add_argument("--draft-model", default=None,
                     help="speculative decoding: a draft checkpoint with the target's vocabulary")
    run.add_argument("--speculative-algorithm", choices=("draft", "nextn"), default=None,
                     help="draft: --draft-model proposes; nextn: the target DeepSeek-V3's own "
                          "NextN/MTP layer proposes (default: draft with --draft-model)")
    run.add_argument("--speculative-steps", type=_positive, default=3,
                     help="draft tokens proposed per verification forward")
    run.add_argument("--speculative-boundary-reduction", choices=BOUNDARY_REDUCTIONS,
                     default="auto", help="the draft stack's own boundary-reduction policy")


def _plan_parser(sub, log_level) -> None:
    """``plan``'s options: run's topology flags, and the batch shape."""
    plan = sub.add_parser("plan", formatter_class=_HelpFormatter, parents=[log_level],
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


def _bench_parser(sub, log_level) -> None:
    """``bench``'s options."""
    bench = sub.add_parser("bench", formatter_class=_HelpFormatter, parents=[log_level],
                           help="boundary overhead against a hand-written decoder")

    # the benchmark times a fixed cost per stage, which these sizes measure; past them it
    # builds for minutes, or for longer than the machine's memory lasts
    def upto(most: int, multiple: int = 1, why: str = ""):
        return _bounded(most, ", the most the benchmark takes", multiple, why)

    # 8 attention heads (engine.bench.BENCH_HEADS) of an even head_dim: the rotary turns
    # pairs of each head's dims (hidden 8 has head_dim 1: "not enough values to unpack")
    bench.add_argument("--hidden", type=upto(4096, 16, " (8 attention heads of an even "
                                                 "head_dim, which the rotary turns in pairs)"),
                       default=256, help="the benchmark model's hidden size (a multiple of "
                                         "16, at most 4096)")
    bench.add_argument("--layers", type=upto(128), default=8,
                       help="its decoder layers (at most 128)")
    bench.add_argument("--requests", type=upto(1024), default=16,
                       help="requests in the decode step (at most 1024)")
    bench.add_argument("--repeats", type=upto(1000), default=30,
                       help="timed forwards of each kind, interleaved (at most 1000)")
    bench.add_argument("--compile", choices=("inductor", "aot_eager", "eager"), default=None,
                       help="run both forwards under torch.compile(fullgraph=True)")
    bench.add_argument("--model-impl", choices=MODEL_IMPLS, default="auto",
                       help="the benchmark model's implementation: auto or native (our Qwen3 "
                            "model file), or transformers (the transformers backend: "
                            "transformers' own Qwen3 layers on the boundaries); both forwards "
                            "run its modules")


def _sweep_parser(sub, log_level) -> None:
    """``sweep``'s options."""
    sweep = sub.add_parser("sweep", formatter_class=_HelpFormatter, parents=[log_level],
                           help="run every layout the capability check accepts against one "
                                "world-1 run: verdicts, bytes, the exactly-once audit")
    sweep.add_argument("--model",
                       help="a Hugging Face checkpoint folder or repo id (default: the "
                            "built-in tiny Qwen3)")
    model_impl_arg(sweep)
    sweep.add_argument("--max-world", type=_bounded(MAX_SWEEP_WORLD, " (rank processes at once "
                                                    "on this machine)"), default=8,
                       help="the largest world size tried (1, 2, 4, ... up to it; at most "
                            f"{MAX_SWEEP_WORLD}: each layout starts that many rank processes "
                            "on this machine)")
    sweep.add_argument("--features", nargs="?", const="sample", default=None,
                       metavar="sample|all|NAMES",
                       help="cross the layouts with the features a run may turn on beside "
                            "them (tbo, split-prefill, fusions-reference, fusions-triton, "
                            "compile, lora, draft, batch-invariant), each against world 1: "
                            "sample (the flag alone) runs each feature on one layout of each "
                            "kind, all on every layout, NAMES (comma-separated) those "
                            "features on the sample")
    sweep.add_argument("--budget", type=_positive_seconds, default=None, metavar="SECONDS",
                       help="start no layout after this many seconds; the table says which "
                            "were left out")
    sweep.add_argument("--max-new-tokens", type=_positive, default=2,
                       help="tokens generated per prompt in each layout, the prefill's "
                            "included")
    sweep.add_argument("--prompt-ids", type=_prompt_ids, action="append", default=None,
                       help='token ids of one prompt, e.g. "1,2,3" (repeatable; default: '
                            "run's three)")
    sweep.add_argument("--json", action="store_true",
                       help="print one JSON object (one row a layout)")


# which implementation serves a checkpoint (``models.checkpoint.IMPLS``, named here without
# importing torch): vLLM's and SGLang's --model-impl
MODEL_IMPLS = ("auto", "native", "transformers")


def model_impl_arg(parser) -> None:
    """``--model-impl``: which implementation serves the checkpoint."""
    parser.add_argument("--model-impl", choices=MODEL_IMPLS, default="auto",
                        help="which implementation serves the model (vLLM's and SGLang's "
                             "flag): native (our own model file for config.json's "
                             "model_type), transformers (the transformers backend: "
                             "transformers' own decoder layers on the boundaries, each "
                             "linear split as the config's base_model_tp_plan says, checked "
                             "against transformers' forward at load), or auto (native where "
                             "we have a model file, else transformers)")


def _device_args(run) -> None:
    """Where ``run``'s ranks compute, and its CUDA graphs."""
    run.add_argument("--disable-cuda-graph", "--enforce-eager", dest="disable_cuda_graph",
                     action="store_true",
                     help="with --device cuda, run decode steps eagerly instead of replaying a "
                          "CUDA graph per token bucket (and, with --compile, without "
                          "inductor's graphs); SGLang's name, or vLLM's --enforce-eager. "
                          "Graphs are off anyway where a collective runs on gloo; on the CPU "
                          "there are none to disable")
    run.add_argument("--captured-decode", choices=("inductor", "eager"), default=None,
                     help="what each captured decode graph holds on --device cuda: the step "
                          "compiled by inductor (the default: fewer kernels a layer; each "
                          "token bucket compiles on its first step) or the eager step")
    run.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                     help="where each rank runs: cpu (gloo), or cuda (each rank on the GPU "
                          "LOCAL_RANK names; NCCL where every rank has one, else gloo with "
                          "CUDA tensors)")


def _check_args(run) -> None:
    """What ``run`` checks beyond parity: the ranks' agreement, batch invariance, the
    fusions it requires."""
    run.add_argument("--check-agreement", action="store_true", default=None,
                     help="before each collective, the ranks of its group compare their "
                          "per-forward decisions (rows, row mode, padding, fusion outcomes) "
                          "and the job ends naming the first difference instead of hanging "
                          "(one small exchange a collective; LAYER_BOUNDARY_CHECK_AGREEMENT=1 "
                          "turns it on too)")
    run.add_argument("--batch-invariant", action="store_true",
                     help="a request's logits the same bits alone as in any batch: one "
                          "policy for every batch, sums in group rank order, linear layers "
                          "row by row, attention a request a call; the run also generates "
                          "each prompt alone and fails unless every step's logits match bit "
                          "for bit")
    run.add_argument("--require-fusions", action="store_true",
                     help="make a fusion candidate's decline an error: the run exits 1 "
                          "naming each stage that declined and why, or saying that no stage "
                          "fused at all (needs --fusions)")


def _topology_args(parser) -> None:
    parser.add_argument("--model",
                        help="a Hugging Face checkpoint folder or repo id (the hub's cache "
                             "first; default: the built-in tiny Qwen3)")
    model_impl_arg(parser)
    parser.add_argument("--tp", "--tensor-parallel-size", "--tp-size", dest="tp",
                        type=_positive, default=None, help="tensor-parallel size (default 4)")
    parser.add_argument("--dp", type=_positive, default=None,
                        help="attention data-parallel size, dividing tp (default 2 with the "
                             "default tp, else 1); prompt i runs on DP rank i mod dp "
                             "(SGLang: --enable-dp-attention --dp-size N)")
    parser.add_argument("--dp-size", type=_positive, default=None,
                        help="SGLang's name: with --enable-dp-attention the same as --dp")
    parser.add_argument("--enable-dp-attention", action="store_true",
                        help="SGLang's switch: --dp-size is attention data parallelism")
    parser.add_argument("--data-parallel-size", type=_positive, default=None,
                        help="vLLM's engine replicas: this runs one engine, so only 1 (a no-op) "
                             "is accepted (see --dp)")
    parser.add_argument("--ep", "--ep-size", dest="ep", type=_positive, default=None,
                        help="expert parallelism of MoE layers over the TP ranks (dividing "
                             "tp; default 1)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="vLLM's switch: experts spread over every TP rank (--ep = tp)")
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


def engine_names(args) -> None:
    """Resolve the parallelism flags engine users type (vLLM's and SGLang's names) onto ours,
    in place, or refuse by name where the meaning differs."""
    # one engine replica is what this runs: vLLM's and SGLang's replica counts of 1 are no-ops
    if getattr(args, "data_parallel_size", None) not in (None, 1):
        raise UsageError("--data-parallel-size is vLLM's number of engine replicas; this "
                         "runs one engine. Attention data parallelism inside the TP group is "
                         "--dp N (SGLang: --enable-dp-attention --dp-size N)")
    dp_size = getattr(args, "dp_size", None)
    if dp_size == 1 and not getattr(args, "enable_dp_attention", False):
        dp_size = None  # SGLang's one data-parallel replica
    if dp_size is not None:
        if not args.enable_dp_attention:
            raise UsageError("--dp-size without --enable-dp-attention is SGLang's number of "
                             "data-parallel replicas; this runs one engine. For attention "
                             "data parallelism inside the TP group add --enable-dp-attention "
                             "(or pass --dp)")
        if args.dp is not None and args.dp != dp_size:
            raise UsageError(f"--dp {args.dp} and --dp-size {dp_size} disagree; pass one")
        args.dp = dp_size
    elif getattr(args, "enable_dp_attention", False) and args.dp is None:
        raise UsageError("--enable-dp-attention needs --dp-size N (or --dp N): the attention "
                         "data-parallel size")
    if getattr(args, "enable_expert_parallel", False):
        tp = tp_dp(args)[0]
        if args.ep is not None and args.ep != tp:
            raise UsageError(f"--enable-expert-parallel spreads experts over every TP rank "
                             f"(--ep {tp}); --ep {args.ep} says otherwise: pass one")
        args.ep = tp
    if hasattr(args, "ep") and args.ep is None:
        args.ep = 1


def compiling(args) -> bool:
    return bool(getattr(args, "compile", False) or getattr(args, "compile_backend", None))


def speculative(args) -> bool:
    return bool(getattr(args, "draft_model", None) or getattr(args, "speculative_algorithm", None))


def tp_dp(args) -> tuple[int, int]:
    """The topology ``run`` and ``plan`` derive from the same flags: the default job is tp=4
    dp=2; an explicit --tp alone means pure tensor parallelism."""
    return args.tp or 4, args.dp or (1 if args.tp else 2)


def _pipeline_args(parser) -> None:
    parser.add_argument("--pp", "--pipeline-parallel-size", "--pp-size", dest="pp",
                        type=_positive, default=1,
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
        raise argparse.ArgumentTypeError(
            f"--tokens {text!r} must be comma-separated integers") from None
    if min(counts) < 0:
        raise argparse.ArgumentTypeError(f"--tokens {text!r} has a negative count")
    return counts


def _lora_arg(text: str) -> tuple[str, str]:
    name, sep, folder = text.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"--lora {text!r} must be NAME=DIR")
    return name, folder
