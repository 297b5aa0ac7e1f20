"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE at world 1 against transformers (fp32, eager attention,
eager experts, the pure-torch gated DeltaNet): prefill logits at every position, recurrent /
KV-cache decode logits against transformers' own cached decode, the same greedy tokens; a
prefill continued from a cached prefix; the nested Qwen3.5 layout; the config checks.

Tolerance: 1e-5 times the logit scale. A random DeltaNet is ill-conditioned where a head's
q.k is near zero (its gated norm rescales the tiny output back to unit size), so fp32
rounding alone moves transformers' own logits by ~1e-5 (against its float64 run)."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints.qwen3_next import TINY_NEXT, hf_qwen3_next, hf_qwen3_next_reference
from oracle import TOL, hf_cached_decode, prefill, world1

from distributed.checks import cli_ok
from layer_boundary.models import load_model
from layer_boundary.engine.generate import greedy_generate
from layer_boundary.models.loader import CheckpointError
from layer_boundary.models.qwen3_5 import Qwen3_5Config
from layer_boundary.models.qwen3_next import Qwen3NextConfig, check_parallel
from layer_boundary.runtime import GemmaRMSNorm
from layer_boundary.runtime.parallel import ParallelDims

# 1 token: a prompt shorter than the conv window (chunks of 64: test_chunked_form_*)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 88, 2, 61, 33, 5, 9, 10, 11], [42]]
STEPS = 3

CASES = {
    "qwen3_next": ("qwen3_next", dict()),  # MoE layers around a dense one
    # tied head, biased attention, the interval pattern (full attention every 2nd layer),
    # as many value heads as key heads
    "qwen3_5-tied-interval": ("qwen3_5", dict(
        seed=2, tie=True, layer_types=None, full_attention_interval=2, attention_bias=True,
        linear_num_value_heads=4)),
    "qwen3_5_moe": ("qwen3_5_moe", dict(seed=3)),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """case -> its checkpoint, written once for the module."""
    written = {}

    def get(case):
        if case not in written:
            arch, overrides = CASES[case]
            written[case] = hf_qwen3_next(tmp_path_factory.mktemp(case), arch, **overrides)
        return written[case]

    return get


def assert_close(ours, expected, what):
    tol = TOL * max(1.0, expected.abs().max().item())
    diff = (ours - expected).abs().max().item()
    assert diff <= tol, f"{what}: max abs diff {diff} (tolerance {tol})"


@pytest.mark.parametrize("case", list(CASES))
def test_world1_matches_transformers(checkpoint, case):
    arch, path = CASES[case][0], checkpoint(case)
    ours = load_model(path, world1())
    ref = hf_qwen3_next_reference(path, arch)

    logits, start = prefill(ours, PROMPTS), 0  # every prompt in one batch
    for j, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            expected = ref(torch.tensor([prompt])).logits[0]
        assert_close(logits[start:start + len(prompt)], expected, f"prompt {j} prefill")
        start += len(prompt)

    gen = greedy_generate(ours, PROMPTS, STEPS)
    for j, prompt in enumerate(PROMPTS):
        expected = hf_cached_decode(ref, prompt, gen.generated[j][:-1])
        for step in range(STEPS):
            assert_close(gen.logits[j][step], expected[step], f"prompt {j} step {step}")
        assert gen.generated[j] == expected.argmax(-1).tolist()


def test_prefill_continues_from_a_cached_prefix(checkpoint):
    """A prefill in two parts (the conv window and recurrent state carried over, the chunked
    form started from the state; the attention from its KV cache) equals one prefill."""
    from layer_boundary.runtime.forward_batch import ForwardBatch, ForwardMode

    path = checkpoint("qwen3_next")
    ours = load_model(path, world1())
    ref = hf_qwen3_next_reference(path)
    prompts, cuts = PROMPTS[:3], [2, 1, 6]  # inside and past the conv window
    cache = ours.make_kv_cache(len(prompts), max(map(len, prompts)))
    for part, prefix in (([p[:c] for p, c in zip(prompts, cuts)], [0] * 3),
                         ([p[c:] for p, c in zip(prompts, cuts)], cuts)):
        with torch.no_grad():
            logits = ours(ForwardBatch.build(ForwardMode.EXTEND, part, prefix, kv_cache=cache))
    start = 0
    for j, (prompt, cut) in enumerate(zip(prompts, cuts)):
        n = len(prompt) - cut
        with torch.no_grad():
            expected = ref(torch.tensor([prompt])).logits[0, cut:]
        assert_close(logits[start:start + n], expected, f"prompt {j}")
        start += n


def test_qwen3_5_nested_layout_loads_the_same_model(checkpoint, tmp_path):
    """The released multimodal layout (text_config, ``model.language_model.*``, a vision
    tower and an MTP block that are not loaded) gives the text layout's logits."""
    from safetensors.torch import load_file, save_file

    text = checkpoint("qwen3_5-tied-interval")
    nested = tmp_path / "nested"
    nested.mkdir()
    cfg = json.loads((text / "config.json").read_text())
    (nested / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5", "tie_word_embeddings": True,
         "text_config": dict(cfg, model_type="qwen3_5_text"), "vision_config": {}}))
    tensors = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): t
               for n, t in load_file(text / "model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    tensors["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(tensors, nested / "model.safetensors")
    a, b = (prefill(load_model(p, world1()), PROMPTS[:2]) for p in (text, nested))
    assert torch.equal(a, b)


def test_gemma_norm_scales_by_one_plus_weight_in_fp32():
    """The boundary's fused read (``normalize_fp32`` of the fp32 sum) is transformers'
    ``Qwen3NextRMSNorm``: (1 + w) applied before the one rounding."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    torch.manual_seed(0)
    ours, ref = GemmaRMSNorm(64, 1e-6, dtype=torch.bfloat16), Qwen3NextRMSNorm(64, 1e-6)
    with torch.no_grad():
        ours.weight.copy_(0.3 * torch.randn(64))
        ref.weight.copy_(ours.weight.float())
    x32 = torch.randn(5, 64)
    out = ours.normalize_fp32(x32, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and ours.gemma_weight is ours.weight
    ref_out = (ref._norm(x32) * (1.0 + ours.weight.float())).to(torch.bfloat16)
    assert torch.equal(out, ref_out)
    assert torch.equal(ours(x32.to(torch.bfloat16)), ref.to(torch.bfloat16)(x32.to(torch.bfloat16)))


def test_plan_labels_each_mixer(checkpoint, capsys, restore_logger):
    """``layer-boundary plan``: two stages per layer, each mixer labelled (gated_deltanet,
    gated_attention) with its stage kind: the DeltaNet a SCOPED mixer, attention PARTIAL."""
    path = checkpoint("qwen3_next")
    out = cli_ok(["plan", "--model", str(path), "--tp", "4", "--dp", "2", "--boundary-reduction",
                  "rs", "--tokens", "5,3", "--json"], capsys)
    stages = json.loads(out)["stages"]
    assert [s["stage"] for s in stages] == [f"layer{i}.{k}" for i in range(5)
                                            for k in ("attn", "ffn")]
    mixers = {"linear_attention": "gated_deltanet", "full_attention": "gated_attention"}
    assert [s.get("mixer") for s in stages[::2]] == [mixers[t] for t in TINY_NEXT["layer_types"]]
    assert stages[0]["kind"] == "gated_deltanet attention (SCOPED)"
    assert stages[4]["kind"] == "gated_attention attention (PARTIAL)"
    assert {s["kind"] for s in stages[1::2]} == {"ffn sparse (SCOPED)", "ffn (SCOPED)"}


def base_config(**overrides) -> dict:
    cfg = dict(TINY_NEXT, model_type="qwen3_next", hidden_act="silu",
               rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                "partial_rotary_factor": 0.25})
    cfg.update(overrides)
    return cfg


def test_config_fields():
    cfg = Qwen3NextConfig.from_dict(base_config())
    assert cfg.num_hidden_layers == 5 and cfg.rotary_dim == 4 and not cfg.split_projections
    assert [cfg.is_sparse(i) for i in range(5)] == [True, False, True, True, True]
    cfg = Qwen3NextConfig.from_dict(base_config(layer_types=None, full_attention_interval=2))
    assert cfg.layer_types[:2] == ("linear_attention", "full_attention")
    nested = Qwen3_5Config.from_dict({"model_type": "qwen3_5", "tie_word_embeddings": True,
                                      "text_config": base_config()})
    assert nested.split_projections and nested.num_experts == 0 and nested.tie_word_embeddings


@pytest.mark.parametrize("overrides,field", [
    (dict(layer_types=["linear_attention", "sliding_attention"] * 2 + ["full_attention"]),
     "layer_types"),
    (dict(layer_types=["linear_attention"]), "layer_types"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(linear_num_value_heads=6), "linear_num_value_heads"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_type"),
    (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.1}),
     "partial_rotary_factor"),
    (dict(linear_key_head_dim=None), "linear_key_head_dim"),
    (dict(mlp_only_layers=[1], intermediate_size=None), "intermediate_size"),
    (dict(num_experts="8"), "num_experts"),
])
def test_config_rejects_unsupported(overrides, field):
    with pytest.raises(CheckpointError, match=field):
        raw = base_config(**overrides)
        Qwen3NextConfig.validate(raw)
        Qwen3NextConfig.from_dict(raw)


@pytest.mark.parametrize("overrides,dims,field", [
    (dict(), ParallelDims(world_size=8, tp=8), "linear_num_key_heads"),
    (dict(num_attention_heads=6), ParallelDims(world_size=4, tp=4), "num_attention_heads"),
    (dict(num_experts=6), ParallelDims(world_size=4, tp=4, moe_ep=4), "num_experts"),
    (dict(intermediate_size=90), ParallelDims(world_size=4, tp=4, attn_dp=4), "intermediate_size"),
    (dict(shared_expert_intermediate_size=6), ParallelDims(world_size=4, tp=4, moe_ep=4),
     "shared_expert_intermediate_size"),
])
def test_check_parallel_names_the_field(overrides, dims, field):
    cfg = Qwen3NextConfig.from_dict(base_config(**overrides))
    with pytest.raises(ValueError, match=field):
        check_parallel(cfg, dims)
    check_parallel(cfg, ParallelDims())  # world 1 always fits


def test_chunked_form_matches_transformers_over_several_chunks():
    """The delta rule alone (no model to amplify rounding; both sides compute in fp32): 70
    tokens (two chunks of 64) from a cached state, grouped value heads, against transformers'
    torch chunked form; then our one-token step against its recurrent form."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)

    from layer_boundary.models.gated_deltanet import (chunk_gated_delta, l2norm,
                                                      recurrent_gated_delta)

    torch.manual_seed(0)
    n, k_heads, v_heads, dk, dv = 70, 2, 4, 8, 6
    q, k = (torch.randn(1, n, k_heads, dk, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, n, v_heads, dv, dtype=torch.float64)
    g = -torch.rand(1, n, v_heads, dtype=torch.float64)
    beta = torch.rand(1, n, v_heads, dtype=torch.float64)
    state = torch.randn(1, v_heads, dk, dv, dtype=torch.float64)
    kw = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    expected, expected_state = torch_chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    recurrent, _ = torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    assert (expected - recurrent).abs().max() < 1e-5  # its two forms agree

    def ours_qk(x):  # [1, n, Hk, dk] -> [n, Hv, dk], as the mixer feeds them
        return l2norm(x[0]).repeat_interleave(v_heads // k_heads, 1)

    out, final = chunk_gated_delta(ours_qk(q), ours_qk(k), v[0], g[0], beta[0], state[0])
    assert (out - expected[0]).abs().max() < 1e-6
    assert (final - expected_state[0]).abs().max() < 1e-6
    step = final.clone()
    one = [x[:, :1] for x in (q, k, v, g, beta)]
    expected_step, expected_after = torch_recurrent_gated_delta_rule(
        *one, initial_state=final[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    got = recurrent_gated_delta(ours_qk(one[0])[0], ours_qk(one[1])[0], v[0, 0], g[0, 0],
                                beta[0, 0], step)
    assert (got - expected_step[0, 0]).abs().max() < 1e-6
    assert (step - expected_after[0]).abs().max() < 1e-6


def test_terminal_finalize_fuses_in_the_zero_centered_final_norm(checkpoint):
    """Qwen3.5-MoE ends in a MoE before a GemmaRMSNorm final norm: with the reference provider
    installed on the built model (terminal_finalize=True), the last MoE's finalize reaches the
    final norm as a handoff and the service finalizes, sums, adds and norms it in one call,
    bit for bit what the unfused path computes."""
    from layer_boundary.fusions.reference import ReferenceFusions
    from layer_boundary.fusions.terminal import TerminalFinalizeNorm
    from layer_boundary.runtime.forward_batch import ForwardBatch, ForwardMode

    path = checkpoint("qwen3_5_moe")
    plain, fused = load_model(path, world1()), load_model(path, world1())
    provider = ReferenceFusions(terminal_finalize=True)
    service = fused.install_fusion(provider)
    assert isinstance(service, TerminalFinalizeNorm) and fused.model.handoff_norm is service
    for prompts in (PROMPTS, [[42]]):
        outs = []
        for model in (plain, fused):
            cache = model.make_kv_cache(len(prompts), 16)
            batch = ForwardBatch.build(ForwardMode.EXTEND, prompts, [0] * len(prompts),
                                       kv_cache=cache)
            with torch.no_grad():
                outs.append(model(batch))
        assert torch.equal(outs[0], outs[1])
    assert service.calls == 2
