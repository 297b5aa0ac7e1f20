"""A minimal continuous-batching engine over layer_boundary's public API.

Requests arrive and leave between forwards. Each step the engine builds one ``ForwardBatch``
holding every running request's next token and every arriving request's whole prompt (a
mixed batch: ``extend_lens`` says how many tokens each request brings), runs the model,
samples greedily from each request's last row, and frees the KV-cache slot of every request
that is done. The cache is a slot cache: a request owns one slot (its rows are its positions)
from arrival to departure, and a new request reuses a freed slot.

    python examples/engine_loop.py [--model DIR] [--tp N]

prints each request's tokens; at ``--tp N`` the ranks are spawned gloo processes that run the
same schedule (tensor parallelism without attention DP: every rank sees every request). The
numbers are checked in ``tests/examples/test_engine_loop.py``: each request's tokens and
logits equal what ``greedy_generate`` gives it alone.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from layer_boundary.models import boundary_reduction, load_model
from layer_boundary.runtime import (BoundaryRuntime, ForwardBatch, ForwardMode, ParallelDims,
                                    build_parallel)


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    slot: int = -1
    cached: int = 0  # tokens in its KV-cache slot
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    def next_tokens(self) -> list[int]:
        """What this request brings to the next forward: its prompt, then its last token."""
        return self.prompt if not self.generated else self.generated[-1:]

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new_tokens


class Engine:
    """Slots, a waiting queue and the running set around one model."""

    def __init__(self, model, slots: int, max_len: int) -> None:
        self.model, self.cache = model, model.make_kv_cache(slots, max_len)
        self.free = list(range(slots))
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}

    def admit(self, request: Request) -> None:
        request.slot = self.free.pop(0)  # a freed slot's old rows are overwritten in order
        self.running.append(request)

    @torch.no_grad()
    def step(self) -> None:
        """One forward over every running request."""
        batch = self.running
        tokens = [r.next_tokens() for r in batch]
        mode = (ForwardMode.DECODE if all(len(t) == 1 and r.generated
                                          for r, t in zip(batch, tokens))
                else ForwardMode.EXTEND)
        fb = ForwardBatch.build(mode, tokens, [r.cached for r in batch],
                                req_slots=[r.slot for r in batch], kv_cache=self.cache,
                                device=self.model.device)
        logits = self.model(fb)  # [T, vocab] on this rank's rows (every token here)
        ends = torch.tensor(fb.extend_lens).cumsum(0) - 1  # each request's last row
        for r, t, row in zip(batch, tokens, logits[ends].float()):
            r.cached += len(t)
            r.logits.append(row.clone())
            r.generated.append(int(row.argmax()))
        for r in [r for r in batch if r.done]:  # leave between forwards
            self.running.remove(r)
            self.free.append(r.slot)
            self.finished[r.rid] = r


def serve(model, schedule: dict[int, list[Request]], slots: int, max_len: int) -> dict:
    """Run ``schedule`` (step -> requests arriving before that step's forward) to the end;
    returns request id -> Request. A request waits while every slot is taken."""
    engine, waiting, step = Engine(model, slots, max_len), [], 0
    last = max(schedule)
    while step <= last or waiting or engine.running:
        waiting += schedule.get(step, [])
        while waiting and engine.free:
            engine.admit(waiting.pop(0))
        if engine.running:
            engine.step()
        step += 1
    return engine.finished


def demo_schedule(vocab: int) -> dict[int, list[Request]]:
    """Five requests over four slots: two at once, one mid-decode, two later (one waits)."""
    def req(rid, length, new):
        return Request(rid, [(7 * rid + 3 * i + 1) % vocab for i in range(length)], new)
    return {0: [req(0, 5, 6), req(1, 3, 3)], 2: [req(2, 7, 4)], 4: [req(3, 2, 5), req(4, 4, 2),
                                                                      req(5, 6, 3)]}


def run_rank(model_dir: str, tp: int, slots: int = 4, max_len: int = 32) -> dict:
    """This rank's engine over ``demo_schedule``: request id -> (tokens, logits)."""
    # auto: the checkpoint's architecture's policy (its model class declares it), chosen
    # per batch
    policy = boundary_reduction("auto", model_dir)
    runtime = BoundaryRuntime(build_parallel(ParallelDims(world_size=tp, tp=tp)),
                              boundary_reduction=policy, choose_by_bytes=True)
    model = load_model(model_dir, runtime)
    finished = serve(model, demo_schedule(model.config.vocab_size), slots, max_len)
    return {rid: (r.generated, r.logits) for rid, r in sorted(finished.items())}


def main() -> None:
    from layer_boundary.models.tiny import builtin_checkpoint
    from layer_boundary.runtime import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a checkpoint (default: the built-in tiny Qwen3)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    args = parser.parse_args()
    model_dir = args.model or str(builtin_checkpoint())
    out = (run_rank(model_dir, 1) if args.tp == 1
           else spawn(run_rank, args.tp, model_dir, args.tp)[0])
    for rid, (tokens, _) in out.items():
        print(f"request {rid}: {tokens}")


if __name__ == "__main__":
    main()
