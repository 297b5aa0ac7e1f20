"""Llama and Mistral on real gloo ranks against world 1: heads over attention TP (kv heads
split at attention TP 2, replicated over rank pairs at 4), the gated MLP over TP, attention DP
with the rows all-reduced (ar) or scattered (rsv); the llama3 rope with a tied head, and
Mistral's sliding window shorter than the prompts (its ring cache through decode steps)."""

from __future__ import annotations

import pytest
from checkpoints.llama import WINDOW, hf_llama, hf_mistral

from layer_boundary.engine.runner import RunSpec

from .checks import cli_ok, run_matching_world1

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6, 5), (35, 8), (9, 7, 9, 3, 2))  # 9 and 5 tokens > WINDOW
STEPS = 3  # a prefill, then two cached decode steps

CHECKPOINTS = {
    "llama": lambda root: hf_llama(root),
    "llama-tied-llama3": lambda root: hf_llama(root, seed=1, tie=True, llama3=True),
    "mistral-window": lambda root: hf_mistral(root, seed=2, sliding_window=WINDOW),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("llama")
    return {name: str(write(root / name)) for name, write in CHECKPOINTS.items()}


# each command spawns its ranks afresh: two of them (the pool's cases below cover the rest)
RUNS = [("llama-tied-llama3", ["--tp", "2"]),
        ("mistral-window", ["--tp", "4", "--dp", "2", "--boundary-reduction", "rsv"])]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model,args", RUNS, ids=["llama-tp2", "mistral-tp4-dp2-rsv"])
def test_run_passes_parity(dirs, model, args, capsys, restore_logger):
    """``layer-boundary run --model DIR`` finds the model by its model_type and matches its
    own world-1 run (default prompts of 5, 3 and 7 tokens, 2 decode steps)."""
    out = cli_ok(["run", "--model", dirs[model], *args, "--max-new-tokens", "3"], capsys)
    assert "parity vs world 1: PASS" in out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["ar", "rsv"])
@pytest.mark.parametrize("model", list(CHECKPOINTS))
def test_attention_dp_matches_world1(dirs, model, mode):
    """tp 4 with attention DP 2: every request's logits at every step within 1e-5 of world
    1's, the same tokens, the forward in row mode ``mode``, every stream released."""
    spec = RunSpec(dirs[model], tp=4, dp=2, boundary_reduction=mode, prompts=PROMPTS,
                   max_new_tokens=STEPS)
    run_matching_world1(spec, mode)
