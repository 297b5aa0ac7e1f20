"""Greedy generation with a KV cache: one prefill of all requests, then decode steps.

Requests are spread over attention-DP ranks (request i on DP rank i mod dp); each rank runs
its own requests, and every rank knows every DP rank's token count for the boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.forward_batch import ForwardBatch, ForwardMode


@dataclass
class Generation:
    request_ids: list[int]  # indices of this rank's requests in the global prompt list
    generated: list[list[int]]
    logits: list[list[torch.Tensor]]  # per request, per step: [vocab] fp32 logits of its last position


def requests_of(dp_rank: int, dp: int, n: int) -> list[int]:
    return [i for i in range(n) if i % dp == dp_rank]


@torch.no_grad()
def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, *, dp: int = 1,
                    dp_rank: int = 0, keep_logits: bool = True, on_step=None) -> Generation:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
    mine = requests_of(dp_rank, dp, len(prompts))
    cache = model.make_kv_cache(max(1, len(mine)), max(len(p) for p in prompts) + max_new_tokens)
    new_tokens = [list(prompts[i]) for i in mine]
    prefix = [0] * len(mine)
    counts_of = lambda step: tuple(  # noqa: E731 - every DP rank's tokens this step
        sum(len(prompts[i]) if step == 0 else 1 for i in requests_of(r, dp, len(prompts)))
        for r in range(dp))
    generated = [[] for _ in mine]
    logits_out = [[] for _ in mine]
    for step in range(max_new_tokens):
        if on_step is not None:
            on_step(step)
        mode = ForwardMode.EXTEND if step == 0 else ForwardMode.DECODE
        batch = ForwardBatch.build(mode, new_tokens, prefix, dp_token_counts=counts_of(step),
                                   kv_cache=cache, device=model.lm_head.weight.device)
        logits = model(batch)  # [T, vocab]
        last = torch.tensor(batch.extend_lens, dtype=torch.long).cumsum(0) - 1
        picked = logits[last].float()
        for j in range(len(mine)):
            token = int(picked[j].argmax())
            generated[j].append(token)
            if keep_logits:
                logits_out[j].append(picked[j].clone())
        prefix = [p + len(t) for p, t in zip(prefix, new_tokens)]
        new_tokens = [[g[-1]] for g in generated]
    return Generation(mine, generated, logits_out)
