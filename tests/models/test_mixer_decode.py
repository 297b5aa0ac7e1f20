"""The recurrent mixers' decode step over a batch (Nemotron-H's Mamba2, Qwen3-Next's and
Qwen3.5's gated DeltaNet): a step in which every request adds one token runs each layer's conv
and state update once over all requests, where a mixed batch loops over them. The oracle
tests compare the batched step with transformers on consecutive slots; here the same step on
slots in any order (a gathered state, written back) and the per-request loop give the same
logits, and the states they leave decode the next step alike."""

from __future__ import annotations

import pytest
import torch
from checkpoints.nh import hf_nemotron_h
from checkpoints.qwen3_next import hf_qwen3_next
from oracle import world1

from layer_boundary.models import load_model
from layer_boundary.runtime.forward_batch import ForwardBatch, ForwardMode

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 88, 2, 61, 33], [42]]
EXTRA = [11, 12]  # a prompt that joins the batch, so that the step is not a pure decode


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_next", "qwen3_5"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "nemotron_h":
        path = hf_nemotron_h(path)
    else:
        path = hf_qwen3_next(path, request.param)
    return load_model(path, world1())


def _steps(model, slots, mixed: bool) -> list[torch.Tensor]:
    """Prefill PROMPTS into ``slots``, then two decode steps of every request; with ``mixed``
    the first step carries a new prompt too (its own slot), which runs the per-request loop.
    Returns each decode step's logits of the PROMPTS' requests, in PROMPTS order."""
    cache = model.make_kv_cache(max(slots) + 2, 16)
    spare = max(slots) + 1
    with torch.no_grad():
        logits = model(ForwardBatch.build(ForwardMode.EXTEND, PROMPTS, [0] * len(PROMPTS),
                                          req_slots=slots, kv_cache=cache))
    ends = torch.tensor([len(p) for p in PROMPTS]).cumsum(0) - 1
    tokens = [[t] for t in logits[ends].argmax(-1).tolist()]
    prefix = [len(p) for p in PROMPTS]
    out = []
    for step in range(2):
        requests, lens, req_slots = list(tokens), list(prefix), list(slots)
        if mixed and step == 0:
            requests, lens, req_slots = requests + [EXTRA], lens + [0], req_slots + [spare]
        batch = ForwardBatch.build(ForwardMode.EXTEND if mixed and step == 0 else
                                   ForwardMode.DECODE, requests, lens, req_slots=req_slots,
                                   kv_cache=cache)
        with torch.no_grad():
            logits = model(batch)[:len(PROMPTS)]  # the PROMPTS' requests come first, a row each
        out.append(logits)
        tokens = [[t] for t in logits.argmax(-1).tolist()]
        prefix = [p + 1 for p in prefix]
    return out


def test_a_batched_decode_step_is_the_per_request_one_on_any_slots(model):
    consecutive = _steps(model, [0, 1, 2, 3], mixed=False)  # the state's rows as a view
    shuffled = _steps(model, [3, 0, 4, 1], mixed=False)  # gathered and written back
    looped = _steps(model, [0, 1, 2, 3], mixed=True)  # step 0 per request (a prompt joins)
    for step in range(2):
        torch.testing.assert_close(shuffled[step], consecutive[step], atol=1e-5, rtol=0)
        torch.testing.assert_close(looped[step], consecutive[step], atol=1e-5, rtol=0)
