"""Two-batch overlap (TBO): two microbatches, each with its own residual stream, interleaved.

A forward batch splits by requests: each attention-DP rank splits its own requests into a
first and a second group with token counts as even as the requests allow (a group may be empty
on some rank, or everywhere). Every rank computes every DP rank's split from the batch's
``dp_request_lens``, so the microbatches' DP token counts agree on all ranks. Each microbatch
enters with ``ResidualStream.arrive()`` (a stream it owns: a stream reached through another
batch raises) and the operations of the two interleave, stage by stage; at every switch (a
yield point) no ``exit()`` scope may be open, so no compute flag of one microbatch is seen by
the other. The outputs merge back in request order: on every rank the first microbatch holds
the first requests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

import torch

from ..residual.stream import ForwardState, ResidualStream
from ..runtime.arguments import flag
from ..runtime.capabilities import Feature, check_invariant
from ..runtime.context import open_exit_scopes
from ..runtime.forward_batch import TwoBatch

EXIT_ACROSS_YIELD = ("an exit() scope is open across a two-batch-overlap yield point: finish "
                     "the stage's compute inside the scope before the other microbatch runs")


def split_point(lens) -> int:
    """How many of ``lens`` (one DP rank's requests' token counts) the first microbatch takes:
    the most even split of tokens, the first microbatch taking the larger half on a tie."""
    total = sum(lens)
    # the smallest gap; on a tie, the larger first half (its prefix sum is the larger one)
    return min(range(len(lens) + 1),
               key=lambda i: (abs(total - 2 * sum(lens[:i])), -sum(lens[:i])))


def split_counts(dp_request_lens) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Every DP rank's token counts in the first and the second microbatch."""
    cuts = [split_point(lens) for lens in dp_request_lens]
    first = tuple(sum(lens[:k]) for lens, k in zip(dp_request_lens, cuts))
    second = tuple(sum(lens[k:]) for lens, k in zip(dp_request_lens, cuts))
    return first, second


def split_batch(forward_batch, dp_rank: int = 0, overlap: bool = True) -> list:
    """The two microbatches of ``forward_batch``.

    Args:
        forward_batch: the batch; under attention DP it needs ``dp_request_lens``.
        dp_rank: this rank's attention-DP rank.
        overlap: owed sums start asynchronously at a producer's finish (False: synchronous,
            a baseline for benchmarks).
    """
    flag("split_batch", "overlap", overlap)
    # the way into two microbatches, an outside model's too: refused in the batch-invariant
    # mode by the combination table's pair rule
    check_invariant(None, (Feature.TBO,))
    fb = forward_batch
    lens = fb.dp_request_lens
    if lens is None:
        if len(fb.dp_token_counts) > 1:
            raise ValueError("two-batch overlap under attention DP needs every DP rank's request "
                             "lengths (ForwardBatch.dp_request_lens)")
        lens = (fb.extend_lens,)
    if tuple(lens[dp_rank]) != tuple(fb.extend_lens):
        raise ValueError(f"ForwardBatch.dp_request_lens[{dp_rank}] {tuple(lens[dp_rank])} is not "
                         f"this rank's requests {tuple(fb.extend_lens)}")
    k = split_point(lens[dp_rank])
    tokens = sum(fb.extend_lens[:k])
    counts = split_counts(lens)
    parts = []
    for (lo, hi), (t0, t1), mine, theirs in (
            ((0, k), (0, tokens), counts[0], tuple(x[:split_point(x)] for x in lens)),
            ((k, len(fb.extend_lens)), (tokens, fb.num_tokens), counts[1],
             tuple(x[split_point(x):] for x in lens))):
        parts.append(replace(
            fb, input_ids=fb.input_ids[t0:t1], positions=fb.positions[t0:t1],
            seq_lens=fb.seq_lens[lo:hi], extend_lens=fb.extend_lens[lo:hi],
            req_slots=fb.req_slots[lo:hi], dp_token_counts=mine, dp_request_lens=theirs,
            boundary=None, layer_segment=None,
            two_batch=TwoBatch.MICROBATCH if overlap else TwoBatch.NONE,
            lora_ids=None if fb.lora_ids is None else fb.lora_ids[t0:t1]))
    return parts


def check_yield() -> None:
    """A switch between microbatches: no exit scope (and so no compute flag) may be open."""
    if open_exit_scopes():
        raise RuntimeError(EXIT_ACROSS_YIELD)


def interleave(operations) -> None:
    """Run two microbatches' operation lists alternately (A0, B0, A1, B1, ...), checking each
    yield point."""
    for step in range(max(map(len, operations))):
        for ops in operations:
            if step < len(ops):
                ops[step]()
                check_yield()


def run_two_batches(forward_batch, hidden_states, dp_rank: int, layers, run_layer, leave):
    """The stack over two interleaved microbatches: split the stack's input, enter each
    microbatch with its own stream, run every layer on A then B, leave each, merge the outputs
    in request order. ``run_layer(layer, h, fb)``, ``leave(h, fb)`` as the stack's own.
    ``forward_batch.two_batch``: ``TwoBatch.SYNCHRONOUS`` runs the same schedule without
    asynchronous sums (what the overlap benchmark compares against)."""
    microbatches = split_batch(forward_batch, dp_rank,
                               overlap=forward_batch.two_batch is TwoBatch.OVERLAPPED)
    n = microbatches[0].num_tokens
    state = {id(mb): h for mb, h in zip(microbatches, (hidden_states[:n], hidden_states[n:]))}
    for mb in microbatches:
        ResidualStream.arrive(mb)

    def op(layer, mb):
        def run():
            state[id(mb)] = run_layer(layer, state[id(mb)], mb)
        return run

    def out(mb):
        def run():
            state[id(mb)] = leave(state[id(mb)], mb)
        return run

    interleave([[op(layer, mb) for layer in layers] + [out(mb)] for mb in microbatches])
    # the batch itself held no stream; its row facts are its first microbatch's (the row mode
    # of the forward, for reports), and each microbatch's rows stay on the microbatch
    forward_batch.boundary = ForwardState(facts=microbatches[0].row_facts,
                                          microbatches=microbatches)
    return torch.cat([state[id(mb)] for mb in microbatches])


class TboPolicy(Enum):
    """When a forward runs as two microbatches (``run --tbo [auto|always]``)."""

    OFF = "off"  # never
    AUTO = "auto"  # where the overlap pays (``tbo_decision``)
    ALWAYS = "always"  # every forward (tests, the overlap benchmark)


# why ``auto`` splits a forward or not, as the run report says it
SPLITS = "the collectives run beside compute and both microbatches hold tokens on every DP rank"
SHARED_CORES = ("gloo's collectives run on the ranks' own CPU cores, so an overlapped sum "
                "waits for a core the other microbatch is using: measured on this project's "
                "CPU ranks the split costs more than it hides at every size "
                "(docs/features.md#two-batch-overlap---tbo)")
ONE_RANK = "one process: no collective to hide"
ONE_SIDED = ("a microbatch would hold no tokens on some DP rank (one request there): nothing "
             "computes under that rank's collectives")


@dataclass(frozen=True)
class TboDecision:
    """Whether one forward splits, and why (the run report's words)."""

    split: bool
    reason: str


def tbo_decision(policy: TboPolicy, dp_request_lens, backend: str | None) -> TboDecision:
    """Whether a forward runs as two microbatches, as engines gate the overlap: it pays only
    where an owed sum of one microbatch can move while the other computes.

    Args:
        policy: ``OFF`` and ``ALWAYS`` decide alone; ``AUTO`` applies the rule below.
        dp_request_lens: every DP rank's requests' token counts in this forward.
        backend: the process group's backend (``torch.distributed.get_backend()``; None
            without one).

    ``AUTO`` splits where the collectives run on their own hardware (NCCL: copy engines and
    links beside the SMs) and each microbatch holds tokens on every DP rank; never on gloo,
    whose collectives compete for the ranks' cores (measured, ``bench.tbo_overlap``: the
    overlap hides part of the communication, less than the split costs)."""
    if not isinstance(policy, TboPolicy):  # "always" matched neither: read as "one rank"
        raise TypeError(f"tbo_decision(policy={policy!r}): policy must be a TboPolicy")
    if policy is TboPolicy.OFF:
        return TboDecision(False, "off")
    if policy is TboPolicy.ALWAYS:
        return TboDecision(True, "always")
    if backend is None:
        return TboDecision(False, ONE_RANK)
    if backend != "nccl":
        return TboDecision(False, SHARED_CORES)
    first, second = split_counts(dp_request_lens)
    if min(first) == 0 or min(second) == 0:
        return TboDecision(False, ONE_SIDED)
    return TboDecision(True, SPLITS)
