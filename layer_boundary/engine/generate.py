"""Greedy generation with a KV cache: one prefill of all requests, then decode steps.

Requests are spread over attention-DP ranks (request i on DP rank i mod dp); each rank runs
its own requests, and every rank knows every DP rank's token count for the boundaries.

Under pipeline parallelism (``pp``: the runtime's pipeline group) each forward receives the
previous stage's tensors, runs this stage's layers and sends its own onward; the last stage
samples and every stage gets the sampled tokens, so the next step's batch is the same on all
(one batch in flight). ``split_prefill`` runs the prefill of each stage in that many
layer-range segments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..adapters.tbo import TboDecision, TboPolicy, tbo_decision
from ..residual import declared
from ..runtime.forward_batch import BatchVariant, ForwardBatch, ForwardMode, LogitsRows
from .pipeline import PipelineLink


@dataclass
class Generation:
    request_ids: list[int]  # indices of this rank's requests in the global prompt list
    generated: list[list[int]]
    # per request, per step: [vocab] fp32 logits of its last position
    logits: list[list[torch.Tensor]]
    tbo: list[TboDecision] = field(default_factory=list)  # each forward's two-batch decision


def requests_of(dp_rank: int, dp: int, n: int) -> list[int]:
    return [i for i in range(n) if i % dp == dp_rank]


def segments(layers: range, parts: int) -> list[tuple[int, int]]:
    """``layers`` in ``parts`` contiguous, non-empty [start, stop) ranges (fewer if short)."""
    parts = max(1, min(parts, len(layers)))
    base, extra = divmod(len(layers), parts)
    out, start = [], layers.start
    for i in range(parts):
        stop = start + base + (i < extra)
        out.append((start, stop))
        start = stop
    return out


def takes_padded_batches(model) -> bool:
    """Whether ``model``'s KV cache serves padded batches (``KVCache.padded_batches``, as the
    cache's own class declares it), so a compiled forward can run one graph per bucket."""
    return declared(model.make_kv_cache(1, 1), "padded_batches", False) is True


@torch.no_grad()
def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, *, dp: int = 1,
                    dp_rank: int = 0, keep_logits: bool = True, on_step=None, pp=None,
                    split_prefill: int = 1, tbo: TboPolicy = TboPolicy.OFF,
                    variants: tuple = (BatchVariant.ORDINARY, BatchVariant.ORDINARY),
                    adapters: list[int] | None = None, bucket=None,
                    pad_prefill: bool = True) -> Generation:
    """Greedy tokens (and each step's logits) of this rank's requests.

    Args:
        model: the stage's model; ``model(batch[, pp_input])`` returns logits on local rows.
        prompts: every request's prompt ids (this rank runs request i if i mod dp is its
            DP rank).
        max_new_tokens: steps, the prefill included.
        dp, dp_rank: attention DP.
        keep_logits: keep each step's last-position logits.
        on_step: called with the step index before each forward.
        pp, split_prefill: pipeline parallelism (``pp``: the pipeline group).
        tbo: when a forward runs as two interleaved microbatches (``tbo_decision`` per
            forward under ``AUTO``; each decision is kept in ``Generation.tbo``).
        variants: the batch variant of the prefill and of each decode step (CP for both
            on an attention-CP topology; a sequence-parallel prefill with ordinary decode).
        adapters: each request's LoRA adapter slot (-1: the base model), or None (every
            request on the base model).
        bucket: for a compiled model, ``bucket(tokens)`` is the row count each forward is
            padded to (``runtime.token_bucket``), so that one graph serves every batch of a
            bucket; the cache takes one more slot, the padding's. A cache that cannot serve
            padded batches (``KVCache.padded_batches``), a TBO forward and a split prefill run
            unpadded.
        pad_prefill: pad the prefill to its bucket too (False: decode steps only, for a
            forward that captures decode graphs and runs the prefill eagerly).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
    mine = requests_of(dp_rank, dp, len(prompts))
    slots = max(1, len(mine)) + (bucket is not None)  # the last one the padding's
    cache = model.make_kv_cache(slots, max(len(p) for p in prompts) + max_new_tokens)
    pad = bucket is not None and declared(cache, "padded_batches", False)
    decisions = []
    backend = dist.get_backend() if dist.is_initialized() else None  # what AUTO asks
    new_tokens = [list(prompts[i]) for i in mine]
    prefix = [0] * len(mine)
    lens_of = lambda step: tuple(  # noqa: E731 - every DP rank's requests' tokens this step
        tuple(len(prompts[i]) if step == 0 else 1 for i in requests_of(r, dp, len(prompts)))
        for r in range(dp))
    generated = [[] for _ in mine]
    logits_out = [[] for _ in mine]
    stage = getattr(model, "stage", None)
    link = PipelineLink.of(model, pp)
    for step in range(max_new_tokens):
        if on_step is not None:
            on_step(step)
        mode = ForwardMode.EXTEND if step == 0 else ForwardMode.DECODE
        lens = lens_of(step)
        batch = ForwardBatch.build(mode, new_tokens, prefix,
                                   dp_token_counts=tuple(map(sum, lens)), kv_cache=cache,
                                   device=model.device)
        decision = tbo_decision(tbo, lens, backend)
        decisions.append(decision)
        batch.dp_request_lens, batch.tbo = lens, decision.split
        batch.logits_rows = LogitsRows.LAST  # the next token reads each request's last row
        batch.variant = variants[0] if step == 0 else variants[1]
        if adapters is not None:  # each token runs its request's adapter
            batch.lora_ids = torch.tensor(
                [adapters[i] for i, t in zip(mine, new_tokens) for _ in t], dtype=torch.long,
                device=model.device)
        pp_input = link.receive()
        parts = split_prefill if step == 0 and stage is not None else 1
        run = batch
        if pad and parts == 1 and not decision.split and (step > 0 or pad_prefill):
            run = batch.padded(bucket(max(batch.dp_token_counts)), scratch_slot=slots - 1)
        for segment in (segments(stage.layers, parts) if parts > 1 else [None]):
            run.layer_segment = segment
            out = model(run, pp_input) if stage is not None else model(run)
        if not link.last:
            link.send(out)
            tokens = torch.zeros(len(mine), dtype=torch.long, device=model.device)
        else:
            # [requests, vocab]: the model computed the last rows only, or every row (a padded
            # batch, a model that ignores logits_rows)
            picked = batch.last_rows(out).float()
            tokens = (picked.argmax(-1) if len(mine)
                      else torch.zeros(0, dtype=torch.long, device=picked.device))
            if keep_logits:
                for j in range(len(mine)):
                    logits_out[j].append(picked[j].clone())
        tokens = link.share_tokens(tokens)  # every stage builds the next step from them
        for j, token in enumerate(tokens.tolist()):
            generated[j].append(token)
        prefix = [p + len(t) for p, t in zip(prefix, new_tokens)]
        new_tokens = [[g[-1]] for g in generated]
    return Generation(mine, generated, logits_out, decisions)
