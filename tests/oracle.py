"""World 1 against transformers: the comparisons the model oracle tests share (DESIGN.md,
the correctness oracle: prefill logits at every position, KV-cache decode logits against
transformers' own cached decode, the same greedy tokens)."""

from __future__ import annotations

import torch

from layer_boundary.engine.generate import greedy_generate
from layer_boundary.runtime.args import BoundaryRuntime
from layer_boundary.runtime.forward_batch import ForwardBatch, ForwardMode
from layer_boundary.runtime.parallel import ParallelDims, build_parallel

TOL = 1e-5
# MLA runs on its latent (kv_b_proj absorbed into the queries and the output), summing the
# same products in another order than transformers' expanded heads: on LongCat's tied-top3
# decode (logits up to |9|) that reaches 1.07e-5, a relative 1.6e-6 (fp32 noise)
MLA_TOL = 2e-5


def world1() -> BoundaryRuntime:
    return BoundaryRuntime(build_parallel(ParallelDims()))


def hf_cached_decode(ref, prompt, tokens) -> torch.Tensor:
    """transformers' logits [len(tokens) + 1, vocab]: the prompt's last position after a
    cached prefill, then one cached decode step per token."""
    from transformers import DynamicCache

    with torch.no_grad():
        out = ref(torch.tensor([prompt]), cache=DynamicCache(config=ref.config), use_cache=True)
        logits = [out.logits[0, -1]]
        for t in tokens:
            out = ref(torch.tensor([[t]]), cache=out.cache, use_cache=True)
            logits.append(out.logits[0, -1])
    return torch.stack(logits)


def prefill(model, prompts) -> torch.Tensor:
    """Our logits [tokens, vocab] of one prefill of every prompt, in one batch."""
    batch = ForwardBatch.build(ForwardMode.EXTEND, prompts, [0] * len(prompts),
                               kv_cache=model.make_kv_cache(len(prompts),
                                                            max(map(len, prompts))))
    with torch.no_grad():
        return model(batch)


def prefill_then_step(model, prompts) -> torch.Tensor:
    """Our logits of one prefill of every prompt, then of one decode step of each (tokens 7,
    8, ...), concatenated: [prompt tokens + requests, vocab]."""
    cache = model.make_kv_cache(len(prompts), max(map(len, prompts)) + 1)
    with torch.no_grad():
        first = model(ForwardBatch.build(ForwardMode.EXTEND, prompts, [0] * len(prompts),
                                         kv_cache=cache))
        step = model(ForwardBatch.build(ForwardMode.DECODE, [[7 + i] for i in range(len(prompts))],
                                        [len(p) for p in prompts], kv_cache=cache))
    return torch.cat((first, step))


def assert_prefill_matches(ours, ref, prompts, tol: float = TOL) -> None:
    """Every position of every prompt, the prompts in one batch."""
    logits, start = prefill(ours, prompts), 0
    for j, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = ref(torch.tensor([prompt])).logits[0]
        diff = (logits[start:start + len(prompt)] - expected).abs().max().item()
        assert diff <= tol, f"prompt {j} prefill: max abs diff {diff}"
        start += len(prompt)


def assert_decode_matches(ours, ref, prompts, steps: int, tol: float = TOL) -> None:
    """Our cached greedy steps against transformers' cached decode of the same tokens."""
    gen = greedy_generate(ours, prompts, steps)
    for j, prompt in enumerate(prompts):
        expected = hf_cached_decode(ref, prompt, gen.generated[j][:-1])
        for step in range(steps):
            diff = (expected[step] - gen.logits[j][step]).abs().max().item()
            assert diff <= tol, f"prompt {j} step {step}: max abs diff {diff}"
        assert gen.generated[j] == expected.argmax(-1).tolist()


def assert_backend_matches(folder, model_class: str, prompts, steps: int) -> None:
    """The Transformers backend (``--model-impl transformers``) on ``folder`` at world 1
    against transformers' ``model_class``: prefill at every position, then cached decode."""
    from checkpoints import hf_oracle

    from layer_boundary.models import load_model
    from layer_boundary.models.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(folder, "transformers")
    assert checkpoint.impl == "transformers"
    ours = load_model(checkpoint, world1())
    ref = hf_oracle(model_class, folder)
    assert_prefill_matches(ours, ref, prompts)
    assert_decode_matches(ours, ref, prompts, steps)
