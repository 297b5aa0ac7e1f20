"""``layer-boundary sweep``: every layout the capability check accepts for a checkpoint, up to
a world size, run on real ranks against one shared world-1 run.

Engines find a layout's wrong numbers from evaluations (a double sum under attention DP that
scores 0/128); this runs each layout the command line would accept (tensor parallelism,
attention DP, expert parallelism and the all-to-all MoE where the model has experts, context
and sequence parallelism, pipeline stages, each boundary policy, an attention-DP rank with no
request) and gives one table: the verdict against world 1, the largest logit difference, the
bytes rank 0's collectives moved against the least any policy moved for the same layout, and
the exactly-once audit (``engine.audit``). Every layout runs with the agreement check on
(``runtime.agreement``), so ranks that decide apart end with a named error, not a hang.

A layout is what ``run`` takes: the sweep builds each one's arguments and asks
``run_command.spec_from_args``, the checks ``run`` makes before any rank starts; what it
refuses is counted, not run. With features (``sweep_features``) each row is a layout and
a feature run beside it, judged the same way.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .report import IMPL_WORDS, model_record
from .sweep_layouts import POLICIES, Layout, layouts  # noqa: F401 - the sweep's public names

log = logging.getLogger("layer_boundary")
report = logging.getLogger("layer_boundary.report")


@dataclass
class Row:
    layout: Layout
    verdict: str  # PASS, FAIL, ERROR
    detail: str = ""
    max_abs_diff: float | None = None
    bytes: int | None = None
    min_bytes: int | None = None
    exactly_once: str = ""
    feature: str | None = None  # sweep --features: what ran beside the layout

    def name(self) -> str:
        return self.layout.name() + (f" +{self.feature}" if self.feature else "")

    def record(self) -> dict:
        return {"layout": self.name(), **{k: v for k, v in vars(self.layout).items()},
                "feature": self.feature, "verdict": self.verdict, "detail": self.detail,
                "max_abs_diff": self.max_abs_diff, "bytes": self.bytes,
                "min_bytes": self.min_bytes,
                "bytes_over_min": (None if not self.min_bytes else self.bytes / self.min_bytes),
                "exactly_once": self.exactly_once}


def _argv(base: list[str], layout: Layout, prompts, extra=()) -> list[str]:
    argv = ["run", *base, *layout.args(), *extra]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    return argv


def _spec(parser, base: list[str], layout: Layout, prompts, extra=()):
    """``run``'s spec for ``layout`` with ``extra`` arguments (every check ``run`` makes;
    ``parser``: the command line's; a callable: called for them, and what it raises is a
    refusal too), or the refusal's words."""
    from .run_command import spec_from_args

    try:
        args = parser.parse_args(_argv(base, layout, prompts, extra() if callable(extra)
                                       else extra))
        return replace(spec_from_args(args), check_agreement=True), None
    except (ValueError, RuntimeError) as exc:  # UsageError, CapabilityError, TopologyError
        return None, error_words(exc, lines=1, limit=None)  # counted by reason: one line


def _run(spec) -> tuple[list | None, str]:
    """Every rank's result of ``spec`` (spawned ranks beyond world 1), or the error."""
    from ..runtime.launch import spawn
    from .run_command import rank_entry
    from .runner import backend_for, run_rank

    try:
        if spec.world_size == 1:
            return [run_rank(spec)], ""
        return spawn(rank_entry, spec.world_size, spec,
                     backend=backend_for(spec.device, spec.world_size)), ""
    except Exception as exc:  # a failed layout is a row of the table, named
        return None, f"{type(exc).__name__}: {error_words(exc)}"


def error_words(exc: BaseException, lines: int = 2, limit: int | None = 300) -> str:
    """What ``exc`` says, in one line of at most ``limit`` characters: its first ``lines``
    non-empty lines (a ``RankError``'s first is only "a rank failed:", the rank's error the
    next), or its type's name where it says nothing (an empty message ended the sweep in an
    IndexError)."""
    said = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(said[:lines])[:limit] or type(exc).__name__


def _reference_of(spec):
    """What a row's numbers are held against: the same requests (and adapters) on one rank,
    with no variant, feature or provider."""
    from .run_command import reference_run

    return reference_run(replace(spec, moe_a2a_backend="none", sequence_parallel=False,
                                 attn_input_scattered=False, boundary_reduction="auto",
                                 fusions=None))


def _judge(layout: Layout, feature, spec, results, reference) -> Row:
    """A row's verdict, judged as ``run`` judges its own (``verdict.judge``: parity against the
    reference, the exactly-once audit, batch invariance where the row runs it); its detail
    names each check that failed."""
    from .verdict import Status, judge

    outcome = judge(spec, results, reference)
    audited = outcome.audited
    once = ("not audited: " + audited["why"] if not audited["audited"] else
            "PASS" if not audited["violations"] else "; ".join(audited["violations"][:3]))
    failed = [f"{c.name}: {c.reason}" for c in outcome.checks if c.status is Status.FAIL]
    return Row(layout, outcome.status.value, "; ".join(failed),
               outcome.verdict["max_abs_diff"], sum(e.bytes for e in results[0].ledger),
               exactly_once=once, feature=feature)


def sweep(model: str | None, max_world: int, budget: float | None, max_new_tokens: int,
          prompts, progress=None, candidates: list[Layout] | None = None,
          features=None, every: bool = False, model_impl: str = "auto") -> dict:
    """The sweep's rows (``Row.record``), what the capability check refused (and how often for
    each reason), what the budget left out, and what a signal stopped.

    Args:
        model: a checkpoint folder (None: the built-in tiny Qwen3).
        max_world: the largest world size tried (1, 2, 4, ... up to it).
        budget: seconds after which no further row starts (None: no bound).
        max_new_tokens: each row's steps, the prefill's included.
        prompts: the requests (token ids, taken modulo the vocabulary); an empty-DP-rank
            layout runs the first alone.
        progress: called with a line as each row starts (None: nothing said).
        candidates: the layouts to try (default: ``layouts(max_world, ...)`` for the model).
        features: ``sweep_features.SweepFeature``s to cross with layouts (None: layouts
            alone); each runs on ``sweep_features.sample_layouts`` (``every``: on every
            layout, or on ``candidates`` where given).
        model_impl: which implementation serves the model (``--model-impl``: auto, native,
            transformers), in every row.

    A checkpoint or option ``run`` refuses on one rank is refused here, by ``run``'s own
    error, before any row runs. SIGINT or SIGTERM (``run_command.Stopped``) ends the sweep
    after the rows run so far: the result says so (``stopped``) and lists the rest.
    """
    import tempfile

    from ..models import open_checkpoint
    from ..models.tiny import builtin_checkpoint
    from .args import build_parser
    from .run_command import Stopped, spec_from_args
    from .sweep_features import combinations, feature_args, write_adapter

    folder = model or str(builtin_checkpoint())
    checkpoint = open_checkpoint(folder, model_impl)
    cfg = checkpoint.config
    moe = bool(getattr(cfg, "n_routed_experts", 0) or getattr(cfg, "num_experts", 0))
    layers = checkpoint.model_class.decoder_layers(cfg)
    prompts = tuple(tuple(t % cfg.vocab_size for t in p) for p in prompts)
    base = ["--model", folder, "--model-impl", model_impl, "--max-new-tokens",
            str(max_new_tokens)]
    parser = build_parser()
    # run's own checks of the checkpoint and the options, on one rank: what it refuses there
    # it refuses on every layout, so the sweep ends with its error instead of counting it
    spec_from_args(parser.parse_args(_argv(base, Layout(1), prompts)))
    plan = combinations(features, every, max_world, moe, layers, candidates)
    references: dict = {}
    rows, refused, skipped, stopped = [], [], [], None
    started = time.perf_counter()
    done = 0  # rows of the plan finished (run, refused or left out)
    running = None  # the row started and not finished (what a signal interrupts)
    with tempfile.TemporaryDirectory(prefix="layer-boundary-sweep-") as work:
        try:
            adapter = (write_adapter(checkpoint, Path(work) / "adapter") if any(
                c.feature is not None and c.feature.value == "lora" for c in plan) else None)
            adapter = None if adapter is None else str(adapter)
            for combo in plan:
                layout, feature = combo.layout, combo.feature
                # an empty DP rank: one request, on DP rank 0
                asked = prompts[:1] if layout.empty else prompts
                spec, refusal = _spec(parser, base, layout, asked, lambda: feature_args(
                    feature, checkpoint, folder, adapter, len(asked)))
                if spec is None:
                    refused.append({"layout": combo.name(), "why": refusal})
                elif budget is not None and time.perf_counter() - started > budget:
                    skipped.append(combo.name())
                else:
                    running = combo.name()
                    if progress is not None:
                        progress(f"  {running} ...")
                    key = (asked, spec.lora, spec.prompt_lora)
                    if key not in references:
                        references[key] = _reference_of(spec)
                    results, error = _run(spec)
                    name = None if feature is None else feature.value
                    rows.append(Row(layout, "ERROR", error, feature=name) if results is None
                                else _judge(layout, name, spec, results, references[key]))
                    running = None
                done += 1
        except (Stopped, KeyboardInterrupt) as exc:  # the rows so far are the result
            stopped = {"signal": exc.signal if isinstance(exc, Stopped) else "SIGINT",
                       "exit_code": exc.code if isinstance(exc, Stopped)
                       else 128 + signal.SIGINT,
                       "interrupted": running,
                       "not_started": [c.name() for c in plan[done + (running is not None):]]}
    return _result(checkpoint, max_world, features, rows, refused, skipped, stopped,
                   time.perf_counter() - started)


def _result(checkpoint, max_world, features, rows, refused, skipped, stopped,
            seconds) -> dict:
    """The sweep's record: each row (its bytes against the least any policy moved for its
    layout, where no feature ran beside it), the refusals and their count by reason."""
    least: dict = {}
    for row in rows:
        if row.bytes is not None and row.feature is None:
            shape = row.layout.shape
            least[shape] = min(least.get(shape, row.bytes), row.bytes)
    for row in rows:
        if row.bytes is not None and row.feature is None:
            row.min_bytes = least[row.layout.shape]
    by_reason: dict[str, int] = {}
    for r in refused:
        by_reason[r["why"]] = by_reason.get(r["why"], 0) + 1
    passed = sum(r.verdict == "PASS" for r in rows)
    return {"model": checkpoint.folder, **model_record(checkpoint), "max_world": max_world,
            "features": None if features is None else [f.value for f in features],
            # a stopped sweep's verdict is its exit status's: it proved part of its plan
            "verdict": ("STOPPED" if stopped else "NOT_CHECKED" if not rows else
                        "PASS" if passed == len(rows) else "FAIL"),
            "rows": [r.record() for r in rows],
            "refused": refused, "refused_by_reason": by_reason, "skipped": skipped,
            "stopped": stopped, "passed": passed, "run": len(rows), "seconds": seconds}


def print_table(result: dict) -> None:
    rows = result["rows"]
    width = max([len(r["layout"]) for r in rows] + [6])
    what = "combinations" if result.get("features") else "layouts"
    report.info("layer-boundary sweep: %s, worlds up to %d%s: %d %s run, %d passed, %d "
                "refused by the capability check, %d left out by the budget",
                result["model"], result["max_world"],
                f", features {', '.join(result['features'])}" if result.get("features") else "",
                result["run"], what, result["passed"], len(result["refused"]),
                len(result["skipped"]))
    report.info("model: %s (%s)", result["model_type"], IMPL_WORDS[result["model_impl"]])
    if rows:
        report.info("  %-*s  %-7s %-10s %-16s %s", width, "layout", "verdict", "max |diff|",
                    "bytes / least", "exactly once")
    for r in rows:
        diff = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.2e}"
        moved = ("-" if r["bytes"] is None else
                 f"{r['bytes']} / {r['min_bytes']}" if r["min_bytes"] else f"{r['bytes']}")
        report.info("  %-*s  %-7s %-10s %-16s %s%s", width, r["layout"], r["verdict"], diff,
                    moved, r["exactly_once"], f"  ({r['detail']})" if r["detail"] else "")
    if result["refused_by_reason"]:
        report.info("refused by the capability check, by reason:")
        for why, count in sorted(result["refused_by_reason"].items(), key=lambda x: -x[1]):
            report.info("  %3d x %s", count, why)
    if result["skipped"]:
        report.info("left out by --budget: %s", ", ".join(result["skipped"]))
    stopped = result["stopped"]
    if stopped:
        report.info("stopped by %s: %snot started: %s", stopped["signal"],
                    f"interrupted: {stopped['interrupted']}; " if stopped.get("interrupted")
                    else "", ", ".join(stopped["not_started"]) or "none")
        report.info("verdict: STOPPED (by %s after %d %s: %d passed)", stopped["signal"],
                    result["run"], what, result["passed"])
    elif not rows:
        report.info("verdict: NOT_CHECKED (no %s ran: nothing was compared)", what[:-1])
    else:
        report.info("verdict: %s (%d of %d %s passed)", result["verdict"], result["passed"],
                    result["run"], what)


def cmd_sweep(args) -> int:
    """``layer-boundary sweep``: exit 0 when at least one row ran and every row passed; 1
    when one failed or none ran (a sweep that compared nothing proves nothing); 128 + the
    signal's number when SIGINT or SIGTERM stopped it (after its table so far)."""
    from ..models import open_checkpoint
    from ..models.tiny import builtin_checkpoint
    from .args import UsageError
    from .hub import model_folder
    from .checks import check_token_ids
    from .logs import setup_logging
    from .run_command import DEFAULT_PROMPTS
    from .sweep_features import parse_features

    setup_logging(0, args.json)
    features, every = (None, False)
    if args.features is not None:
        try:
            features, every = parse_features(args.features)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    folder = model_folder(args.model)
    if args.prompt_ids:  # the defaults are taken modulo the vocabulary; a user's ids are not
        check_token_ids(open_checkpoint(folder or str(builtin_checkpoint()), args.model_impl),
                        args.prompt_ids)
    prompts = tuple(tuple(p) for p in (args.prompt_ids or DEFAULT_PROMPTS))

    def say(line: str) -> None:  # under --json stdout holds the JSON alone
        log.info("%s", line)

    # a signal raises Stopped (cli's stop_on_sigterm, around the command): sweep() ends there
    result = sweep(folder, args.max_world, args.budget, args.max_new_tokens, prompts,
                   progress=say, features=features, every=every, model_impl=args.model_impl)
    if args.json:
        report.info("%s", json.dumps(result))
    else:
        print_table(result)
    if result["stopped"]:
        return result["stopped"]["exit_code"]
    if not result["run"]:
        print(f"layer-boundary: error: sweep ran no {'combination' if features else 'layout'}"
              f" ({len(result['refused'])} refused by the capability check, "
              f"{len(result['skipped'])} left out by --budget): nothing was compared",
              file=sys.stderr)
        return 1
    return 0 if result["passed"] == result["run"] else 1
