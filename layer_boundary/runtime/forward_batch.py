"""ForwardBatch: the batch facts a forward reads, and the residual stream it carries; the row
buckets a compiled forward pads its batches to."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import torch


class ForwardMode(enum.Enum):
    """What a forward computes: a prefill (``EXTEND``) or one token per request (``DECODE``)."""

    EXTEND = "extend"  # prefill (possibly continuing a cached prefix)
    DECODE = "decode"  # one new token per request


class LogitsRows(enum.Enum):
    """Which rows of a forward the LM head computes (and, under attention TP, gathers)."""

    ALL = "all"  # every token's: parity checks, speculative verification
    LAST = "last"  # each request's last token: what generating the next token needs


class BatchVariant(enum.Enum):
    """Row variants a stage plan may support; the value is how errors name it."""

    ORDINARY = "ordinary"
    CP = "CP"
    INPUT_SCATTERED = "input-scattered"
    SEQUENCE_PARALLEL = "sequence-parallel"


class TwoBatch(enum.Enum):
    """How a forward runs with two-batch overlap: one field where there were three flags."""

    NONE = "none"  # one batch, every sum where its path runs it
    OVERLAPPED = "overlapped"  # split into two microbatches whose owed sums start early
    SYNCHRONOUS = "synchronous"  # split into two microbatches, every sum synchronous (a baseline)
    MICROBATCH = "microbatch"  # one overlapped microbatch: owed sums start at the finish

    @property
    def splits(self) -> bool:
        """The stack runs this batch as two interleaved microbatches."""
        return self is TwoBatch.OVERLAPPED or self is TwoBatch.SYNCHRONOUS


class BatchRequest(NamedTuple):
    """One request of a forward as its rows hold it (``ForwardBatch.requests()``)."""

    index: int  # its place in the batch's request order
    slot: int  # its KV-cache slot (``req_slots``)
    prefix: int  # its tokens cached before this forward (``prefix_lens``)
    extend: int  # its tokens in this forward (``extend_lens``): rows [start, end)
    start: int  # its first row of this forward's tokens
    end: int  # one past its last row


@runtime_checkable
class BoundaryState(Protocol):
    """What a boundary library keeps on a batch for one forward; the runtime only carries it
    (``layer_boundary.residual.stream.ForwardState`` is the package's)."""

    stream: object  # the residual stream between stack entry and exit (None outside)
    facts: object  # the forward's row facts, placed by its first boundary (None before)
    memo: dict  # what the forward computes once and shares (``ForwardBatch.per_forward``)


@dataclass(eq=False)
class ForwardBatch:
    """This rank's requests for one forward.

    ``input_ids``/``positions`` hold this attention-DP rank's tokens, requests concatenated.
    ``dp_token_counts`` holds every attention-DP rank's token count in DP rank order (any may
    be 0); it is what boundaries use to place rows, so it must agree on all ranks.
    """

    forward_mode: ForwardMode  # prefill/extend or decode (a row mode is ``row_facts.mode``)
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seq_lens: tuple[int, ...]  # per request: total length after this forward
    extend_lens: tuple[int, ...]  # per request: tokens in this forward
    dp_token_counts: tuple[int, ...]
    req_slots: tuple[int, ...] = ()  # KV cache slot of each request
    kv_cache: object = None
    variant: BatchVariant = BatchVariant.ORDINARY
    # the boundary library's state for this forward: its residual stream, row facts, and
    # what a forward carries between calls (split-prefill segments, per-token facts, TBO
    # microbatches); one typed slot, set by the stack's entry
    boundary: BoundaryState | None = None
    # split prefill: the global layers [start, stop) this call runs (None: all of this
    # pipeline stage's); a stage's segments run in order on one batch
    layer_segment: tuple[int, int] | None = None
    # every attention-DP rank's requests' token counts in this forward (what a two-batch
    # overlap split needs to agree on all ranks); None where no split is asked
    dp_request_lens: tuple | None = None
    # two-batch overlap: none, a batch to split (its sums overlapped, or synchronous: the
    # baseline the benchmark compares with), or one overlapped microbatch
    two_batch: TwoBatch = TwoBatch.NONE
    # LoRA: each local token's adapter slot (-1: the base model), [T] int64; None: every
    # token runs the base model (adapters/lora.py publishes it on each stage's compute rows)
    lora_ids: torch.Tensor | None = None
    # a padded batch (``padded()``): each row's KV-cache slot, [T] int64; attention then reads
    # slots and positions from tensors only, never the per-request tuples above, so a
    # compiled forward's graph depends on the padded row count alone
    token_slots: torch.Tensor | None = None
    # the LM head's rows: every token's, or each request's last (``LogitsRows.LAST``: the
    # logits are [requests, vocab], in request order). A padded batch computes every row's,
    # so its graph stays one bucket's
    logits_rows: LogitsRows = LogitsRows.ALL

    @property
    def tbo(self) -> bool:
        """Whether the stack runs this batch as two microbatches (``two_batch.splits``);
        setting it asks for the overlapped split (False: none)."""
        return self.two_batch.splits

    @tbo.setter
    def tbo(self, value: bool) -> None:
        self.two_batch = TwoBatch.OVERLAPPED if value else TwoBatch.NONE

    @property
    def tbo_synchronous(self) -> bool:
        """A split whose sums all run synchronously (``TwoBatch.SYNCHRONOUS``)."""
        return self.two_batch is TwoBatch.SYNCHRONOUS

    @tbo_synchronous.setter
    def tbo_synchronous(self, value: bool) -> None:
        if value:
            self.two_batch = TwoBatch.SYNCHRONOUS
        elif self.two_batch is TwoBatch.SYNCHRONOUS:
            self.two_batch = TwoBatch.OVERLAPPED

    @property
    def overlap(self) -> bool:
        """An overlapped microbatch: owed sums start at the producer's finish,
        asynchronously (``TwoBatch.MICROBATCH``)."""
        return self.two_batch is TwoBatch.MICROBATCH

    @property
    def residual_stream(self):
        """The residual stream of this forward (``boundary.stream``; None outside a stack)."""
        return None if self.boundary is None else self.boundary.stream

    @property
    def row_facts(self):
        """The row facts this forward's first boundary placed (``boundary.facts``)."""
        return None if self.boundary is None else self.boundary.facts

    @property
    def rows(self):
        """``row_facts``, by its earlier name (deprecated: ``rows`` names layouts)."""
        return None if self.boundary is None else self.boundary.facts

    def per_forward(self, key, compute):
        """What one forward's layers compute once and share (the rotary tables of its
        positions, its attention groups): ``compute()`` on the first call with ``key`` after
        the stack's entry, the same object on later calls of that forward (a microbatch of
        two-batch overlap is a forward of its own); computed on every call outside a stack
        (no boundary state, or a forward that has left it), whose cache is gone with it.

        Args:
            key: what names the value (hashable, fixed at construction: never a tensor).
            compute: makes the value; called with no arguments.
        """
        state = self.boundary
        if state is None or state.stream is None:
            return compute()
        memo = state.memo
        value = memo.get(key)
        if value is None:
            value = memo[key] = compute()
        return value

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def real_tokens(self) -> int:
        """The rows its requests bring (a padded batch's rows before the padding)."""
        return sum(self.extend_lens)

    def last_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Each request's last row of ``rows`` (per-token rows of this batch, its own rows
        first: a padded batch's padding comes after them), [requests, ...]; ``rows`` that
        already hold one row per request are returned as they are."""
        ends, end = [], -1
        for n in self.extend_lens:
            end += n
            ends.append(end)
        if len(ends) == rows.shape[0]:  # a decode step, or rows already one per request
            return rows
        return rows[torch.tensor(ends, dtype=torch.long, device=rows.device)]

    @property
    def prefix_lens(self) -> tuple[int, ...]:
        return tuple(s - e for s, e in zip(self.seq_lens, self.extend_lens))

    def requests(self) -> tuple[BatchRequest, ...]:
        """Each request with its rows, in row order (its slot, cached prefix, and its rows
        [start, end) of this forward's tokens): what a per-request loop walks. A padded
        batch's padding rows come after the last request's ``end``."""
        out, start, slots = [], 0, self.req_slots
        for i, (seq, n) in enumerate(zip(self.seq_lens, self.extend_lens)):
            out.append(BatchRequest(i, slots[i], seq - n, n, start, start + n))
            start += n
        return tuple(out)

    @property
    def decode_step(self) -> bool:
        """Every request adds one token to a cached prefix (a decode step): a recurrent
        mixer or a short convolution then moves every request's state on in one call."""
        return bool(self.extend_lens) and all(
            n == 1 and p > 0 for n, p in zip(self.extend_lens, self.prefix_lens))

    def padded(self, tokens: int, scratch_slot: int) -> ForwardBatch:
        """This batch with ``tokens`` rows on every attention-DP rank (a compiled forward's
        bucket), its own rows first.

        The padding rows are token 0 at position 0 of KV-cache slot ``scratch_slot``, a slot
        no request uses: they attend only each other, and every row's output depends on its
        own row alone, so the real rows' numbers are those of the unpadded batch. Every DP
        rank pads to the same ``tokens`` (pick it from the largest of ``dp_token_counts``).

        Args:
            tokens: the padded row count of every DP rank (at least the largest DP count).
            scratch_slot: a KV-cache slot outside ``req_slots``.
        """
        mine = self.num_tokens
        if tokens < max(self.dp_token_counts):
            raise ValueError(f"cannot pad to {tokens} rows: a DP rank holds "
                             f"{max(self.dp_token_counts)} (dp_token_counts "
                             f"{self.dp_token_counts})")
        if scratch_slot in self.req_slots:
            raise ValueError(f"scratch slot {scratch_slot} is a request's slot "
                             f"(req_slots {self.req_slots})")
        if (self.variant is BatchVariant.CP or self.two_batch is not TwoBatch.NONE
                or self.layer_segment is not None):
            raise ValueError("a CP batch, a two-batch-overlap batch and a split-prefill segment "
                             "are not padded (their splits read the per-request lengths)")
        extra = tokens - mine
        slots = torch.tensor([s for s, n in zip(self.req_slots, self.extend_lens)
                              for _ in range(n)] + [scratch_slot] * extra, dtype=torch.long,
                             device=self.input_ids.device)
        pad = self.input_ids.new_zeros(extra)
        return dataclasses.replace(
            self, input_ids=torch.cat((self.input_ids, pad)),
            positions=torch.cat((self.positions, pad)),
            dp_token_counts=(tokens,) * len(self.dp_token_counts), dp_request_lens=None,
            lora_ids=None if self.lora_ids is None else torch.cat(
                (self.lora_ids, self.lora_ids.new_full((extra,), -1))),
            token_slots=slots, boundary=None)

    @classmethod
    def build(cls, forward_mode: ForwardMode, requests: list[list[int]], prefix_lens: list[int],
              dp_token_counts: tuple[int, ...] | None = None, req_slots=None, kv_cache=None,
              device: torch.device | str = "cpu") -> ForwardBatch:
        """Batch of ``requests`` (token ids new in this forward) after ``prefix_lens`` cached
        ones (one each, non-negative), in the cache slots ``req_slots`` (distinct; default
        0, 1, ...). A mismatch is a ValueError naming it: ``zip`` dropped the requests
        without a prefix length."""
        _check_build(forward_mode, requests, prefix_lens, req_slots)
        ids = [t for r in requests for t in r]
        pos = [p + i for r, p in zip(requests, prefix_lens) for i in range(len(r))]
        extend = tuple(len(r) for r in requests)
        if dp_token_counts is None:
            dp_token_counts = (len(ids),)
        return cls(
            forward_mode=forward_mode,
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(pos, dtype=torch.long, device=device),
            seq_lens=tuple(p + e for p, e in zip(prefix_lens, extend)),
            extend_lens=extend,
            dp_token_counts=tuple(dp_token_counts),
            req_slots=tuple(req_slots if req_slots is not None else range(len(requests))),
            kv_cache=kv_cache,
        )


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_build(forward_mode, requests, prefix_lens, req_slots) -> None:
    if not isinstance(forward_mode, ForwardMode):
        raise TypeError(f"ForwardBatch.build(forward_mode={forward_mode!r}): forward_mode must "
                        "be a ForwardMode")
    if len(prefix_lens) != len(requests) or not all(map(_is_count, prefix_lens)):
        raise ValueError(f"ForwardBatch.build: prefix_lens {list(prefix_lens)} must give each "
                         f"of the {len(requests)} requests its cached length (a non-negative "
                         "integer)")
    if req_slots is not None and (len(req_slots) != len(requests)
                                  or not all(map(_is_count, req_slots))
                                  or len(set(req_slots)) != len(req_slots)):
        raise ValueError(f"ForwardBatch.build: req_slots {list(req_slots)} must give each of "
                         f"the {len(requests)} requests its own cache slot (distinct "
                         "non-negative integers)")


SMALLEST_BUCKET = 1
BUCKET_STEP, STEPPED_UP_TO = 8, 64


def token_bucket(tokens: int) -> int:
    """The padded row count of a compiled forward over ``tokens`` rows, on the ladder engines
    capture decode graphs on: 1, 2, 4, 8, then every ``BUCKET_STEP`` rows up to
    ``STEPPED_UP_TO`` (16, 24, ..., 64), then powers of two. A one-request decode runs its
    exact shape; padding wastes at most 7 rows up to 64 and half the rows beyond (prefills),
    and the graphs stay few: 11 up to 64 rows, one per doubling after."""
    if not _is_count(tokens):
        raise ValueError(f"token_bucket(tokens={tokens!r}): tokens must be a non-negative "
                         "integer")
    if tokens <= BUCKET_STEP:
        return 1 << max(0, tokens - 1).bit_length()
    if tokens <= STEPPED_UP_TO:
        return -(-tokens // BUCKET_STEP) * BUCKET_STEP
    return 1 << (tokens - 1).bit_length()
