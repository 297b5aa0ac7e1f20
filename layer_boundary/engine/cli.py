"""``layer-boundary run | plan | bench``: the command's entry point.

``run`` spawns its own CPU ranks (gloo on loopback), or joins the ranks ``torchrun`` started;
``plan`` builds on a virtual topology; ``bench`` times the boundary. Bad input ends in one
line on stderr (exit 2), a failed rank in one line too (exit 1). Only rank 0 reports, through
logging.
"""

from __future__ import annotations

import json
import logging
import signal
import sys

# only what parsing needs: a command imports torch and the package when it runs, so --help
# and --version answer before torch loads
from .args import UsageError, build_parser
from .logs import set_level, setup_logging
from .stops import Stopped, stop_on_sigterm

log = logging.getLogger("layer_boundary")  # what bench says while it works
report = logging.getLogger("layer_boundary.report")  # its result


def main(argv=None) -> int:
    """The ``layer-boundary`` command (``argv`` None: the process's own arguments, and the
    process ends after it: multiprocessing's fork server and resource tracker, which spawned
    ranks start, are stopped and reaped first, so nothing of the run outlives it in its
    process group)."""
    try:
        return _main(argv)
    finally:
        if argv is None:
            _stop_helpers()


def _stop_helpers() -> None:
    import os
    import signal
    from multiprocessing import forkserver, resource_tracker

    # the fork server exits when every holder of its liveness pipe has, ranks included: end
    # it now (a rank it forked then sees its parent gone and exits on its own)
    server = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if server is not None:
        try:
            os.kill(server, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
        stop = getattr(helper, "_stop", None)  # CPython's own: closes its pipe, reaps it
        if stop is not None:
            try:
                stop()
            except (OSError, ChildProcessError):  # already gone
                pass


def _json_outcome(verdict: str, message: str, code: int) -> None:
    """``--json``'s one object for an outcome without a report (a refused argument, a named
    error, a failed or stopped job): what a script reads on stdout whatever happened."""
    print(json.dumps({"verdict": verdict, "error": message, "exit_code": code}), flush=True)


def _main(argv) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    # SIGTERM and Ctrl-C stop the command from here on, torch's import included (a second or
    # more: a signal there was a KeyboardInterrupt traceback, or a death with nothing said)
    with stop_on_sigterm():
        try:
            try:
                args = build_parser().parse_args(argv)
            except SystemExit as exc:  # argparse refused the arguments (its message: stderr)
                if exc.code == 2 and as_json:
                    _json_outcome("ERROR", "the arguments were refused (argparse's message "
                                           "is on stderr)", 2)
                raise
            as_json = bool(getattr(args, "json", False))
            return _command(args, as_json)
        except (Stopped, KeyboardInterrupt) as exc:
            # SIGTERM or Ctrl-C (SIGINT): the spawner has stopped the ranks on the way out
            name, code = ((exc.signal, exc.code) if isinstance(exc, Stopped)
                          else ("SIGINT", 128 + signal.SIGINT))
            message = f"stopped by {name}; every rank it started is stopped"
            print(f"layer-boundary: {message}", file=sys.stderr)
            if as_json:
                _json_outcome("STOPPED", message, code)
            return code


def _command(args, as_json: bool) -> int:
    """The command ``args`` name, its named errors each one line on stderr (and ``--json``'s
    object) with its exit status."""
    set_level(getattr(args, "log_level", "info"))
    if getattr(args, "fusion_provider", None) == "triton" or getattr(args, "features", None):
        # without CUDA the kernels run under the interpreter, chosen before anything imports
        # triton (torch's compiler does, and a run may compile); ranks inherit it (a feature
        # sweep may run the Triton provider)
        import torch

        if not torch.cuda.is_available():
            from ..fusions.triton_provider import use_interpreter  # imports no triton

            use_interpreter()
    from ..construction import UnsupportedBoundary
    from ..models.loader import CheckpointError
    from ..runtime.parallel import TopologyError
    from ..runtime.launch import RankError

    try:
        if args.command == "run":
            from .run_command import cmd_run

            return cmd_run(args)
        if args.command == "plan":
            from .plan_command import cmd_plan

            return cmd_plan(args)
        if args.command == "sweep":
            from .sweep import cmd_sweep

            return cmd_sweep(args)
        if args.command == "bench":
            return cmd_bench(args)
    except (CheckpointError, TopologyError, UnsupportedBoundary, UsageError, ValueError) as exc:
        print(f"layer-boundary: error: {exc}", file=sys.stderr)
        if as_json:
            _json_outcome("ERROR", str(exc), 2)
        return 2
    except RankError as exc:  # a rank crashed, died or fell silent: the job is over
        hint = (" (a rank that imports or loads slowly: --start-timeout SECONDS widens the "
                "start-up window)" if "did not start within" in str(exc) else "")
        print(f"layer-boundary: error: {exc}{hint}", file=sys.stderr)
        if as_json:
            _json_outcome("ERROR", f"{exc}{hint}", 1)
        return 1
    return 0


def cmd_bench(args) -> int:
    """``layer-boundary bench``: one paired timing of the boundary against a hand-written
    decoder."""
    from ..models.estimate import memory_budget, size
    from .bench import BENCH_HEADS, bench_bytes, overhead_with_noise
    from .report import IMPL_WORDS

    # the parser bounds each flag; these hold for any args (a caller's own namespace)
    if args.hidden % (2 * BENCH_HEADS):
        raise UsageError(f"--hidden {args.hidden} must be a multiple of {2 * BENCH_HEADS}: "
                         f"{BENCH_HEADS} attention heads of an even head_dim, which the "
                         "rotary turns in pairs")
    impl = getattr(args, "model_impl", "auto")
    if impl == "transformers" and args.compile:
        from ..capabilities import Feature
        from ..models.generic.model import GenericCausalLM

        raise UsageError("bench --compile: the transformers backend (--model-impl "
                         "transformers) does not compile: "
                         f"{GenericCausalLM.refused_features[Feature.COMPILE]}")
    need = bench_bytes(args.hidden, args.layers, args.requests)
    available = memory_budget()  # LAYER_BOUNDARY_MEMORY_GB where set (checked)
    if available is not None and need > available:
        raise UsageError(f"bench --hidden {args.hidden} --layers {args.layers} --requests "
                         f"{args.requests} needs about {size(need)}; this machine has "
                         f"{size(available)} available")
    setup_logging(0)
    log.info("timing %d paired decode steps (hidden %d, %d layers, %d requests%s) ...",
             args.repeats, args.hidden, args.layers, args.requests,
             f", compiling with {args.compile} first" if args.compile else "")
    result = overhead_with_noise(args.hidden, args.layers, args.requests,
                                 repeats=args.repeats, compile=args.compile, model_impl=impl)
    report.info("decode step, world 1, qwen3 (%s), hidden %d, %d layers, %d requests%s: "
                "boundary %.3f ms, hand-written %.3f ms, overhead %+.1f%% (%.1f us per stage)",
                IMPL_WORDS[result["model_impl"]], result["hidden"], result["layers"],
                result["requests"],
                f", compiled ({args.compile})" if args.compile else ", eager",
                result["boundary_ms"], result["hand_written_ms"], 100 * result["overhead"],
                result["per_stage_us"])
    for kind, (low, mid, high) in result["spread_ms"].items():
        report.info("  %-12s min %.3f / median %.3f / max %.3f ms", kind, low, mid, high)
    if abs(result["overhead"]) <= result["noise"]:
        log.warning("warning: the overhead is within the noise (the hand-written forward's "
                    "interquartile range is %.1f%% of its median): raise --repeats or run "
                    "on an idle machine", 100 * result["noise"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
