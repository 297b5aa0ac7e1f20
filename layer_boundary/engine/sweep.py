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
refuses is counted, not run.
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
import time
from dataclasses import dataclass, replace

log = logging.getLogger("layer_boundary")
report = logging.getLogger("layer_boundary.report")

POLICIES = ("auto", "ar", "rs", "rsv")


@dataclass(frozen=True)
class Layout:
    """One layout the sweep tries: the parallel degrees, the MoE dispatch, the batch variant,
    the boundary policy, and whether an attention-DP rank gets no request."""

    tp: int
    dp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    a2a: bool = False
    sp: bool = False
    policy: str = "auto"
    empty: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def shape(self) -> tuple:
        """The layout without its policy: what the bytes are compared within."""
        return replace(self, policy="auto")

    def name(self) -> str:
        parts = [f"tp{self.tp}"] + [f"{k}{v}" for k, v in (("dp", self.dp), ("cp", self.cp),
                                                          ("pp", self.pp), ("ep", self.ep))
                                    if v > 1]
        parts += ["a2a"] * self.a2a + ["sp"] * self.sp + ["empty-dp"] * self.empty
        return " ".join(parts + [self.policy])

    def args(self) -> list[str]:
        """``run``'s arguments for it."""
        out = ["--tp", str(self.tp), "--dp", str(self.dp), "--cp", str(self.cp),
               "--pp", str(self.pp), "--ep", str(self.ep), "--boundary-reduction", self.policy]
        if self.a2a:
            out += ["--moe-a2a-backend", "all_to_all"]
        if self.sp:
            out.append("--sequence-parallel")
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(max_world: int, moe: bool, layers: int) -> list[Layout]:
    """Every layout to try, world sizes 1, 2, 4, ... up to ``max_world``, smallest first."""
    out, world = [], 1
    while world <= max_world:
        for pp in (p for p in _divisors(world) if p <= layers):
            tp = world // pp
            for dp, ep in itertools.product(_divisors(tp), [1, tp] if moe and tp > 1 else [1]):
                for cp in _divisors(tp // dp):
                    for a2a, sp in itertools.product((False, True) if ep > 1 else (False,),
                                                     (False, True) if tp > 1 else (False,)):
                        for policy in POLICIES if tp > 1 else ("auto",):
                            for empty in (False, True) if dp > 1 else (False,):
                                out.append(Layout(tp, dp, cp, pp, ep, a2a, sp, policy, empty))
        world *= 2
    return out


@dataclass
class Row:
    layout: Layout
    verdict: str  # PASS, FAIL, ERROR
    detail: str = ""
    max_abs_diff: float | None = None
    bytes: int | None = None
    min_bytes: int | None = None
    exactly_once: str = ""

    def record(self) -> dict:
        return {"layout": self.layout.name(), **{k: v for k, v in vars(self.layout).items()},
                "verdict": self.verdict, "detail": self.detail,
                "max_abs_diff": self.max_abs_diff, "bytes": self.bytes,
                "min_bytes": self.min_bytes,
                "bytes_over_min": (None if not self.min_bytes else self.bytes / self.min_bytes),
                "exactly_once": self.exactly_once}


def _spec(parser, base: list[str], layout: Layout, prompts):
    """``run``'s spec for ``layout`` (every check ``run`` makes; ``parser``: the command
    line's), or the refusal's words."""
    from .run_command import spec_from_args

    argv = ["run", *base, *layout.args()]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    args = parser.parse_args(argv)
    try:
        return replace(spec_from_args(args), check_agreement=True), None
    except (ValueError, RuntimeError) as exc:  # UsageError, CapabilityError, TopologyError
        return None, str(exc).splitlines()[0]


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
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"


def sweep(model: str | None, max_world: int, budget: float | None, max_new_tokens: int,
          prompts, progress=None, candidates: list[Layout] | None = None) -> dict:
    """The sweep's rows (``Row.record``), what the capability check refused, and what the
    budget left out.

    Args:
        model: a checkpoint folder (None: the built-in tiny Qwen3).
        max_world: the largest world size tried (1, 2, 4, ... up to it).
        budget: seconds after which no further layout starts (None: no bound).
        max_new_tokens: each layout's steps, the prefill's included.
        prompts: the requests (token ids, taken modulo the vocabulary); an empty-DP-rank
            layout runs the first alone.
        progress: called with a line as each layout starts (None: nothing said).
        candidates: the layouts to try (default: ``layouts(max_world, ...)`` for the model).
    """
    from ..models import open_checkpoint
    from ..models.tiny import builtin_checkpoint
    from .args import build_parser
    from .parity import parity, verdict_ok
    from .report import reads_quantized
    from .report import audit_summary
    from .run_command import reference_run
    from .runner import merge

    folder = model or str(builtin_checkpoint())
    checkpoint = open_checkpoint(folder)
    cfg = checkpoint.config
    moe = bool(getattr(cfg, "n_routed_experts", 0) or getattr(cfg, "num_experts", 0))
    layers = checkpoint.model_class.decoder_layers(cfg)
    prompts = tuple(tuple(t % cfg.vocab_size for t in p) for p in prompts)
    base = ["--model", folder, "--max-new-tokens", str(max_new_tokens)]
    parser = build_parser()
    references: dict = {}
    rows, refused, skipped = [], [], []
    started = time.perf_counter()
    for layout in candidates if candidates is not None else layouts(max_world, moe, layers):
        # an empty DP rank: one request, on DP rank 0
        asked = prompts[:1] if layout.empty else prompts
        spec, refusal = _spec(parser, base, layout, asked)
        if spec is None:
            refused.append({"layout": layout.name(), "why": refusal})
            continue
        if budget is not None and time.perf_counter() - started > budget:
            skipped.append(layout.name())
            continue
        if asked not in references:  # one rank, no variant: what every layout must match
            references[asked] = reference_run(replace(
                spec, moe_a2a_backend="none", sequence_parallel=False,
                attn_input_scattered=False, boundary_reduction="auto"))
        if progress is not None:
            progress(f"  {layout.name()} ...")
        results, error = _run(spec)
        if results is None:
            rows.append(Row(layout, "ERROR", error))
            continue
        run = merge(results)
        verdict = parity(run, references[asked])
        ok, how = verdict_ok(verdict, spec.dtype, run, references[asked],
                             quantized=reads_quantized(spec))
        audited = audit_summary(results)
        once = ("not audited: " + audited["why"] if not audited["audited"] else
                "PASS" if not audited["violations"] else "; ".join(audited["violations"][:3]))
        ok = ok and not audited["violations"]
        rank0 = results[0]
        rows.append(Row(layout, "PASS" if ok else "FAIL",
                        "" if ok else f"tokens {'match' if verdict['tokens_match'] else 'differ'}"
                        f", {how}", verdict["max_abs_diff"],
                        sum(e.bytes for e in rank0.ledger), exactly_once=once))
    least: dict = {}
    for row in rows:
        if row.bytes is not None:
            shape = row.layout.shape
            least[shape] = min(least.get(shape, row.bytes), row.bytes)
    for row in rows:
        if row.bytes is not None:
            row.min_bytes = least[row.layout.shape]
    return {"model": folder, "max_world": max_world, "rows": [r.record() for r in rows],
            "refused": refused, "skipped": skipped,
            "passed": sum(r.verdict == "PASS" for r in rows), "run": len(rows),
            "seconds": time.perf_counter() - started}


def print_table(result: dict) -> None:
    rows = result["rows"]
    width = max([len(r["layout"]) for r in rows] + [6])
    report.info("layer-boundary sweep: %s, worlds up to %d: %d layouts run, %d passed, %d "
                "refused by the capability check, %d left out by the budget",
                result["model"], result["max_world"], result["run"], result["passed"],
                len(result["refused"]), len(result["skipped"]))
    report.info("  %-*s  %-7s %-10s %-16s %s", width, "layout", "verdict", "max |diff|",
                "bytes / least", "exactly once")
    for r in rows:
        diff = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.2e}"
        moved = ("-" if r["bytes"] is None else
                 f"{r['bytes']} / {r['min_bytes']}" if r["min_bytes"] else f"{r['bytes']} / 0")
        report.info("  %-*s  %-7s %-10s %-16s %s%s", width, r["layout"], r["verdict"], diff,
                    moved, r["exactly_once"], f"  ({r['detail']})" if r["detail"] else "")
    if result["skipped"]:
        report.info("left out by --budget: %s", ", ".join(result["skipped"]))


def cmd_sweep(args) -> int:
    """``layer-boundary sweep``: exit 0 when every layout run passed, else 1."""
    from ..models import open_checkpoint
    from ..models.tiny import builtin_checkpoint
    from .args import model_folder
    from .checks import check_token_ids
    from .logs import setup_logging
    from .run_command import DEFAULT_PROMPTS

    setup_logging(0)
    folder = model_folder(args.model)
    if args.prompt_ids:  # the defaults are taken modulo the vocabulary; a user's ids are not
        check_token_ids(open_checkpoint(folder or str(builtin_checkpoint())), args.prompt_ids)
    prompts = tuple(tuple(p) for p in (args.prompt_ids or DEFAULT_PROMPTS))

    def say(line: str) -> None:  # under --json stdout holds the JSON alone
        if args.json:
            print(line, file=sys.stderr, flush=True)
        else:
            log.info("%s", line)

    result = sweep(folder, args.max_world, args.budget, args.max_new_tokens, prompts,
                   progress=say)
    if args.json:
        report.info("%s", json.dumps(result))
    else:
        print_table(result)
    return 0 if result["passed"] == result["run"] else 1
