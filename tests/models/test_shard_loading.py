"""A rank reads only its shard of the checkpoint: the bytes it reads (counted through the
safetensors slices) are at most 1.1x what it keeps, at tp 4, with attention DP and expert
parallelism, for a dense model, a MoE and an MLA model, and the loaded model still equals
world 1's (the parity tests run on the same loader)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import hf_qwen3_moe
from checkpoints.ds import hf_deepseek_v3
from distributed.pool import get_pool

from layer_boundary.models import load_model
from layer_boundary.engine.runner import make_runtime, RunSpec
from layer_boundary.runtime.shards import ReadBytes


def load_rank(model_dir: str, tp: int, dp: int, ep: int) -> dict:
    read = ReadBytes()
    spec = RunSpec(model_dir, tp=tp, dp=dp, ep=ep)
    model = load_model(model_dir, make_runtime(spec), read=read)
    kept = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"read": read.bytes, "kept": kept}


@pytest.fixture(scope="module")
def dirs(qwen3_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("shards")
    return {"qwen3": str(qwen3_dir), "qwen3_moe": str(hf_qwen3_moe(root / "qwen3_moe")),
            "deepseek_v3": str(hf_deepseek_v3(root / "deepseek_v3"))}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model,tp,dp,ep", [("qwen3", 4, 1, 1), ("qwen3", 4, 2, 1),
                                            ("qwen3_moe", 4, 2, 4), ("deepseek_v3", 4, 1, 2)])
def test_a_rank_reads_its_shard(dirs, model, tp, dp, ep):
    whole = load_rank(dirs[model], 1, 1, 1)
    assert whole["read"] >= 0.99 * whole["kept"]  # world 1 reads (nearly) all it keeps
    for rank, r in enumerate(get_pool(tp).run(load_rank, dirs[model], tp, dp, ep)):
        # its shard plus the replicated tensors: what it keeps (padding rows aside)
        assert r["read"] <= 1.1 * r["kept"], (rank, r)
        assert r["read"] < 0.6 * whole["read"], (rank, r, whole)  # not the whole checkpoint


def load_or_error(model_dir: str, tp: int) -> str:
    from layer_boundary.runtime.shards import CheckpointError

    try:
        load_rank(model_dir, tp, 1, 1)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.timeout(120)
def test_a_nan_in_one_ranks_block_of_a_column_shard_stops_every_rank(qwen3_dir, tmp_path):
    """A row-parallel weight is read together (each rank a block of its rows, one all-to-all
    for the columns): a NaN in the rows rank 2 reads is reported by all four ranks, naming
    the tensor, and none waits on the others."""
    import shutil

    from safetensors.torch import load_file, save_file

    target = tmp_path / "nan"
    shutil.copytree(qwen3_dir, target)
    files = sorted(target.glob("*.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    for f in files:
        tensors = load_file(f)
        if name in tensors:
            rows = tensors[name].shape[0]
            tensors[name][rows * 2 // 4, 0] = float("nan")  # the first row of rank 2's block
            save_file(tensors, f, metadata={"format": "pt"})
    errors = get_pool(4).run(load_or_error, str(target), 4)
    assert errors == [f"checkpoint tensor {name} holds non-finite values (NaN or Inf)"] * 4


@pytest.mark.timeout(120)
def test_column_shards_read_together_equal_a_plain_slice(qwen3_dir):
    """What each rank keeps of a row-parallel weight and of the embedding equals the slice
    of the whole tensor (world 1's load), at tp 4 and with attention DP."""
    got = get_pool(4).run(kept_slices, str(qwen3_dir), 4, 2)
    whole = kept_slices(str(qwen3_dir), 1, 1)
    for rank, g in enumerate(got):
        attn_tp = rank % 2  # attention TP 2 inside DP 2: the o_proj input is split in two
        o = whole["o_proj"].shape[1] // 2
        assert torch.equal(g["o_proj"], whole["o_proj"][:, attn_tp * o:(attn_tp + 1) * o])
        d = whole["down_proj"].shape[1] // 4
        assert torch.equal(g["down_proj"], whole["down_proj"][:, rank * d:(rank + 1) * d])


def kept_slices(model_dir: str, tp: int, dp: int) -> dict:
    spec = RunSpec(model_dir, tp=tp, dp=dp)
    model = load_model(model_dir, make_runtime(spec))
    params = dict(model.named_parameters())
    pick = {k: next(v for n, v in params.items() if n.endswith(f"layers.0.{p}.weight"))
            for k, p in (("o_proj", "self_attn.o_proj"), ("down_proj", "mlp.down_proj"))}
    return {k: v.detach().clone() for k, v in pick.items()}


def exchanges_and_slices(model_dir: str, tp: int, dp: int, batch_bytes: int | None) -> dict:
    """``kept_slices`` with each column exchange of the load counted (per group), with
    ``shards.READ_BATCH_BYTES`` set to ``batch_bytes`` (None: as it is)."""
    from layer_boundary.runtime import shards

    counts: dict[str, int] = {}
    exchange, budget = shards.all_to_all_rows, shards.READ_BATCH_BYTES

    def counted(x, group, send, recv):
        counts[group.name] = counts.get(group.name, 0) + 1
        return exchange(x, group, send, recv)

    shards.all_to_all_rows = counted
    shards.READ_BATCH_BYTES = budget if batch_bytes is None else batch_bytes
    try:
        return {"exchanges": counts, **kept_slices(model_dir, tp, dp)}
    finally:
        shards.all_to_all_rows, shards.READ_BATCH_BYTES = exchange, budget


@pytest.mark.timeout(120)
def test_a_load_exchanges_its_column_reads_once_per_group(qwen3_dir):
    """A load's row-parallel weights are read together in one all-to-all per group (the
    attention TP group's o_proj, the TP group's down_proj), not one a tensor; with a budget
    of one byte each tensor is exchanged as it is read. Both keep world 1's slices."""
    from layer_boundary.models.checkpoint import open_checkpoint

    layers = open_checkpoint(str(qwen3_dir)).config.num_hidden_layers
    whole = kept_slices(str(qwen3_dir), 1, 1)
    for batch_bytes, per_group in ((None, 1), (1, layers)):
        for rank, got in enumerate(get_pool(4).run(exchanges_and_slices, str(qwen3_dir), 4, 2,
                                                   batch_bytes)):
            assert got["exchanges"] == {"attn_tp": per_group, "tp": per_group}, (rank, got)
            o, d = whole["o_proj"].shape[1] // 2, whole["down_proj"].shape[1] // 4
            assert torch.equal(got["o_proj"], whole["o_proj"][:, rank % 2 * o:][:, :o])
            assert torch.equal(got["down_proj"], whole["down_proj"][:, rank * d:][:, :d])

