"""Every tensor a forward makes is made on its inputs' device: each reference model's prefill
and decode run with the default device set to ``meta``, so a tensor made without naming its
device would be a meta tensor, and any op mixing it with the model's CPU tensors raises (a
meta value reaching the logits would leave them on ``meta``). At world 1 for every model and
on real gloo ranks, where the collectives' buffers are made, for the row modes; then the
engine's whole job (the loader, the generation loop, the pipeline transport, the all-to-all
MoE's routing counts) the same way."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from distributed.pool import get_pool
from model_configs import CONFIGS, config

from layer_boundary.runtime import BoundaryRuntime, ForwardBatch, ForwardMode, ParallelDims
from layer_boundary.runtime.parallel import build_parallel

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]


def _model(model_type: str, tp: int, dp: int, policy: str, a2a: bool = False):
    model_cls, cfg = config(model_type)
    runtime = BoundaryRuntime(build_parallel(ParallelDims(world_size=tp, tp=tp, attn_dp=dp,
                                                          moe_ep=tp if a2a else 1)),
                              boundary_reduction=policy,
                              moe_a2a_backend="all_to_all" if a2a else "none")
    torch.manual_seed(0)
    model = model_cls(cfg, runtime).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point():
                p.copy_(1 + 0.1 * torch.randn(p.shape) if "norm" in name
                        else torch.randn(p.shape) * 0.05)
    for name, b in model.named_buffers():
        assert b.device.type == "cpu", name
    return model


@torch.no_grad()
def forward_on_meta_default(model_type: str, tp: int = 1, dp: int = 1, policy: str = "ar",
                            a2a: bool = False):
    """A ragged prefill and a decode step, run twice on fresh caches: with the CPU as the
    default device, then with ``meta``. Returns [(logits device, same numbers as with the CPU
    default)] per forward (this rank's share of the prompts under attention DP): a meta index
    tensor is silently ignored by an index write, so the numbers are compared too."""
    model = _model(model_type, tp, dp, policy, a2a)
    rank = torch.distributed.get_rank() if tp > 1 else 0
    parts = [PROMPTS] if dp == 1 else [PROMPTS[:2], PROMPTS[2:]]
    mine = parts[rank // (tp // dp)]
    runs = []
    for default in ("cpu", "meta"):
        cache = model.make_kv_cache(len(mine), 16)
        logits = []
        for mode, ids, prefix, counts in (
                (ForwardMode.EXTEND, mine, [0] * len(mine),
                 tuple(sum(map(len, part)) for part in parts)),
                (ForwardMode.DECODE, [[1]] * len(mine), [len(p) for p in mine],
                 tuple(len(part) for part in parts))):
            fb = ForwardBatch.build(mode, ids, prefix, counts, kv_cache=cache)
            with torch.device(default):
                logits.append(model(fb))
        runs.append(logits)
    return [(meta.device.type, bool(torch.equal(meta, cpu)))
            for cpu, meta in zip(*runs)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_a_forward_makes_every_tensor_on_its_inputs_device(model_type):
    assert forward_on_meta_default(model_type) == [("cpu", True), ("cpu", True)]


# the all-to-all MoE's case: its routing counts cross the ranks (host-made tensors, on the
# device the group's backend moves)
CASES = [(2, 1, "ar", False), (4, 2, "rs+rsv", False), (2, 2, "ar", True)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,policy,a2a", CASES,
                         ids=[f"tp{t}-dp{d}-{p}" + "-a2a" * a for t, d, p, a in CASES])
@pytest.mark.parametrize("model_type", ["qwen3_moe"])  # a dense layer, then MoE layers
def test_the_collectives_make_their_buffers_on_the_inputs_device(model_type, tp, dp, policy,
                                                                 a2a):
    for rank, out in enumerate(get_pool(tp).run(forward_on_meta_default, model_type, tp, dp,
                                                policy, a2a)):
        assert out == [("cpu", True), ("cpu", True)], rank


def pipeline_round_trip() -> list:
    """Stage 0 sends two named tensors (one empty) and stage 1 receives them, then both take
    stage 1's tokens, all with ``meta`` as the default device: the headers, counts and
    receive buffers name the device the group's backend moves."""
    from layer_boundary.runtime import (broadcast_from_last_stage, recv_from_prev_stage,
                                        send_to_next_stage)
    from layer_boundary.runtime.parallel import Group

    rank = torch.distributed.get_rank()
    group = Group("pp", (0, 1), rank, torch.distributed.group.WORLD)
    sent = {"hidden": torch.arange(6.0).reshape(2, 3), "none": torch.zeros((0, 3))}
    with torch.device("meta"):
        if rank == 0:
            send_to_next_stage(sent, group)
            got = None
        else:
            got = recv_from_prev_stage(group, device=torch.device("cpu"))
        tokens = broadcast_from_last_stage(torch.tensor([rank, 7], device="cpu"), group)
    if got is not None:
        assert list(got) == list(sent)
        assert all(got[k].device.type == "cpu" and torch.equal(got[k], sent[k]) for k in sent)
    return tokens.tolist()


@pytest.mark.timeout(60)
def test_the_pipeline_transport_names_its_device():
    assert get_pool(2).run(pipeline_round_trip) == [[1, 7], [1, 7]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_device_cuda_without_a_gpu_is_a_one_line_error(capsys, restore_logger):
    from layer_boundary.engine.cli import main

    assert main(["run", "--device", "cuda", "--tp", "1", "--no-reference"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["layer-boundary: error: --device cuda: no CUDA device is visible "
                   "(torch.cuda.is_available() is False)"]


def test_ranks_take_nccl_only_with_a_gpu_each(monkeypatch):
    """The backend rule (what gpu_check.sh runs for real): NCCL where every rank has its own
    GPU, gloo where ranks share one or run on the CPU."""
    from layer_boundary.engine.runner import RunSpec, backend_for

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert backend_for(RunSpec("m", device="cuda").device, 2) == "nccl"
    assert backend_for(RunSpec("m", device="cuda").device, 4) == "gloo"
    assert backend_for(RunSpec("m").device, 2) == "gloo"


def run_on_meta_default(spec) -> list:
    """The engine's whole job on this rank (load, generation loop, pipeline transport, KV
    cache, batch metadata), with the CPU default and then ``meta``: [(same tokens, same
    logits)] on a rank that has the logits, else []."""
    from layer_boundary.engine.runner import run_rank

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    cpu = run_rank(spec, world_size=world)
    with torch.device("meta"):
        meta = run_rank(spec, world_size=world)
    if not cpu.last_stage:
        return []
    a, b = cpu.generation, meta.generation
    return [(a.generated == b.generated,
             all(torch.equal(x, y) for p, q in zip(a.logits, b.logits) for x, y in zip(p, q)))]


ENGINE_CASES = [("qwen3", {}), ("qwen3", {"tp": 2, "pp": 2}),
                ("qwen3_moe", {"tp": 2, "dp": 2, "ep": 2, "moe_a2a_backend": "all_to_all"})]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model,layout", ENGINE_CASES,
                         ids=[f"{m}-" + "-".join(f"{k}{v}" for k, v in lay.items()) for m, lay
                              in ENGINE_CASES])
def test_the_engine_names_every_device_it_uses(model, layout, qwen3_dir, qwen3_moe_dir):
    from layer_boundary.engine.runner import RunSpec

    spec = RunSpec(str(qwen3_dir if model == "qwen3" else qwen3_moe_dir),
                   prompts=[[1, 2, 3], [4, 5]], max_new_tokens=3, **layout)
    world = layout.get("tp", 1) * layout.get("pp", 1)
    results = (get_pool(world).run(run_on_meta_default, spec) if world > 1
               else [run_on_meta_default(spec)])
    assert [r for r in results if r] and all(r == [(True, True)] for r in results if r)



@torch.no_grad()
def compiled_decode_matches_eager(model_type: str) -> bool:
    """A decode step of ``model_type``'s tiny model after an eager prefill, compiled whole
    (``torch.compile(fullgraph=True)``, the eager backend: dynamo refuses any host sync or
    Python that branches on a tensor's value, what a captured CUDA graph cannot hold),
    against the same step eager on a copy of the cache."""
    import copy

    from layer_boundary.engine.compiled import compile_forward

    model = _model(model_type, 1, 1, "ar")
    cache = model.make_kv_cache(len(PROMPTS), 16)
    model(ForwardBatch.build(ForwardMode.EXTEND, PROMPTS, [0] * len(PROMPTS),
                             (sum(map(len, PROMPTS)),), kv_cache=cache))
    twin = copy.deepcopy(cache)
    step = lambda c: ForwardBatch.build(ForwardMode.DECODE, [[1]] * len(PROMPTS),  # noqa: E731
                                        [len(p) for p in PROMPTS], (len(PROMPTS),), kv_cache=c)
    eager = model(step(cache))
    traced = compile_forward(model, "eager", padded=False)(step(twin))
    return bool(torch.allclose(eager, traced, atol=1e-5, rtol=0))


# Qwen3, Qwen3-MoE and DeepSeek-V3 compile whole through the engine (tests/test_compile.py,
# prefill and decode, across ranks); each other model's decode step here, except the Qwen3.5
# classes, which run Qwen3-Next's forward (their files hold a config and checkpoint names),
# and EXAONE-4, whose layers are OLMo-3's (post norms, windows) with per-head q/k norms
TRACED_ELSEWHERE = {"qwen3", "qwen3_moe", "deepseek_v3", "qwen3_5_text", "qwen3_5_moe_text",
                    "exaone4"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model_type", sorted(set(CONFIGS) - TRACED_ELSEWHERE))
def test_every_model_decodes_whole_with_nothing_that_syncs_with_the_host(model_type):
    assert compiled_decode_matches_eager(model_type)


@pytest.mark.parametrize("gpus,refused", [(1, True), (2, False)], ids=["shared", "one each"])
def test_compiled_cuda_ranks_over_gloo_are_refused_before_any_rank(monkeypatch, qwen3_dir,
                                                                    gpus, refused):
    """Two ranks sharing one GPU run their collectives over gloo, where a compiled forward
    failed on a GPU: refused by name at the check the command line and ``run_rank`` make;
    with a GPU a rank (NCCL) the same spec passes that check."""
    from layer_boundary.capabilities import CapabilityError
    from layer_boundary.engine.features import check_spec
    from layer_boundary.engine.runner import RunSpec, with_checkpoints

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    spec = with_checkpoints(RunSpec(str(qwen3_dir), tp=2, device="cuda", compile="inductor"))
    if refused:
        with pytest.raises(CapabilityError, match=r"^--compile with --device cuda over gloo "
                                                  r"\(2 ranks sharing 1 GPU\(s\)\) is not run"):
            check_spec(spec)
    else:
        check_spec(spec)
    check_spec(replace(spec, compile=None))  # eager over gloo on CUDA ran on the GPU
