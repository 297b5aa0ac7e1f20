"""The sequence-parallel and input-scattered batch variants in the reference models, on gloo
ranks against world 1 (which matches transformers: the oracle tests), prefill and decode.

Sequence parallel (Qwen3, Qwen3-MoE, Llama): the prefill's residual and norms stay on
attention-TP slices; every dense stage's linears gather their input and reduce-scatter their
output; the MoE's input is gathered and its sum reduce-scattered by the boundary. Decode
steps run as ordinary batches. Input-scattered (DeepSeek-V3 with and without q LoRA,
LongCat-Flash): the MLA latent runs on the scattered rows and only the latent is gathered.
The ledger figures are checked against the analytic byte lists."""

from __future__ import annotations

import pytest
from checkpoints.ds import hf_deepseek_v3
from checkpoints.lc import hf_longcat_flash
from checkpoints.llama import hf_llama

from layer_boundary.models import load_config
from layer_boundary.engine.runner import RunSpec, merge, run_rank

from .checks import assert_logits_match, cli_ok, world1
from .pool import get_pool

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))  # 9, 2 and 5 tokens
STEPS = 2


@pytest.fixture(scope="module")
def dirs(qwen3_dir, qwen3_moe_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("scattered_variants")
    return {"qwen3": str(qwen3_dir), "qwen3_moe": str(qwen3_moe_dir),
            "llama": str(hf_llama(root / "llama")),
            "deepseek_v3": str(hf_deepseek_v3(root / "deepseek_v3")),
            "deepseek_v3_noqlora": str(hf_deepseek_v3(
                root / "deepseek_v3_noqlora", seed=2, q_lora_rank=None, rope_interleave=False)),
            "longcat_flash": str(hf_longcat_flash(root / "longcat_flash"))}


def spec_of(path, model, tp, dp, policy, prompts=PROMPTS, **kw) -> RunSpec:
    ep = 1 if model in ("qwen3", "llama") else 2
    return RunSpec(path, tp=tp, dp=dp, ep=ep, boundary_reduction=policy, prompts=prompts,
                   max_new_tokens=STEPS, **kw)


# (tp, attn_dp, policy, prompts): attention TP 2 and 4, attention DP, an empty DP rank
SP_CASES = [(2, 1, "auto", PROMPTS), (4, 1, "rs", PROMPTS), (4, 2, "auto", PROMPTS),
            (4, 2, "rs", PROMPTS[:1])]


def matches_world1(spec: RunSpec) -> list:
    """The run's ranks, after checking its tokens and logits against world 1's."""
    results = get_pool(spec.tp).run(run_rank, spec)
    assert_logits_match(merge(results), world1(spec), len(spec.prompts))
    assert all(r.streams_released for r in results)
    return results


def topologies(cases):
    return pytest.mark.parametrize("tp,dp,policy,prompts", cases, ids=[
        f"tp{t}-dp{d}-{p}-{len(n)}" for t, d, p, n in cases])


@pytest.mark.timeout(240)
@topologies(SP_CASES)
@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe", "llama"])
def test_sequence_parallel_matches_world1(dirs, model, tp, dp, policy, prompts):
    for r in matches_world1(spec_of(dirs[model], model, tp, dp, policy, prompts,
                                    sequence_parallel=True)):
        # the prefill's linears moved rows inside compute; decode ran ordinary paths
        assert any(e.step == 0 and e.site.endswith(".compute") and e.kind == "reduce_scatter"
                   for e in r.ledger)
        assert not any(e.step == 1 and e.site.endswith("attn.compute") for e in r.ledger)


def sp_expected(cfg, tp: int, dp: int, mode: str, dp_tokens: list[int], dense: list[bool]):
    """The analytic list per layer of the prefill's compute collectives (kind, group,
    elements): each attention gathers its DP rank's rows over attention TP and
    reduce-scatters them back; each dense FFN does the same over TP with every DP rank's
    rows; rs pads every DP rank's rows to attn_tp chunks of the largest's size."""
    attn_tp, hidden = tp // dp, cfg.hidden_size
    chunk = -(-max(dp_tokens) // attn_tp)
    out = []
    for mine in dp_tokens:
        local = chunk * attn_tp if mode == "rs" else mine
        total = chunk * attn_tp * dp if mode == "rs" else sum(dp_tokens)
        layers = []
        for is_dense in dense:
            attn = [("all_gather", "attn_tp", local * hidden),
                    ("reduce_scatter", "attn_tp", local * hidden)] if attn_tp > 1 else []
            # without attention DP the FFN gathers the DP rank's (= the global) rows over
            # attention TP, the same ranks as TP
            ffn = [("all_gather", "attn_tp" if dp == 1 else "tp", total * hidden),
                   ("reduce_scatter", "tp", total * hidden)] if is_dense else []
            layers.append((attn, ffn))
        out.append(layers)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tp,dp,policy", [(2, 1, "rs"), (4, 2, "rsv"), (4, 2, "rs")])
def test_sequence_parallel_ledger_is_the_analytic_list(dirs, model, tp, dp, policy):
    spec = spec_of(dirs[model], model, tp, dp, policy, sequence_parallel=True)
    cfg = load_config(dirs[model])
    layers = cfg.num_hidden_layers
    dense = [not (model == "qwen3_moe" and cfg.is_sparse(i)) for i in range(layers)]
    dp_tokens = [sum(len(p) for p in PROMPTS[d::dp]) for d in range(dp)]
    want = sp_expected(cfg, tp, dp, policy, dp_tokens, dense)
    for r in get_pool(tp).run(run_rank, spec):
        for i in range(layers):
            for k, name in enumerate(("attn", "ffn")):
                got = [(e.kind, e.group, e.numel) for e in r.ledger
                       if e.step == 0 and e.site == f"layer{i}.{name}.compute"
                       and e.kind in ("all_gather", "reduce_scatter")]
                assert got == want[r.dp_rank][i][k], (r.rank, i, name, got)


# (tp, attn_dp, policy, prompts): rs and rsv at tp 2 and tp 4 dp 2, an empty DP rank
IS_CASES = [(2, 1, "rs", PROMPTS), (2, 1, "rsv", PROMPTS), (4, 2, "rs", PROMPTS),
            (4, 2, "rsv", PROMPTS), (4, 2, "rs+rsv", PROMPTS[:1])]


@pytest.mark.timeout(240)
@topologies(IS_CASES)
@pytest.mark.parametrize("model", ["deepseek_v3", "deepseek_v3_noqlora", "longcat_flash"])
def test_input_scattered_matches_world1(dirs, model, tp, dp, policy, prompts):
    matches_world1(spec_of(dirs[model], model, tp, dp, policy, prompts,
                           attn_input_scattered=True))


def latent_width(cfg) -> int:
    q = cfg.q_lora_rank if cfg.q_lora_rank else cfg.hidden_size
    return q + cfg.kv_lora_rank + cfg.qk_rope_head_dim


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model", ["deepseek_v3", "longcat_flash"])
def test_input_scattered_gathers_the_latent_width(dirs, model):
    """The same batch, ordinary and input-scattered: every attention's input gather (at its
    prepare, over attention TP) moves the latent width instead of the hidden width."""
    cfg = load_config(dirs[model])
    widths = {}
    for scattered in (False, True):
        spec = spec_of(dirs[model], model, 2, 1, "rs", attn_input_scattered=scattered)
        r = get_pool(2).run(run_rank, spec)[0]
        gathers = [e for e in r.ledger if e.step == 0 and e.kind == "all_gather"
                   and e.group == "attn_tp" and ".attn" in e.site and e.site.endswith("prepare")]
        assert gathers, r.ledger
        rows = -(-sum(map(len, PROMPTS)) // 2) * 2  # rs: padded to attn_tp chunks
        widths[scattered] = {e.numel // rows for e in gathers}
        total = sum(e.bytes for e in gathers)
        widths[f"bytes{scattered}"] = total
    assert widths[False] == {cfg.hidden_size}
    assert widths[True] == {latent_width(cfg)} and latent_width(cfg) < cfg.hidden_size
    assert widths["bytesTrue"] < widths["bytesFalse"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model,flags", [
    ("qwen3_moe", ["--sequence-parallel", "--tp", "4", "--dp", "2", "--ep", "2"]),
    ("deepseek_v3", ["--attn-input-scattered", "--tp", "4", "--dp", "2", "--ep", "2",
                     "--boundary-reduction", "rsv"])], ids=["sp", "input-scattered"])
def test_cli_runs_pass_parity(dirs, model, flags, capsys, restore_logger):
    out = cli_ok(["run", "--model", dirs[model], "--max-new-tokens", "2",
                  *[a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))], *flags],
                 capsys)
    assert "parity vs world 1: PASS" in out
    assert ("sequence-parallel" if "--sequence-parallel" in flags else "input-scattered") in out
