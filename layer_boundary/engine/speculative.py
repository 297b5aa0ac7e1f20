"""Greedy speculative decoding: a draft stack proposes, the target verifies, the output is the
target's own greedy decoding.

Each round the draft runs ``steps`` single-token forwards per request (after catching up on the
tokens it has not seen), proposing ``steps`` tokens; the target runs one forward over the last
emitted token and the proposals (``steps + 1`` positions per request, through its cache). The
longest prefix of proposals equal to the target's own argmax is accepted, and the target's
token after it is emitted too, so every emitted token is the target's greedy choice and its
logits are the target's at that position. Rejected positions leave the caches: a positional
KV cache is simply overwritten later; a cache whose entries fold in every token (a sliding
window ring, Mamba states) is restored to its state before the round and the accepted tokens
are run again. All ranks take every forward together (a rank without active requests runs an
empty one), agreeing on DP token counts, reruns and the end with small collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..runtime.collectives import all_reduce_rows, gather_rows
from ..runtime.forward_batch import BatchVariant, ForwardBatch, ForwardMode
from ..runtime.ledger import active_observer
from .generate import Generation, requests_of


@dataclass
class SpeculativeStats:
    proposed: int = 0  # draft tokens proposed to the target
    accepted: int = 0  # of those, the ones the target's greedy choice confirmed
    target_forwards: int = 0  # verification forwards (the prefill not counted)
    emitted: int = 0  # tokens emitted by verification forwards
    reruns: int = 0  # forwards that rebuilt a folding cache after a rejection
    request_rounds: int = 0  # (request, verification forward) pairs
    per_round: list = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class _Agreement:
    """The collectives that keep every rank on the same forward (none at world 1)."""

    def __init__(self, parallel, device) -> None:
        self.parallel, self.device = parallel, device  # NCCL sums tensors on the GPU

    @staticmethod
    def _site() -> None:
        observer = active_observer()
        if observer is not None:
            observer.enter("speculative.agree")

    def dp_counts(self, tokens: int) -> tuple[int, ...]:
        self._site()
        group = self.parallel.attn_dp_group
        mine = torch.tensor([tokens], dtype=torch.long, device=self.device)
        return tuple(gather_rows(mine, group).tolist()) if group.size > 1 else (tokens,)

    def any(self, flag: bool) -> bool:
        self._site()
        group = self.parallel.tp_group
        x = torch.tensor([int(flag)], dtype=torch.long, device=self.device)
        return bool(all_reduce_rows(x, group).item()) if group.size > 1 else flag


def _forward(model, agree, mode, requests, prefix, slots, cache, hidden=False, prev=None,
             adapters=None, variant=BatchVariant.ORDINARY):
    """One forward of ``requests`` (new tokens per active request): [T, vocab] logits, and
    with ``hidden`` the final norm's output [T, H] too. ``prev``: a NextN draft's previous
    hidden state for every token. ``adapters``: each active request's LoRA adapter slot, by
    its cache slot (None: the base model). ``variant``: the batch variant it runs as."""
    counts = agree.dp_counts(sum(map(len, requests)))
    fb = ForwardBatch.build(mode, requests, prefix, dp_token_counts=counts, req_slots=slots,
                            kv_cache=cache, device=model.device)
    fb.variant = variant
    if adapters is not None:  # each token runs its request's adapter
        fb.lora_ids = torch.tensor([adapters[j] for j, toks in zip(slots, requests)
                                    for _ in toks], dtype=torch.long, device=model.device)
    if prev is not None:
        return model(fb, prev)
    if hidden:
        return model(fb, return_hidden=True)
    return model(fb), None


def _ends(requests) -> list[int]:
    out, total = [], 0
    for r in requests:
        total += len(r)
        out.append(total - 1)
    return out


@torch.no_grad()
def speculative_generate(target, draft, prompts: list[list[int]], max_new_tokens: int,
                         steps: int, *, parallel, dp: int = 1, dp_rank: int = 0,
                         on_step=None, adapters=None,
                         variants: tuple = (BatchVariant.ORDINARY, BatchVariant.ORDINARY)
                         ) -> tuple[Generation, SpeculativeStats]:
    """The target's greedy tokens (and each step's logits) of this rank's requests, drafted.

    Args:
        target, draft: the two stacks' models on the same ranks.
        prompts: every request's prompt ids (request i on DP rank i mod dp).
        max_new_tokens: tokens to emit per request.
        steps: draft tokens proposed per round.
        parallel: the ranks' groups (the agreement collectives run over them).
        dp, dp_rank: attention DP.
        on_step: called with the round index before each round.
        adapters: each request's LoRA adapter slot on the target (-1: the base model), or
            None. Every target forward runs them, so the output is the adapted target's
            greedy decoding; the draft proposes with its own weights.
        variants: the batch variant of the target's prefill and of its later forwards (a
            sequence-parallel prefill, input-scattered forwards); the draft's forwards are
            ordinary (its runtime serves those).
    """
    if steps < 1:
        raise ValueError(f"--speculative-steps must be at least 1, got {steps}")
    # a proposal past the tokens a request emits is never used, and each one is a draft
    # forward and a cache row: 100,000 steps for 4 tokens would run for ever
    steps = min(steps, max_new_tokens)
    agree = _Agreement(parallel, target.device)
    mine = requests_of(dp_rank, dp, len(prompts))
    n = len(mine)
    # the target's adapter slot of each of this rank's requests, by its cache slot
    mine_adapters = None if adapters is None else [adapters[i] for i in mine]
    room = max(len(p) for p in prompts) + max_new_tokens + steps + 1
    t_cache, d_cache = target.make_kv_cache(max(1, n), room), draft.make_kv_cache(max(1, n), room)
    context = [list(prompts[i]) for i in mine]
    emitted = [[] for _ in mine]
    logits = [[] for _ in mine]
    stats = SpeculativeStats()
    step = 0

    def log_step():
        nonlocal step
        if on_step is not None:
            on_step(step)
        step += 1

    # a NextN draft reads the target's hidden state before each of its tokens
    nextn = getattr(draft, "needs_target_hidden", False)
    target_hidden = [[] for _ in mine]  # per request: the target's hidden state by position

    def keep_hidden(j, rows) -> None:
        if nextn:
            target_hidden[j].extend(rows)

    def draft_forward(active, new, prefix, last_hidden):
        """The draft over ``new`` tokens per request: (logits, its own hidden states)."""
        if not nextn:
            return _forward(draft, agree, ForwardMode.EXTEND, new, prefix, active, d_cache)
        rows = []  # the token at position q pairs with the hidden state at q - 1: the
        for j, toks, p in zip(active, new, prefix):  # target's where known, else the draft's
            known = target_hidden[j]
            rows += [known[q - 1] if q - 1 < len(known) else last_hidden[j]
                     for q in range(p, p + len(toks))]
        prev = (torch.stack(rows) if rows
                else torch.zeros((0, draft.config.hidden_size), dtype=draft.dtype))
        return _forward(draft, agree, ForwardMode.EXTEND, new, prefix, active, d_cache,
                        prev=prev)

    # prefill both stacks; the target's first token is emitted
    log_step()
    slots = list(range(n))
    out, hidden = _forward(target, agree, ForwardMode.EXTEND, context, [0] * n, slots, t_cache,
                           hidden=nextn, adapters=mine_adapters, variant=variants[0])
    start = 0
    for j, end in enumerate(_ends(context)):
        emitted[j].append(int(out[end].argmax()))
        logits[j].append(out[end].float().clone())
        keep_hidden(j, list(hidden[start:end + 1]) if nextn else [])
        start = end + 1
    t_len = [len(c) for c in context]  # tokens in the target's cache
    if nextn:  # no hidden state precedes position 0: the draft starts at position 1
        draft_forward(slots, [c[1:] for c in context], [1] * n, {})
        d_len = [len(c) for c in context]
    else:
        _forward(draft, agree, ForwardMode.EXTEND, context, [0] * n, slots, d_cache)
        d_len = [len(c) for c in context]  # tokens in the draft's cache

    while agree.any(any(len(e) < max_new_tokens for e in emitted)):
        log_step()
        active = [j for j in range(n) if len(emitted[j]) < max_new_tokens]
        seq = {j: context[j] + emitted[j] for j in active}
        proposal = {j: [] for j in active}
        last_hidden = {}
        for _ in range(steps):  # the draft: catch up, then one proposal per forward
            new = [(seq[j] + proposal[j])[d_len[j]:] for j in active]
            out, hid = draft_forward(active, new, [d_len[j] for j in active], last_hidden)
            for j, end, toks in zip(active, _ends(new), new):
                d_len[j] += len(toks)
                proposal[j].append(int(out[end].argmax()))
                if nextn:
                    last_hidden[j] = hid[end]
        saved = t_cache.snapshot()
        verify = [seq[j][t_len[j]:] + proposal[j] for j in active]
        out, hidden = _forward(target, agree, ForwardMode.EXTEND, verify,
                               [t_len[j] for j in active], active, t_cache, hidden=nextn,
                               adapters=mine_adapters, variant=variants[1])
        stats.target_forwards += 1
        stats.request_rounds += len(active)
        start, accepted = 0, {}
        for j, toks in zip(active, verify):
            rows = out[start:start + len(toks)]  # the target's logits at these positions
            first = len(toks) - steps - 1  # rows before the proposals' predictors
            choice = rows[first:].argmax(-1).tolist()  # steps + 1 greedy tokens
            a = 0
            while a < steps and choice[a] == proposal[j][a]:
                a += 1
            accepted[j] = a
            if nextn:  # the committed positions' hidden states
                keep_hidden(j, list(hidden[start:start + first + a + 1]))
            start += len(toks)
            for i in range(a + 1):
                emitted[j].append(choice[i])
                logits[j].append(rows[first + i].float().clone())
            stats.proposed += steps
            stats.accepted += a
            stats.emitted += a + 1
            t_len[j] += len(toks) - steps + a  # what precedes the proposals, then the accepted
            d_len[j] = min(d_len[j], len(seq[j]) + a)  # the draft's entries that stay true
        stats.per_round.append(dict(accepted))
        rejected = any(accepted[j] < steps for j in active)
        if not t_cache.positional and agree.any(rejected):
            # the cache folded the rejected tokens in: back to before the round, and again
            t_cache.restore(saved)
            again = [toks[:len(toks) - steps + accepted[j]] for j, toks in zip(active, verify)]
            _forward(target, agree, ForwardMode.EXTEND, again,
                     [t_len[j] - len(t) for j, t in zip(active, again)], active, t_cache,
                     adapters=mine_adapters, variant=variants[1])
            stats.reruns += 1
    generated = [e[:max_new_tokens] for e in emitted]
    return Generation(mine, generated, [lg[:max_new_tokens] for lg in logits]), stats
