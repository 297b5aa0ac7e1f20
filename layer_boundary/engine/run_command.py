"""``layer-boundary run``: the run spec built from the arguments (every check before any
rank starts), the ranks started (spawned on this machine, or joined under torchrun), the
world-1 reference, and the report."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch
import torch.distributed as dist

from ..adapters.tbo import TboPolicy
from ..models import open_checkpoint
from ..models.estimate import check_fits, check_sizes
from ..models.loader import check_fp8_tensors, safetensors_files
from ..models.tiny import builtin_checkpoint
from ..runtime.agreement import checking_agreement
from ..runtime.launch import init_distributed, launched_by_torchrun, spawn
from ..runtime.parallel import ParallelDims, TopologyError
from .args import UsageError, engine_names, speculative, tp_dp
from .checks import (check_ep, check_lengths, check_lora, check_pipeline,
                     check_speculative_steps, check_token_ids, job_memory)
from .features import check_spec
from .fusion_providers import FUSION_PROVIDERS
from .hub import model_folder, tokenizer
from .logits_file import check_target
from .logs import setup_logging
from .report import report
from .runner import RunSpec, backend_for, merge, run_rank
from .stops import Stopped, stop_on_sigterm  # noqa: F401 - run_command's names too

log = logging.getLogger("layer_boundary")


def _prompts(args, model_dir) -> tuple[tuple[int, ...], ...]:
    prompts = list(args.prompt_ids or [])
    if args.prompt:
        tok = tokenizer(model_dir)
        prompts += [tuple(tok.encode(text).ids) for text in args.prompt]
    return tuple(prompts)


DEFAULT_PROMPTS = ((1, 2, 3, 4, 5), (7, 11, 13), (42, 17, 5, 99, 123, 7, 8))


def spec_from_args(args):
    """The ``RunSpec`` of ``run``'s arguments, every check made: a bad argument, checkpoint or
    combination is a one-line error here (a ``UsageError``, or the checkpoint's, topology's or
    combination table's own), before any rank starts. Each checkpoint's config.json is read
    once, into the spec."""
    engine_names(args)
    checking_agreement()  # the ranks read it: a value they would misread is refused here
    for flag, value in (("--model", args.model), ("--logits-out", args.logits_out)):
        if value is not None and not value.strip():
            raise UsageError(f"{flag} is empty: give a path (leave the flag out for "
                             f"{'the built-in tiny model' if flag == '--model' else 'no file'})")
    if args.speculative_boundary_reduction != "auto" and not speculative(args):
        raise UsageError("--speculative-boundary-reduction sets the draft stack's policy; "
                         "there is no draft here (--draft-model or --speculative-algorithm)")
    if args.require_fusions and args.fusion_provider is None:
        raise UsageError("--require-fusions needs a provider to require: --fusions "
                         + "|".join(FUSION_PROVIDERS))
    args.draft_model = model_folder(args.draft_model, "--draft-model")
    args.lora = [(name, model_folder(folder, f"--lora {name}="))
                 for name, folder in args.lora or ()]  # a folder, or a repo id as --model takes
    model_dir = model_folder(args.model) or str(builtin_checkpoint())
    checkpoint = open_checkpoint(model_dir, args.model_impl)
    cfg = checkpoint.config
    safetensors_files(model_dir)  # a missing weights file is a one-line error before any rank
    check_fp8_tensors(model_dir, getattr(cfg, "fp8_block", None),  # headers only
                      getattr(cfg, "fp8_skip", ()))
    prompts = _prompts(args, model_dir) or tuple(
        tuple(t % cfg.vocab_size for t in p) for p in DEFAULT_PROMPTS)
    check_token_ids(checkpoint, prompts)
    if args.batch_invariant and len(prompts) < 2:
        raise UsageError("--batch-invariant checks each prompt generated alone against the "
                         "batch; with one prompt the batch is that prompt alone and nothing "
                         "is compared: give at least two prompts")
    check_lengths(checkpoint, prompts, args.max_new_tokens)
    if args.draft_model or args.speculative_algorithm:
        check_speculative_steps(checkpoint, prompts, args.max_new_tokens, args.speculative_steps)
    if args.logits_out:  # refused now, not after the whole run
        check_target(args.logits_out, logits_bytes(cfg.vocab_size, prompts, args.max_new_tokens))
    check_ep(args, checkpoint)
    tp, dp = tp_dp(args)
    ParallelDims(world_size=args.pp * tp, tp=tp, pp=args.pp, attn_dp=dp, attn_cp=args.cp,
                 moe_ep=args.ep)  # names bad factors
    algorithm = args.speculative_algorithm or ("draft" if args.draft_model else None)
    draft = None
    if args.draft_model is not None and algorithm == "draft":
        safetensors_files(args.draft_model)
        draft = open_checkpoint(args.draft_model)
    spec = RunSpec(model_dir=str(model_dir), model_impl=args.model_impl, checkpoint=checkpoint,
                   draft_checkpoint=draft, tp=tp, dp=dp, ep=args.ep, cp=args.cp,
                   sequence_parallel=args.sequence_parallel,
                   attn_input_scattered=args.attn_input_scattered,
                   moe_a2a_backend=args.moe_a2a_backend, lora=tuple(args.lora or ()),
                   prompt_lora=tuple(args.prompt_lora or ()), pp=args.pp,
                   pp_layers=args.pp_layers, split_prefill=args.split_prefill,
                   tbo=TboPolicy(args.tbo) if args.tbo else TboPolicy.OFF,
                   draft_model=args.draft_model, speculative_algorithm=algorithm,
                   speculative_steps=args.speculative_steps,
                   speculative_boundary_reduction=args.speculative_boundary_reduction,
                   boundary_reduction=args.boundary_reduction,
                   dtype=checkpoint.run_dtype() if args.dtype == "auto" else args.dtype,
                   prompts=prompts, max_new_tokens=args.max_new_tokens,
                   allreduce_fusion=not args.no_allreduce_fusion,
                   rs_padding=not args.no_rs_padding, fusions=args.fusion_provider,
                   device=args.device, cuda_graph=not args.disable_cuda_graph,
                   captured_decode=args.captured_decode or "inductor",
                   check_agreement=args.check_agreement,
                   batch_invariant=args.batch_invariant,
                   compile=args.compile_backend or ("inductor" if args.compile else None))
    check_spec(spec)  # the combination table: what run_rank asks first, asked here first
    check_pipeline(args, checkpoint)
    check_lora(spec)
    if spec.draft_checkpoint is not None:
        check_sizes(spec.draft_checkpoint)
    # what the job asks of this machine, refused by name before any rank allocates it
    check_fits(job_memory(spec, reference=not getattr(args, "no_reference", False)))
    return spec


def logits_bytes(vocab_size: int, prompts, max_new_tokens: int) -> int:
    """What ``--logits-out`` writes: one fp32 row of the vocabulary per prompt and step."""
    return 4 * vocab_size * len(prompts) * max_new_tokens


def rank_entry(spec):
    """One spawned rank's job: ``run_rank(spec)`` from a fixed seed; it prints nothing (the
    process that spawned it reports, and has already said what the checks found)."""
    setup_logging(1)
    torch.manual_seed(0)
    return run_rank(spec)


def cmd_run(args) -> int:
    """``layer-boundary run``: the exit status (0: parity passed or not checked)."""
    timeout = args.collective_timeout or (
        COMPILE_COLLECTIVE_TIMEOUT_S if (args.compile or args.compile_backend) else None)
    if launched_by_torchrun():
        # no spawner watches these ranks: a silent peer is found by the collective timeout,
        # and torchrun then needs about half a minute to stop the group
        rank, world = init_distributed(timeout_s=timeout or TORCHRUN_COLLECTIVE_TIMEOUT_S,
                                       join_timeout_s=args.start_timeout,
                                       backend=backend_for(args.device, int(os.environ.get(
                                           "LOCAL_WORLD_SIZE", "1"))))
        setup_logging(rank, args.json)
        if args.tp is None:
            args.tp = world // args.pp
        spec = spec_from_args(args)
        if spec.world_size != world:
            raise TopologyError(f"--pp {spec.pp} x --tp {spec.tp} != torchrun world size {world}")
        result = run_rank(spec, world)
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        code = 0
        if rank == 0:
            reference = None if args.no_reference else reference_run(spec)
            code = report(args, spec, gathered, reference, "--no-reference")
        dist.barrier()
        dist.destroy_process_group()
        return code
    setup_logging(0, args.json)
    return _spawned_run(args, timeout)  # a signal: cli's stop_on_sigterm, around the command


def _spawned_run(args, timeout) -> int:
    """``run`` on ranks this process spawns, then the reference and the report."""
    spec = spec_from_args(args)
    if spec.device == "cpu":  # graph flags: named where they do nothing (on stderr: --json)
        for flag, given in (("--disable-cuda-graph", args.disable_cuda_graph),
                            (f"--captured-decode {args.captured_decode}",
                             args.captured_decode is not None)):
            if given:
                log.info("note: %s ignored: the CPU runs no CUDA graphs", flag)
    # what the run says while it works goes to stderr under --json (engine.logs)
    if spec.tbo is TboPolicy.ALWAYS:  # gloo ranks share this machine's cores
        log.info("note: --tbo always on gloo ranks that share CPU cores runs slower than the "
                 "plain forward (docs/features.md, Two-batch overlap); it proves the "
                 "overlapped schedule's numbers, not a speed-up here")
    world = spec.world_size
    if world > 1:  # before the wait: how many processes this starts
        log.info("starting %d rank processes (%stp %d)", world,
                 f"pp {spec.pp} x " if spec.pp > 1 else "", spec.tp)
        log.info("each loads its shard of %s%s", spec.model_dir,
                 f", then compiles its forward with {spec.compile} (the first forward of each "
                 "token bucket; minutes with cold caches)" if spec.compile else "")
    options = {"collective_timeout_s": timeout} if timeout else {}
    if args.start_timeout:
        options["start_timeout_s"] = args.start_timeout
    results = [run_rank(spec)] if world == 1 else spawn(rank_entry, world, spec,
                                                        backend=backend_for(spec.device, world),
                                                        **options)
    # world 1 needs no reference of itself, unless it ran compiled, from CUDA graphs (the
    # eager run is what a replay must match) or in segments
    own = (world == 1 and spec.compile is None and spec.split_prefill == 1
           and spec.tbo is TboPolicy.OFF and not (spec.device == "cuda" and spec.cuda_graph)
           and not spec.speculative)
    reference = None if args.no_reference or own else reference_run(spec)
    return report(args, spec, results, reference, "--no-reference" if args.no_reference
                  else "a plain world-1 run is its own reference")


# a compiling rank may reach its first collective minutes after a peer (cold inductor caches)
COMPILE_COLLECTIVE_TIMEOUT_S = 900.0
TORCHRUN_COLLECTIVE_TIMEOUT_S = 15.0


def reference_run(spec):
    """The same requests on one rank, in this process (size-1 groups need no torch.distributed)."""
    return merge([run_rank(replace(spec, tp=1, dp=1, ep=1, cp=1, pp=1, pp_layers=None,
                               split_prefill=1, tbo=TboPolicy.OFF, draft_model=None,
                               draft_checkpoint=None, speculative_algorithm=None, compile=None,
                               cuda_graph=False, batch_invariant=False),
                       world_size=1)])

