"""The communication ledger: what each collective records and the ring-formula bytes."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from distributed.pool import get_pool
from layer_boundary.runtime.collectives import all_reduce_rows, gather_last_dim
from layer_boundary.runtime.ledger import LEDGER, LedgerEntry, ledger_site, summarize
from layer_boundary.runtime.parallel import Group, ParallelDims, build_parallel


def _ring_bytes(kind, numel, dtype, n):
    size = numel * torch.empty((), dtype=dtype).element_size()
    if kind == "all_to_all":  # its numel already counts only what goes to the other ranks
        return Fraction(size)
    factor = Fraction(2 * (n - 1), n) if kind == "all_reduce" else Fraction(n - 1, n)
    return factor * size


def _as_tuple(e):
    return (e.kind, e.group, e.group_size, e.numel, e.dtype, e.site, e.step, e.bytes)


# ------------------------------------------------------------------ on real ranks


def _collectives(kwargs, group_name, dtype, shape):
    n = dist.get_world_size()
    par = build_parallel(ParallelDims(world_size=n, **kwargs))
    group = getattr(par, f"{group_name}_group")
    x = torch.ones(shape, dtype=dtype)
    before = len(LEDGER.entries)
    all_reduce_rows(x.clone(), group)  # not recording: nothing may be kept
    unrecorded = len(LEDGER.entries) - before, LEDGER.enabled
    # Site and step are process-wide: a recording starts them fresh and restores them after.
    outside = (LEDGER.site, LEDGER.step)
    with LEDGER.recording() as entries, ledger_site("probe"):
        assert LEDGER.step == 0
        all_reduce_rows(x.clone(), group)
        with ledger_site("stage0.exit"):
            gather_last_dim(x.clone(), group)
        LEDGER.step = 2
        with ledger_site("lm_head"):
            all_reduce_rows(x.clone(), group)
        site_after_nested = LEDGER.site
    restored = (LEDGER.site, LEDGER.step) == outside and LEDGER.enabled is False
    return unrecorded, [_as_tuple(e) for e in entries], site_after_nested, restored


# (world, dims, group used, its size, dtype, shape)
CASES = [
    (2, dict(tp=2), "tp", 2, torch.float32, (4, 6)),
    (2, dict(tp=2), "tp", 2, torch.bfloat16, (3, 8)),
    (4, dict(tp=4), "tp", 4, torch.float32, (4, 6)),
    (4, dict(tp=4), "tp", 4, torch.float64, (2, 3, 4)),
    (4, dict(tp=4, attn_dp=2), "attn_tp", 2, torch.float32, (5, 4)),
    (4, dict(tp=4, attn_dp=2), "attn_dp", 2, torch.float16, (5, 4)),
]


@pytest.mark.parametrize("world, kwargs, group_name, n, dtype, shape", CASES,
                         ids=[f"w{c[0]}-{c[2]}-{c[4]}".replace("torch.", "") for c in CASES])
def test_entries_on_real_ranks(world, kwargs, group_name, n, dtype, shape):
    results = get_pool(world).run(_collectives, kwargs, group_name, dtype, shape)
    numel = 1
    for s in shape:
        numel *= s
    expected = [
        ("all_reduce", group_name, n, numel, dtype, "probe", 0,
         _ring_bytes("all_reduce", numel, dtype, n)),
        ("all_gather", group_name, n, numel * n, dtype, "stage0.exit", 0,
         _ring_bytes("all_gather", numel * n, dtype, n)),
        ("all_reduce", group_name, n, numel, dtype, "lm_head", 2,
         _ring_bytes("all_reduce", numel, dtype, n)),
    ]
    for r, (unrecorded, entries, site_after_nested, restored) in enumerate(results):
        assert unrecorded == (0, False), f"rank {r} recorded outside recording()"
        assert entries == expected, f"rank {r}"
        assert site_after_nested == "probe" and restored, f"rank {r} did not restore the ledger"


# ------------------------------------------------------------------ in this process

_TP2 = Group("tp", (0, 1), 0)
_TP4 = Group("attn_tp", (0, 1, 2, 3), 1)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]),
    n=st.integers(1, 16),
    rows=st.integers(0, 64),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64,
                           torch.int8]),
)
def test_bytes_follow_the_ring_formula(kind, n, rows, dtype):
    numel = rows * n  # a whole number of bytes per rank, so no rounding policy is assumed
    entry = LedgerEntry(kind, "tp", n, numel, dtype, "x")
    expected = _ring_bytes(kind, numel, dtype, n)
    assert expected.denominator == 1
    assert entry.bytes == expected and isinstance(entry.bytes, int)


def test_nothing_recorded_when_not_recording():
    assert LEDGER.enabled is False
    kept = LEDGER.entries
    before = list(kept)
    LEDGER.record("all_reduce", _TP2, 10, torch.float32)
    assert LEDGER.entries is kept and LEDGER.entries == before


def test_recording_nests_and_restores():
    outer_state = (LEDGER.enabled, LEDGER.entries)
    site = "model"  # a recording starts from the default site, whatever ran before
    with LEDGER.recording() as outer:
        assert LEDGER.enabled and outer == []
        LEDGER.record("all_reduce", _TP2, 10, torch.float32)
        # the inner recorder shadows the outer one: its block's entries are its own only
        with LEDGER.recording() as inner:
            assert inner is not outer and inner == []
            with ledger_site("embed"):
                LEDGER.record("all_gather", _TP4, 8, torch.bfloat16)
            assert LEDGER.site == site
        assert LEDGER.enabled and LEDGER.entries is outer
        LEDGER.record("reduce_scatter", _TP4, 4, torch.float16)
    assert (LEDGER.enabled, LEDGER.entries) == outer_state
    assert LEDGER.entries is outer_state[1]
    assert [(e.kind, e.group, e.group_size, e.numel, e.dtype, e.site) for e in outer] == [
        ("all_reduce", "tp", 2, 10, torch.float32, site),
        ("reduce_scatter", "attn_tp", 4, 4, torch.float16, site),
    ]
    assert [(e.kind, e.group, e.group_size, e.numel, e.dtype, e.site) for e in inner] == [
        ("all_gather", "attn_tp", 4, 8, torch.bfloat16, "embed"),
    ]


def test_recording_and_site_restore_after_an_exception():
    state = (LEDGER.enabled, LEDGER.entries, LEDGER.site)
    with pytest.raises(KeyError):
        with LEDGER.recording():
            with ledger_site("boom"):
                raise KeyError("x")
    assert (LEDGER.enabled, LEDGER.entries, LEDGER.site) == state


def test_summarize_totals_per_kind():
    entries = [LedgerEntry("all_reduce", "tp", 4, 100, torch.float32, "a"),
               LedgerEntry("all_reduce", "tp", 2, 64, torch.bfloat16, "b"),
               LedgerEntry("all_gather", "tp", 4, 40, torch.float32, "c")]
    all_reduce_bytes = (_ring_bytes("all_reduce", 100, torch.float32, 4)
                        + _ring_bytes("all_reduce", 64, torch.bfloat16, 2))
    assert summarize(entries) == {
        "all_reduce": {"count": 2, "bytes": int(all_reduce_bytes)},
        "all_gather": {"count": 1, "bytes": int(_ring_bytes("all_gather", 40, torch.float32, 4))},
    }
    assert summarize([]) == {}


# ------------------------------------------------------------------ the observer hook


class Recorder:
    """An observer that keeps every event it is told, in order."""

    def __init__(self) -> None:
        self.events = []

    def enter(self, site):
        self.events.append(("enter", site))

    def collective(self, kind, group, numel, dtype, site):
        self.events.append(("collective", kind, group.name, site))

    def boundary(self, site, stream, rows):
        self.events.append(("boundary", site, stream.state.value))


def _toy_forward(tp: int):
    from toy import HIDDEN, ToyStack, batch, runtime

    from layer_boundary.residual import batch as residual_batch

    stack, fb = ToyStack(runtime(tp), 2), batch(4)
    residual_batch.start(fb)
    h = torch.ones(4, HIDDEN)
    for layer in stack.layers:
        h = layer.forward_layer(h, fb)
    return stack.final(h, fb)


def observed_forward(tp: int):
    from layer_boundary.runtime import HOOK, observing

    state = (LEDGER.site, LEDGER.step, LEDGER.entries, LEDGER.traces, HOOK.observer)
    _toy_forward(tp)  # no observer: nothing process-wide changes for it
    untouched = state == (LEDGER.site, LEDGER.step, LEDGER.entries, LEDGER.traces,
                          HOOK.observer)
    recorder = Recorder()
    with observing(recorder):
        _toy_forward(tp)
    return untouched, recorder.events, HOOK.observer is None


@pytest.mark.timeout(60)
def test_one_hook_observes_a_forward_and_nothing_else_changes():
    for untouched, events, restored in get_pool(2).run(observed_forward, 2):
        assert untouched and restored
        sites = [e[1] for e in events if e[0] == "enter"]
        assert sites[:4] == ["layer0.attn.prepare", "layer0.attn.compute", "layer0.attn.finish",
                             "layer0.ffn.prepare"]
        assert sites[-1] == "final_norm"
        # each collective is reported after the phase that ran it was entered
        current = None
        for e in events:
            if e[0] == "enter":
                current = e[1]
            elif e[0] == "collective":
                assert e[3] is None and current is not None
        assert [e for e in events if e[0] == "boundary"][-1] == ("boundary", "final_norm",
                                                                 "written")
        assert any(e[0] == "collective" for e in events)


def uneven_gather_and_reduce_scatter():
    """On 4 ranks: a variable gather of 1, 3, 0 and 2 rows (gloo pads each to 3) and a
    reduce-scatter of 8 rows, synchronous (an exchange of blocks) and issued asynchronously
    (gloo's own), under a recording ledger and a protocol-only observer."""
    from layer_boundary.runtime import observing
    from layer_boundary.runtime.collectives import (gather_rows_v, issuing_async,
                                                    reduce_scatter_rows)

    par = build_parallel(ParallelDims(world_size=4, tp=4))
    sizes = (1, 3, 0, 2)
    x = torch.ones(sizes[par.tp_group.rank], 5)
    recorder = Recorder()
    with LEDGER.recording() as entries:
        gathered = gather_rows_v(x, par.tp_group, sizes)
        reduce_scatter_rows(torch.ones(8, 5), par.tp_group)
        with issuing_async() as issued:
            reduce_scatter_rows(torch.ones(8, 5), par.tp_group)
        for work, _ in issued:
            work.wait()
        with observing(recorder):  # it takes the protocol's five arguments only
            gather_rows_v(x, par.tp_group, sizes)
    return list(entries), gathered.shape[0], recorder.events


@pytest.mark.timeout(60)
def test_the_wire_figure_says_what_gloo_moves():
    """Logical bytes are the ring figure of what the collective must move; gloo's wire
    figure pads a variable gather to the widest rank, and a reduce-scatter moves the ring
    figure as an exchange of blocks, or, issued asynchronously, gloo's own: an all-reduce of
    the whole tensor; any other backend's is the logical one."""
    for entries, rows, events in get_pool(4).run(uneven_gather_and_reduce_scatter, timeout=50):
        assert rows == 6
        gather, scatter, issued = entries
        assert (gather.kind, gather.numel, gather.wire_numel) == ("all_gather", 6 * 5, 12 * 5)
        assert gather.bytes == 3 * 6 * 5 * 4 // 4 and gather.wire_bytes() == 3 * 12 * 5 * 4 // 4
        # sent to the other three: their 2-row blocks
        assert (scatter.kind, scatter.wire_numel, scatter.wire_kind) == (
            "reduce_scatter", 3 * 2 * 5, "all_to_all")
        assert scatter.wire_bytes() == 3 * 2 * 5 * 4 == scatter.bytes == 3 * 8 * 5 * 4 // 4
        assert (issued.kind, issued.wire_numel, issued.wire_kind) == ("reduce_scatter", None,
                                                                      None)
        assert issued.wire_bytes() == 2 * 3 * 8 * 5 * 4 // 4 == 2 * issued.bytes
        assert gather.wire_bytes("nccl") == gather.bytes
        assert scatter.wire_bytes("nccl") == issued.wire_bytes("nccl") == scatter.bytes
        assert events == [("collective", "all_gather", "tp", None)]
