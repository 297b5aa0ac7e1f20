"""What the boundary costs the model: a boundary-integrated Qwen3 decoder against a
hand-written forward of the same modules doing the same tensor ops and, at tp > 1, the same
collectives a Megatron-style forward issues (one all-reduce after each attention and each MLP),
so only the boundary's Python, bookkeeping and path choice differ."""

from __future__ import annotations

import statistics
import time

import torch

from ..models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from ..residual import batch as residual_batch
from ..runtime.args import BoundaryRuntime
from ..runtime.collectives import all_reduce_rows
from ..runtime.forward_batch import ForwardBatch, ForwardMode
from ..runtime.packed import pack_linears, packed_bytes
from ..runtime.parallel import ParallelDims, build_parallel, virtual_parallel
from .compiled import compile_forward


BENCH_HEADS = 8  # attention heads of the overhead benchmark's model
PREFIX = 32  # each request's cached prompt before the timed decode step


def bench_config(hidden: int, layers: int, tp: int = 1) -> Qwen3Config:
    """The overhead benchmark's model: ``BENCH_HEADS`` heads of ``hidden // BENCH_HEADS``
    dims (even: the rotary turns pairs of dims, so ``hidden`` is a multiple of
    ``2 * BENCH_HEADS``), as many kv heads as ranks (at least 2), a 4x MLP."""
    return Qwen3Config(vocab_size=512, hidden_size=hidden, intermediate_size=4 * hidden,
                       num_hidden_layers=layers, num_attention_heads=BENCH_HEADS,
                       num_key_value_heads=max(2, tp), head_dim=hidden // BENCH_HEADS)


def bench_bytes(hidden: int, layers: int, requests: int, prefix: int = PREFIX) -> int:
    """What ``overhead`` holds at once on its one rank: the model's weights and their packed
    copies (counted on a meta-device build: nothing allocated), the cache of ``requests`` x
    ``prefix + 1`` positions, and the prefill's widest activations (a few [tokens, 4 x
    hidden] fp32 rows live together: within a fifth of the peak measured)."""
    cfg = bench_config(hidden, layers)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg, BoundaryRuntime(virtual_parallel(ParallelDims())))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cache = layers * 2 * requests * (prefix + 1) * cfg.num_key_value_heads * cfg.head_dim * 4
    activations = 8 * requests * prefix * cfg.intermediate_size * 4
    return weights + packed_bytes(model) + cache + activations


def hand_written(model, fb: ForwardBatch) -> torch.Tensor:
    """The same forward without boundaries: fp32 residual add + norm written inline; at
    tp > 1 the attention's partial is all-reduced by hand (the MLP's down projection reduces
    itself outside a boundary's scope). ``model``: the benchmark's Qwen3, ours or the
    Transformers backend's (``bench_model``): each layer's own attention, MLP and norms."""
    m = model.model
    attn_tp = m.layers[0].self_attn.o_proj.group  # the group its partial is a sum over
    # the forward's own state, as the stack's entry makes it: the layers share their
    # per-forward tables (rotary cos/sin, attention groups) as in the boundary's forward
    residual_batch.start(fb)
    residual = m.embed_tokens(fb.input_ids)
    x = m.layers[0].read_norms()[0](residual)
    for i, layer in enumerate(m.layers):
        attn_norm, ffn_norm = layer.read_norms()
        out = all_reduce_rows(layer.attend(fb.positions, x, fb), attn_tp)
        total = residual.float() + out.float()
        residual = total.to(dtype=out.dtype)
        x = _normalize(ffn_norm, total, out.dtype)
        out = layer.feed_forward(x, fb)
        total = residual.float() + out.float()
        residual = total.to(dtype=out.dtype)
        norm = m.layers[i + 1].read_norms()[0] if i + 1 < len(m.layers) else m.norm
        x = _normalize(norm, total, out.dtype)
    return model.lm_head(x)


def _normalize(norm, total: torch.Tensor, dtype) -> torch.Tensor:
    """``norm`` of the fp32 sum ``total``, in ``dtype``: our RMSNorm reads the fp32 sum;
    transformers' (the Transformers backend's) takes its input's dtype and computes in fp32."""
    if hasattr(norm, "normalize_fp32"):
        return norm.normalize_fp32(total, dtype)
    return norm(total.to(dtype))


def bench_model(cfg: Qwen3Config, runtime: BoundaryRuntime, impl: str = "native"):
    """The benchmark's Qwen3 of ``cfg`` on ``runtime``, its weights uninitialised: ours
    (``impl`` "native" or "auto": we have a Qwen3 file) or the Transformers backend's
    (``GenericCausalLM`` over transformers' Qwen3 modules of the same sizes, its probe
    passed first, as ``open_checkpoint`` runs it)."""
    if impl in ("auto", "native"):
        return Qwen3ForCausalLM(cfg, runtime)
    if impl != "transformers":
        raise ValueError(f"model impl {impl!r} is not one of auto, native, transformers")
    from ..models.generic.model import GenericCausalLM
    from ..models.generic.probe import check

    raw = {"model_type": "qwen3", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
           "intermediate_size": cfg.intermediate_size,
           "num_hidden_layers": cfg.num_hidden_layers,
           "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
           "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
           "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    generic = GenericCausalLM.config_class.from_dict(raw)
    check(generic)
    return GenericCausalLM(generic, runtime)


def _random_model(cfg: Qwen3Config, runtime: BoundaryRuntime | None = None,
                  impl: str = "native"):
    model = bench_model(cfg, runtime or BoundaryRuntime(build_parallel(ParallelDims())), impl)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    pack_linears(model)  # as load_model leaves it: both forwards run the same matmuls
    return model.eval()


def overhead(hidden: int = 256, layers: int = 8, requests: int = 16, prefix: int = PREFIX,
             repeats: int = 30, compile: str | None = None, model_impl: str = "native") -> dict:
    """Median decode-step time with and without boundaries at world 1, their ratio, and the
    boundary's cost per stage in microseconds (the difference of the fastest runs over the
    2 x layers stages). With ``compile`` (a torch.compile backend) both forwards run
    compiled, fullgraph; ``model_impl``: the model's implementation (``bench_model``)."""
    result = _overhead_rank(hidden, layers, requests, prefix, repeats, compile, "rs+rsv", 1,
                            model_impl)
    return {k: result[k] for k in ("hidden", "layers", "requests", "compile", "boundary_ms",
                                   "hand_written_ms", "overhead", "per_stage_us")}


def overhead_with_noise(hidden: int = 256, layers: int = 8, requests: int = 16,
                        prefix: int = PREFIX, repeats: int = 30,
                        compile: str | None = None, model_impl: str = "native") -> dict:
    """``overhead`` with the spread of the timed forwards: ``spread_ms`` (min, median, max of
    each kind) and ``noise`` (the hand-written forward's interquartile range over its
    median: an overhead smaller than it is not measured)."""
    return _overhead_rank(hidden, layers, requests, prefix, repeats, compile, "rs+rsv", 1,
                          model_impl)


def overhead_tp(tp: int, hidden: int = 256, layers: int = 8, requests: int = 16,
                prefix: int = 32, repeats: int = 20, boundary_reduction: str = "rs+rsv",
                compile: str | None = None) -> dict:
    """``overhead`` on ``tp`` spawned gloo ranks (no attention DP) against a hand-written
    Megatron-style forward (one all-reduce after each attention and each MLP); rank 0's
    figures, with the row mode the boundary ran (``mode``) and ``ratio`` (boundary / hand).

    Args:
        tp: ranks.
        hidden, layers, requests, prefix, repeats, compile: as ``overhead``.
        boundary_reduction: the boundary's policy (as ``--boundary-reduction``); ``rs+rsv``
            chooses per batch (``auto``'s choice), which takes ``ar`` where it moves fewer rows.
    """
    from ..runtime.launch import spawn

    return spawn(_overhead_rank, tp, hidden, layers, requests, prefix, repeats, compile,
                 boundary_reduction, tp)[0]


@torch.no_grad()
def _overhead_rank(hidden, layers, requests, prefix, repeats, compile, boundary_reduction,
                   tp: int, model_impl: str = "native") -> dict:
    cfg = bench_config(hidden, layers, tp)
    runtime = BoundaryRuntime(build_parallel(ParallelDims(world_size=tp, tp=tp)),
                              boundary_reduction=boundary_reduction,
                              choose_by_bytes=boundary_reduction == "rs+rsv")
    model = _random_model(cfg, runtime, model_impl)
    sync = _barrier if tp > 1 else (lambda: None)
    cache = model.make_kv_cache(requests, prefix + 1)
    prompts = [[(7 * r + t) % cfg.vocab_size for t in range(prefix)] for r in range(requests)]
    model(ForwardBatch.build(ForwardMode.EXTEND, prompts, [0] * requests, kv_cache=cache))

    def step():
        return ForwardBatch.build(ForwardMode.DECODE, [[1]] * requests, [prefix] * requests,
                                  kv_cache=cache)

    def by_hand(fb):
        return hand_written(model, fb)

    with_boundary = model
    if compile is not None:
        # every forward has the same shapes: static, as a padded engine's graphs are
        with_boundary = compile_forward(model, compile, padded=True)
        by_hand = torch.compile(by_hand, fullgraph=True, backend=compile, dynamic=False)
    probe = step()
    torch.testing.assert_close(with_boundary(probe), by_hand(step()), atol=1e-5, rtol=0)
    mode = probe.rows.mode.value if probe.rows is not None else None
    with_boundary(step()), by_hand(step())  # warm (and, compiled, settle any recompile)
    times = {"boundary": [], "hand_written": []}
    for _ in range(repeats):  # interleaved, so drift hits both alike
        for name, fn in (("boundary", with_boundary), ("hand_written", by_hand)):
            fb = step()
            sync()  # every rank starts the forward together
            start = time.perf_counter()
            fn(fb)
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    # the fixed cost per stage from the fastest runs: on a shared machine the medians of two
    # sub-millisecond forwards drift more than the boundary costs
    best = {k: min(v) for k, v in times.items()}
    # the spread of the hand-written forward's own times: an overhead inside it is noise
    hand = sorted(times["hand_written"])
    noise = (hand[len(hand) * 3 // 4] - hand[len(hand) // 4]) / med["hand_written"]
    return {"hidden": hidden, "layers": layers, "requests": requests, "compile": compile,
            "model_impl": model.impl, "tp": tp, "boundary_reduction": boundary_reduction,
            "spread_ms": {k: [min(v) * 1e3, med[k] * 1e3, max(v) * 1e3]
                          for k, v in times.items()},
            "noise": noise,
            "mode": mode,
            "ratio": med["boundary"] / med["hand_written"],
            "boundary_ms": med["boundary"] * 1e3, "hand_written_ms": med["hand_written"] * 1e3,
            "overhead": med["boundary"] / med["hand_written"] - 1.0,
            "per_stage_us": (best["boundary"] - best["hand_written"]) / (2 * layers) * 1e6}


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


class _CommClock:
    """Seconds this rank spends inside collectives: a synchronous call's whole time, an
    asynchronous one's ``wait()`` (what the overlap left exposed). Installed on
    ``torch.distributed`` in a benchmark rank only; the library calls through the module."""

    NAMES = ("all_reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
             "all_gather", "all_gather_single", "all_gather_into_tensor", "all_to_all_single")

    def __init__(self) -> None:
        import torch.distributed as dist

        self.seconds = 0.0
        for name in self.NAMES:
            if hasattr(dist, name):
                setattr(dist, name, self._timed(getattr(dist, name)))

    def _timed(self, call):
        clock = self

        class _Work:
            def __init__(self, work) -> None:
                self.work = work

            def wait(self, *args, **kwargs):
                start = time.perf_counter()
                try:
                    return self.work.wait(*args, **kwargs)
                finally:
                    clock.seconds += time.perf_counter() - start

            def __getattr__(self, name):
                return getattr(self.work, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                work = call(*args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - start
            return _Work(work) if kwargs.get("async_op") and work is not None else work
        return timed


def _moe_rank(hidden: int, layers: int, tokens: int, repeats: int) -> dict:
    """One rank of ``tbo_overlap``: median prefill times of the plain forward, the two-batch
    forward with synchronous collectives, and with its sums in flight across microbatches."""
    import torch.distributed as dist

    from ..models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM

    dims = ParallelDims(world_size=4, tp=4, attn_dp=2, moe_ep=2)
    runtime = BoundaryRuntime(build_parallel(dims), boundary_reduction="rs+rsv")
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=hidden // 8, moe_intermediate_size=hidden, num_experts=8,
                         num_experts_per_tok=2, norm_topk_prob=True)
    model = Qwen3MoeForCausalLM(cfg, runtime)
    gen = torch.Generator().manual_seed(0)  # the same on every rank: replicated weights agree
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    model.eval()
    per_request = tokens // 8  # 4 requests on each of the 2 DP ranks
    lens = ((per_request,) * 4,) * 2
    prompts = [[(13 * r + t) % cfg.vocab_size for t in range(per_request)] for r in range(4)]

    clock = _CommClock()

    def forward(tbo: bool, synchronous: bool = False):
        fb = ForwardBatch.build(ForwardMode.EXTEND, prompts, [0] * 4,
                                dp_token_counts=(4 * per_request,) * 2,
                                kv_cache=model.make_kv_cache(4, per_request))
        fb.dp_request_lens, fb.tbo = lens, tbo
        if synchronous:
            fb.tbo_synchronous = True
        dist.barrier()
        clock.seconds = 0.0
        start = time.perf_counter()
        out = model(fb)
        elapsed, exposed = time.perf_counter() - start, clock.seconds
        dist.barrier()
        return elapsed, exposed, out

    with torch.no_grad():
        plain = forward(False)[2]
        overlapped = forward(True)[2]
        torch.testing.assert_close(overlapped, plain, atol=1e-4, rtol=1e-4)
        kinds = ("plain", "tbo_synchronous", "tbo_overlapped")
        times = {k: [] for k in kinds}
        comm = {k: [] for k in kinds}
        for _ in range(repeats):  # interleaved, so drift hits all alike
            for kind, args in zip(kinds, ((False,), (True, True), (True,))):
                elapsed, exposed, _ = forward(*args)
                times[kind].append(elapsed)
                comm[kind].append(exposed)
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out.update({f"comm_{k}": statistics.median(v) * 1e3 for k, v in comm.items()})
    return out


def tbo_overlap(hidden: int = 512, layers: int = 4, tokens: int = 384, repeats: int = 10) -> dict:
    """Two-batch overlap on gloo: tp=4 dp=2 (EP 2) MoE prefill of ``tokens`` tokens, timed on
    the same ranks three ways, interleaved. Reports rank 0's median times (ms),
    ``tbo_vs_plain`` (the overlapped two-batch forward against the plain one: what a user of
    ``--tbo always`` gets), ``ratio`` (the overlapped forward against the same schedule with
    every collective synchronous), the time rank 0 spent in collectives in each (``comm_*``:
    a synchronous call's whole time, an asynchronous one's wait), ``hidden_fraction`` (the
    share of the synchronous schedule's collective time the overlap took off rank 0's
    critical path), ``hidden_ms`` (that time) against ``split_cost_ms`` (what the split
    itself costs: the synchronous two-batch forward over the plain one). The split pays
    where ``hidden_ms`` exceeds ``split_cost_ms``."""
    from ..runtime.launch import spawn

    result = spawn(_moe_rank, 4, hidden, layers, tokens, repeats)[0]
    sync = result["comm_tbo_synchronous"]
    result.update(hidden=hidden, layers=layers, tokens=tokens,
                  tbo_vs_plain=result["tbo_overlapped"] / result["plain"],
                  ratio=result["tbo_overlapped"] / result["tbo_synchronous"],
                  hidden_fraction=1 - result["comm_tbo_overlapped"] / sync if sync else 0.0,
                  split_cost_ms=result["tbo_synchronous"] - result["plain"],
                  hidden_ms=sync - result["comm_tbo_overlapped"])
    return result


def _path_bytes_rank(spec) -> dict:
    from .runner import run_rank

    result = run_rank(spec)
    per_step: dict[int, int] = {}
    for entry in result.ledger:
        per_step[entry.step] = per_step.get(entry.step, 0) + entry.bytes
    return {"bytes": [per_step.get(s, 0) for s in range(spec.max_new_tokens)],
            "modes": result.modes}


def path_bytes(model_dir: str, prompts: tuple, tp: int = 4, dp: int = 2, ranks=None) -> dict:
    """Rank 0's collective bytes per forward (the ledger's ring figures) in every row mode and
    under ``auto`` for one generation (a prefill, then one-token decode steps), and ``auto``'s
    bytes against the least of the explicit modes per forward (1.0: it took the cheapest).

    Args:
        model_dir: a checkpoint ``run`` accepts.
        prompts: the prompts (request i on DP rank i mod dp): skew them to make ``rsv`` pay.
        tp, dp: the topology (attention DP, no CP).
        ranks: ``ranks(fn, spec)`` runs ``fn(spec)`` on tp ranks and returns their results
            (default: freshly spawned processes; a test passes its pool).
    """
    from .runner import RunSpec
    from ..runtime.launch import spawn

    ranks = ranks or (lambda fn, spec: spawn(fn, tp, spec))
    out = {}
    for mode in ("ar", "rs", "rsv", "auto"):
        spec = RunSpec(model_dir, tp=tp, dp=dp, boundary_reduction=mode, prompts=prompts,
                       max_new_tokens=2)
        out[mode] = ranks(_path_bytes_rank, spec)[0]
    least = [min(out[m]["bytes"][s] for m in ("ar", "rs", "rsv")) for s in range(2)]
    return {"tp": tp, "dp": dp, "prompt_lens": [len(p) for p in prompts],
            "bytes": {m: r["bytes"] for m, r in out.items()},
            "auto_modes": out["auto"]["modes"],
            "auto_vs_least": [a / b if b else 1.0 for a, b in zip(out["auto"]["bytes"], least)]}
