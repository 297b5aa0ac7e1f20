"""One rank's share of a generation run, and the merge of every rank's share.

The command line and the multi-rank tests both use this, so what the tests prove is what
``layer-boundary run`` does.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field, replace

import torch

from ..adapters.tbo import TboPolicy
from ..contracts import BatchVariant
from ..layout import RowMode
from ..models import Checkpoint, building_on, load_model, open_checkpoint
from ..runtime.agreement import checking
from ..runtime.args import BoundaryRuntime
from ..runtime.forward_batch import token_bucket
from ..runtime.invariant import batch_invariant
from ..runtime.ledger import LEDGER, LedgerEntry
from ..runtime.parallel import ParallelDims, build_parallel
from ..runtime.shards import ReadBytes
from .audit import STRICT_ENV, AuditError, audit, not_audited
from .compiled import compile_forward, compiled_graphs
from .describe import plan_rows
from .features import backend_for, check_draft, check_spec  # noqa: F401 - public names
from .fusion_providers import make_fusions
from .generate import Generation, greedy_generate, takes_padded_batches
from .graphs import (CapturedDecode, GraphDecision, Graphs, InductorSkips, decide_graphs,
                     decode_step)
from .speculative import speculative_generate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RunSpec:
    model_dir: str
    tp: int = 1
    dp: int = 1
    ep: int = 1  # expert parallelism of MoE layers over the TP ranks
    cp: int = 1  # attention context parallelism: each DP rank's tokens split over cp ranks
    # the prefill as a sequence-parallel batch (residual, norms and row movement inside the
    # linears on scattered rows); decode steps run as ordinary batches
    sequence_parallel: bool = False
    # every forward an input-scattered batch: an MLA's latent runs before the input gather
    attn_input_scattered: bool = False
    # "all_to_all": MoE layers stay on the attention rows and dispatch their routed tokens
    moe_a2a_backend: str = "none"
    # LoRA: (name, PEFT folder) pairs, and each prompt's adapter name ("none": the base
    # model; empty: every prompt on the base model)
    lora: tuple = ()
    prompt_lora: tuple = ()
    boundary_reduction: str = "auto"
    dtype: str = "float32"
    prompts: tuple = ((1, 2, 3),)
    max_new_tokens: int = 4
    allreduce_fusion: bool = True
    rs_padding: bool = True
    trace: bool = False  # record the residual stream after every boundary call
    fusions: str | None = None  # None, or one of fusion_providers.FUSION_PROVIDERS
    device: str = "cpu"  # "cuda": each rank on its own GPU (LOCAL_RANK), or sharing one
    model_options: tuple = ()  # (name, value) engine options of the model
    # run each forward under torch.compile(fullgraph=True) with this backend ("inductor",
    # "aot_eager", "eager"); a graph break anywhere in the forward is an error
    compile: str | None = None
    # on --device cuda, decode steps replay a CUDA graph per token bucket (inductor's own
    # under --compile) where ``graphs.decide_graphs`` allows; False: --disable-cuda-graph
    cuda_graph: bool = True
    # what each captured decode graph holds: "inductor" (the step compiled, fewer kernels) or
    # "eager" (``graphs.decode_step``)
    captured_decode: str = "inductor"
    # before each collective, the ranks of its group compare their decisions and name the
    # first difference (``runtime.agreement``); None: as LAYER_BOUNDARY_CHECK_AGREEMENT says
    check_agreement: bool | None = None
    # a request's logits the same bits alone as in the batch (``runtime.invariant``): the
    # run also generates each prompt alone and the report compares them bit for bit
    batch_invariant: bool = False
    pp: int = 1  # pipeline stages (world = pp x tp)
    pp_layers: tuple | None = None  # layers per stage (None: even split, remainder first)
    split_prefill: int = 1  # layer-range segments per stage for the prefill
    # two-batch overlap: when a forward runs as two interleaved microbatches (AUTO: where
    # ``tbo_decision`` says the overlap pays; ALWAYS: every forward)
    tbo: TboPolicy = TboPolicy.OFF
    draft_model: str | None = None  # speculative decoding: the draft stack's checkpoint
    speculative_algorithm: str | None = None  # None | "draft" (draft_model) | "nextn"
    speculative_steps: int = 3  # draft tokens proposed per round
    speculative_boundary_reduction: str = "auto"  # the draft's own policy (its architecture's)
    # which implementation serves model_dir (``open_checkpoint``'s impl, ``--model-impl``):
    # "native" our model file, "transformers" the Transformers backend, "auto" ours where we
    # have one; a draft is served as "auto" (the Transformers backend drafts for nothing)
    model_impl: str = "auto"
    # model_dir's and draft_model's config.json, read once (``with_checkpoints``) and carried
    # to every rank, so no rank reads them again
    checkpoint: Checkpoint | None = field(default=None, compare=False, repr=False)
    draft_checkpoint: Checkpoint | None = field(default=None, compare=False, repr=False)

    @property
    def world_size(self) -> int:
        return self.pp * self.tp

    @property
    def speculative(self) -> bool:
        return self.draft_model is not None or self.speculative_algorithm == "nextn"

    def dims(self, world_size: int | None = None) -> ParallelDims:
        return ParallelDims(world_size=world_size or self.world_size, tp=self.tp, pp=self.pp,
                            attn_dp=self.dp, attn_cp=self.cp, moe_ep=self.ep)


@dataclass
class RankResult:
    rank: int
    dp_rank: int
    attn_tp_rank: int
    generation: Generation
    ledger: list[LedgerEntry]
    plan: list[dict]
    streams_released: bool
    resolved_reduction: str = ""
    modes: list[str] = field(default_factory=list)  # row mode of each forward
    traces: list = field(default_factory=list)
    fused_inputs: int = 0  # inputs a fusion provider's candidate completed
    fused_final_norms: int = 0  # final norms the provider's handoff service completed
    fused_stages: list = field(default_factory=list)  # stages whose inputs it completed
    # each stage the provider was asked about: offered, applied, declined by reason
    # (``ReferenceFusions.outcomes``)
    fusion_outcomes: dict = field(default_factory=dict)
    pp_rank: int = 0
    last_stage: bool = True  # this rank's logits are the model's (the last pipeline stage)
    layers: tuple = ()  # the global layers this rank's pipeline stage holds
    speculative: dict | None = None  # proposed/accepted/target_forwards/emitted/reruns
    load_bytes: int = 0  # what this rank read from the checkpoint (its shard)
    compiled_graphs: int = 0  # graphs torch.compile built for this rank's forwards
    # ``batch_invariant``: each prompt's generation run alone (None on a rank that holds
    # none of the lone prompts' logits)
    alone: list | None = None
    # the exactly-once audit (``engine.audit``): each violation in words, or the reason its
    # forwards were not audited (``unaudited``)
    audit: list = field(default_factory=list)
    unaudited: str | None = None
    # where this rank's forwards ran from CUDA graphs: mode, why, the captured buckets, the
    # replays, inductor's reasons for skipping a graph (``graphs_summary``)
    cuda_graphs: dict = field(default_factory=dict)
    calls: list = field(default_factory=list)  # ForwardRecord of each call of the target
    # the implementation this rank's model is (``CausalLM.impl``: "native" our model file,
    # "transformers" the Transformers backend): what the report says ran
    model_impl: str = ""


def with_checkpoints(spec: RunSpec) -> RunSpec:
    """``spec`` with its checkpoints' config.json read (each once; those already read are
    kept, unless ``model_impl`` names another implementation than the one read): what every
    rank of the run is handed, so every rank and sweep row serves the same implementation."""
    checkpoint, draft = spec.checkpoint, spec.draft_checkpoint
    if (checkpoint is None or checkpoint.folder != str(spec.model_dir)  # none, or another's
            or spec.model_impl not in ("auto", checkpoint.impl)):  # or another implementation
        checkpoint = open_checkpoint(spec.model_dir, spec.model_impl)
    if spec.draft_model is None:
        draft = None
    elif draft is None or draft.folder != str(spec.draft_model):
        draft = open_checkpoint(spec.draft_model)
    if checkpoint is spec.checkpoint and draft is spec.draft_checkpoint:
        return spec
    return replace(spec, checkpoint=checkpoint, draft_checkpoint=draft)


def rank_device(spec: RunSpec) -> torch.device:
    """This rank's device: the CPU, or with ``device="cuda"`` the GPU ``LOCAL_RANK`` names
    (modulo the GPUs visible: ranks share them when there are fewer), made current."""
    if spec.device == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def make_runtime(spec: RunSpec, world_size: int | None = None) -> BoundaryRuntime:
    """The target stack's runtime of ``spec``: its topology's groups, its policy resolved for
    its checkpoint, the batch variants its forwards run."""
    return runtime_of(spec, build_parallel(spec.dims(world_size)))


def runtime_of(spec: RunSpec, parallel) -> BoundaryRuntime:
    """``spec``'s target runtime on ``parallel`` (its groups, or a virtual topology's)."""
    spec = with_checkpoints(spec)
    policy = spec.checkpoint.boundary_reduction(spec.boundary_reduction)
    return BoundaryRuntime(parallel, boundary_reduction=policy,
                           allreduce_fusion=spec.allreduce_fusion, rs_padding=spec.rs_padding,
                           pp_layers=spec.pp_layers, batch_variants=runtime_variants(spec),
                           moe_a2a_backend=spec.moe_a2a_backend,
                           # batch-invariant: one policy for every batch, never chosen
                           # by a batch's bytes
                           choose_by_bytes=(spec.boundary_reduction == "auto"
                                            and not spec.batch_invariant))


def runtime_variants(spec: RunSpec) -> tuple:
    """Every batch variant ``spec`` asks for (what its runtime declares, so the runtime's own
    check sees them all), those its forwards run first."""
    asked = ((BatchVariant.SEQUENCE_PARALLEL,) * spec.sequence_parallel
             + (BatchVariant.INPUT_SCATTERED,) * spec.attn_input_scattered)
    return tuple(dict.fromkeys(forward_variants(spec) + asked))


def forward_variants(spec: RunSpec) -> tuple:
    """The batch variant of the prefill and of the decode steps."""
    if spec.cp > 1:
        return BatchVariant.CP, BatchVariant.CP
    if spec.sequence_parallel:
        return BatchVariant.SEQUENCE_PARALLEL, BatchVariant.ORDINARY
    if spec.attn_input_scattered:
        return BatchVariant.INPUT_SCATTERED, BatchVariant.INPUT_SCATTERED
    return BatchVariant.ORDINARY, BatchVariant.ORDINARY


@dataclass(frozen=True)
class ForwardRecord:
    """One call of the target model: the batch it ran (what a run can show it turned on)."""

    variant: BatchVariant
    tbo: bool  # as two interleaved microbatches
    segment: tuple | None  # the split prefill's layer range, or None: the stage's layers


class _ForwardCheck:
    """Wraps the model to record each call's batch, each forward's row mode and whether it
    released its stream; ``forward`` is the model itself or its compiled form."""

    def __init__(self, model, forward) -> None:
        self.model, self.forward, self.released, self.modes = model, forward, True, []
        self.calls: list[ForwardRecord] = []
        self.forwards: list[tuple] = []  # (variant, row mode, row facts) of each forward

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, forward_batch, pp_input=None, **kwargs):
        self.calls.append(ForwardRecord(forward_batch.variant, bool(forward_batch.tbo),
                                        forward_batch.layer_segment))
        out = self.forward(forward_batch, pp_input, **kwargs)
        if out is not None:  # the stage's last segment of this forward
            self.released &= forward_batch.residual_stream is None
            facts = forward_batch.row_facts
            self.modes.append(facts.mode.value)
            self.forwards.append((forward_batch.variant, facts.mode, facts))
        return out


def run_rank(spec: RunSpec, world_size: int | None = None) -> RankResult:
    """This rank's part of ``spec``: build, load, generate, with the ledger recording.

    Args:
        spec: the run (each rank of it gets the same one).
        world_size: the process group's size where it is not ``spec``'s (a test's pool).

    A spec the library does not run is refused first (``check_spec``: a one-line
    ``ValueError``), before any group, model or collective.
    """
    spec = with_checkpoints(spec)
    check_spec(spec)
    with _agreement(spec.check_agreement), batch_invariant(spec.batch_invariant):
        return _run_rank(spec, world_size)


def _agreement(on: bool | None):
    """The agreement check for this rank's run: on or off, or as it is (None)."""
    return contextlib.nullcontext() if on is None else checking(on)


def _run_rank(spec: RunSpec, world_size: int | None) -> RankResult:
    runtime = make_runtime(spec, world_size)
    par = runtime.parallel
    provider = make_fusions(spec.fusions)
    read = ReadBytes()
    device = rank_device(spec)
    model = load_model(spec.checkpoint, runtime, dtype=DTYPES[spec.dtype],
                       options=spec.model_options, read=read, device=device)
    if provider is not None:  # installed on the built model, as an engine installs a backend's
        model.install_fusion(provider)
    adapters = None
    if spec.lora:
        from ..adapters.lora import attach_lora, lora_slots

        names = list(attach_lora(model, spec.lora, spec.checkpoint))
        adapters = lora_slots(names, spec.prompt_lora or ("none",) * len(spec.prompts))
    run = run_forward(spec, model, par)
    forward, captured, skips, pads = run.forward, run.captured, run.skips, run.pads
    if spec.compile is not None:
        graphs_before = compiled_graphs()  # compiling is lazy: nothing built yet
    checked = _ForwardCheck(model, forward)
    draft = load_draft(spec, runtime, model) if spec.speculative else None
    stats = None
    with LEDGER.recording() as entries, contextlib.ExitStack() as stack, skips:
        traces = stack.enter_context(LEDGER.tracing()) if spec.trace else []
        if draft is not None:
            gen, stats = speculative_generate(
                checked, draft, [list(p) for p in spec.prompts], spec.max_new_tokens,
                spec.speculative_steps, parallel=par, dp=par.dims.attn_dp,
                dp_rank=par.attn_dp_rank, on_step=_set_ledger_step, adapters=adapters,
                variants=forward_variants(spec))
        else:
            gen = greedy_generate(checked, [list(p) for p in spec.prompts], spec.max_new_tokens,
                                  dp=par.dims.attn_dp, dp_rank=par.attn_dp_rank,
                                  on_step=_set_ledger_step,
                                  pp=par.pp_group if par.dims.pp > 1 else None,
                                  split_prefill=spec.split_prefill, tbo=spec.tbo,
                                  variants=forward_variants(spec), adapters=adapters,
                                  bucket=token_bucket if pads else None,
                                  pad_prefill=captured is None)
    alone = _alone(spec, model, par, adapters) if spec.batch_invariant else None
    if device.type != "cpu":  # the report reads them on the CPU, after the forwards
        gen.logits = _on_cpu(gen.logits)
    result = RankResult(par.rank, par.attn_dp_rank, par.attn_tp_rank, gen, list(entries),
                        plan_rows(model, RowMode(checked.modes[0]), forward_variants(spec)[0]),
                        checked.released,
                        runtime.boundary_reduction, checked.modes, list(traces))
    if stats is not None:
        result.speculative = {k: getattr(stats, k) for k in
                              ("proposed", "accepted", "target_forwards", "emitted", "reruns",
                               "request_rounds")}
    result.alone = alone
    result.unaudited = not_audited(spec)
    if result.unaudited is None:
        result.audit = audit(model, par, result.ledger, checked.forwards)
        if result.audit and os.environ.get(STRICT_ENV) == "1":
            raise AuditError("; ".join(result.audit))
    result.pp_rank, result.last_stage = par.pp_rank, model.stage.last
    result.load_bytes = read.bytes
    if spec.compile is not None:
        result.compiled_graphs = compiled_graphs() - graphs_before
    result.cuda_graphs = graphs_summary(run.decision, captured, skips)
    result.layers = tuple(model.stage.layers)
    result.calls = checked.calls
    result.model_impl = model.impl
    if provider is not None:
        result.fused_inputs = provider.accepted
        result.fused_final_norms = 0 if provider.service is None else provider.service.calls
        result.fused_stages = provider.fused_stages
        result.fusion_outcomes = provider.outcomes()
    return result


def _on_cpu(logits: list) -> list:
    """Each request's per-step logits moved to the CPU (what the report reads)."""
    return [[row.cpu() for row in rows] for rows in logits]


def _alone(spec: RunSpec, model, par, adapters) -> list | None:
    """Each prompt generated alone (on attention-DP rank 0; the other DP ranks hold no
    request), as the batch was: [Generation of that one request] on the rank that holds its
    logits (the last stage's attention-TP rank 0 of DP rank 0), else None."""
    out = []
    for i, prompt in enumerate(spec.prompts):
        gen = greedy_generate(model, [list(prompt)], spec.max_new_tokens, dp=par.dims.attn_dp,
                              dp_rank=par.attn_dp_rank,
                              pp=par.pp_group if par.dims.pp > 1 else None,
                              split_prefill=spec.split_prefill,
                              variants=forward_variants(spec),
                              adapters=None if adapters is None else [adapters[i]])
        out.append(Generation(gen.request_ids, gen.generated, _on_cpu(gen.logits)))
    holds = par.attn_dp_rank == 0 and par.attn_tp_rank == 0 and model.stage.last
    return out if holds else None


@dataclass
class RunForward:
    """What a rank's generation calls, decided once from the spec, the model and the groups:
    the forward (the model, its compiled form, or its captured decode), the CUDA-graph
    decision, whether batches pad to their token bucket, and what collects inductor's
    reasons for skipping a graph (a null context where inductor captures none)."""

    forward: object
    decision: GraphDecision
    pads: bool
    captured: CapturedDecode | None = None
    skips: object = field(default_factory=contextlib.nullcontext)


def run_forward(spec: RunSpec, model, parallel) -> RunForward:
    """The forward ``spec`` runs ``model`` through on ``parallel`` (see ``RunForward``)."""
    takes_pads = takes_padded_batches(model)
    decision = decide_graphs(spec, parallel, takes_pads)
    # a compiled forward runs padded to its token bucket where the cache allows (speculative
    # verification builds its own batches, unpadded); captured decode steps too
    pads = takes_pads and ((spec.compile is not None and not spec.speculative)
                           or decision.graphs is Graphs.CAPTURED)
    if spec.compile is not None:
        torch._dynamo.reset()  # one model per run: no earlier run's graphs count to its limits
        forward = compile_forward(model, spec.compile, padded=pads,
                                  cuda_graphs=decision.graphs is Graphs.INDUCTOR)
        skips = (InductorSkips() if decision.graphs is Graphs.INDUCTOR
                 else contextlib.nullcontext())
        return RunForward(forward, decision, pads, skips=skips)
    if decision.graphs is Graphs.CAPTURED:
        torch._dynamo.reset()  # one model per run, as compiling above
        step, step_name = decode_step(spec, model)
        captured = CapturedDecode(model, step, step_name=step_name)
        return RunForward(captured, decision, pads, captured=captured)
    return RunForward(model, decision, pads)


def graphs_summary(decision: GraphDecision, captured: CapturedDecode | None, skips) -> dict:
    """What ran from CUDA graphs on this rank: the decision (``mode``, ``why``), and the
    captured buckets and replays (ours) or inductor's reasons for skipping a graph."""
    summary = {"mode": decision.graphs.value, "why": decision.why}
    if captured is not None:
        if captured.failed is not None:
            summary.update(mode=Graphs.OFF.value, why=captured.failed)
        summary.update(step=captured.step_name,
                       buckets=captured.buckets, replays=captured.replays)
    if isinstance(skips, InductorSkips):
        summary["skipped"] = skips.reasons
    return summary


def load_draft(spec: RunSpec, target_runtime: BoundaryRuntime, target):
    """The draft stack on the target's ranks and topology, with its own boundary-reduction
    policy (``auto`` resolved for the draft's own architecture): a draft checkpoint, or the
    target's own NextN layer."""
    spec = with_checkpoints(spec)
    if spec.speculative_algorithm == "nextn":
        from ..models.nextn import load_nextn

        # the target's own NextN layer: the target checkpoint's architecture
        policy = spec.checkpoint.boundary_reduction(spec.speculative_boundary_reduction)
        runtime = BoundaryRuntime(target_runtime.parallel, boundary_reduction=policy,
                                  allreduce_fusion=spec.allreduce_fusion,
                                  rs_padding=spec.rs_padding)
        with building_on(target.device):  # beside the target it shares modules with
            return load_nextn(spec.model_dir, runtime, target, dtype=DTYPES[spec.dtype])
    draft = spec.draft_checkpoint
    policy = draft.boundary_reduction(spec.speculative_boundary_reduction)
    runtime = BoundaryRuntime(target_runtime.parallel, boundary_reduction=policy,
                              allreduce_fusion=spec.allreduce_fusion, rs_padding=spec.rs_padding)
    return load_model(draft, runtime, dtype=DTYPES[spec.dtype], device=target.device)


def _set_ledger_step(step: int) -> None:
    LEDGER.step = step


def merge(results: list[RankResult]) -> Generation:
    """Every request's tokens and logits, in prompt order, from each DP rank's first TP rank
    of the last pipeline stage."""
    by_request = {}
    for r in results:
        if r.attn_tp_rank != 0 or not r.last_stage:
            continue
        for j, req in enumerate(r.generation.request_ids):
            by_request[req] = (r.generation.generated[j], r.generation.logits[j])
    order = sorted(by_request)
    return Generation(order, [by_request[i][0] for i in order], [by_request[i][1] for i in order])


def speculative_summary(results: list[RankResult]) -> dict | None:
    """Acceptance over every DP rank's requests: the rate at which the target confirmed the
    draft's tokens, and the tokens each verification forward emitted per request."""
    heads = [r.speculative for r in results if r.attn_tp_rank == 0 and r.speculative]
    if not heads:
        return None
    total = {k: sum(h[k] for h in heads) for k in heads[0]}
    return {"acceptance_rate": total["accepted"] / max(1, total["proposed"]),
            "tokens_per_target_forward": total["emitted"] / max(1, total["request_rounds"]),
            "target_forwards": max(h["target_forwards"] for h in heads),
            "reruns": max(h["reruns"] for h in heads)}

