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

from ..capabilities import Feature, check_invariant
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
    check_invariant(None, (Feature.SPECULATIVE,))  # refused in the batch-invariant mode
    # a proposal past the tokens a request emits is never used, and each one is a draft
    # forward and a cache row: 100,000 steps for 4 tokens would run for ever
    steps = min(steps, max_new_tokens)
    run = _Speculation(target, draft, prompts, max_new_tokens, steps,
                       _Agreement(parallel, target.device), requests_of(dp_rank, dp, len(prompts)),
                       adapters, variants)
    if on_step is not None:
        on_step(0)
    run.prefill()
    step = 1
    while run.agree.any(run.unfinished()):
        if on_step is not None:
            on_step(step)
        step += 1
        run.round()
    return run.result()


class _Speculation:
    """This rank's requests through the rounds: both caches, what each request has emitted,
    and how far each cache holds its tokens. Every method runs the same forwards and
    collectives on every rank."""

    def __init__(self, target, draft, prompts, max_new_tokens: int, steps: int, agree, mine,
                 adapters, variants) -> None:
        self.target, self.draft, self.agree = target, draft, agree
        self.max_new_tokens, self.steps, self.variants = max_new_tokens, steps, variants
        self.mine, n = mine, len(mine)
        # the target's adapter slot of each of this rank's requests, by its cache slot
        self.adapters = None if adapters is None else [adapters[i] for i in mine]
        room = max(len(p) for p in prompts) + max_new_tokens + steps + 1
        self.t_cache = target.make_kv_cache(max(1, n), room)
        self.d_cache = draft.make_kv_cache(max(1, n), room)
        self.context = [list(prompts[i]) for i in mine]
        self.emitted = [[] for _ in mine]
        self.logits = [[] for _ in mine]
        self.stats = SpeculativeStats()
        # a NextN draft reads the target's hidden state before each of its tokens
        self.nextn = getattr(draft, "needs_target_hidden", False)
        self.target_hidden = [[] for _ in mine]  # per request: the target's, by position
        self.t_len: list[int] = []  # tokens in the target's cache, per request
        self.d_len: list[int] = []  # tokens in the draft's cache, per request

    def _target_forward(self, new, prefix, slots, variant, hidden=False):
        return _forward(self.target, self.agree, ForwardMode.EXTEND, new, prefix, slots,
                        self.t_cache, hidden=hidden, adapters=self.adapters, variant=variant)

    def _keep_hidden(self, j: int, rows) -> None:
        if self.nextn:
            self.target_hidden[j].extend(rows)

    def _draft_forward(self, active, new, prefix, last_hidden):
        """The draft over ``new`` tokens per request: (logits, its own hidden states)."""
        if not self.nextn:
            return _forward(self.draft, self.agree, ForwardMode.EXTEND, new, prefix, active,
                            self.d_cache)
        rows = []  # the token at position q pairs with the hidden state at q - 1: the
        for j, toks, p in zip(active, new, prefix):  # target's where known, else the draft's
            known = self.target_hidden[j]
            rows += [known[q - 1] if q - 1 < len(known) else last_hidden[j]
                     for q in range(p, p + len(toks))]
        prev = (torch.stack(rows) if rows
                else torch.zeros((0, self.draft.config.hidden_size), dtype=self.draft.dtype))
        return _forward(self.draft, self.agree, ForwardMode.EXTEND, new, prefix, active,
                        self.d_cache, prev=prev)

    def prefill(self) -> None:
        """Both stacks over the prompts; the target's first token is emitted."""
        context, n = self.context, len(self.context)
        slots = list(range(n))
        out, hidden = self._target_forward(context, [0] * n, slots, self.variants[0],
                                           hidden=self.nextn)
        start = 0
        for j, end in enumerate(_ends(context)):
            self.emitted[j].append(int(out[end].argmax()))
            self.logits[j].append(out[end].float().clone())
            self._keep_hidden(j, list(hidden[start:end + 1]) if self.nextn else [])
            start = end + 1
        self.t_len = [len(c) for c in context]
        if self.nextn:  # no hidden state precedes position 0: the draft starts at position 1
            self._draft_forward(slots, [c[1:] for c in context], [1] * n, {})
        else:
            _forward(self.draft, self.agree, ForwardMode.EXTEND, context, [0] * n, slots,
                     self.d_cache)
        self.d_len = [len(c) for c in context]

    def unfinished(self) -> bool:
        return any(len(e) < self.max_new_tokens for e in self.emitted)

    def round(self) -> None:
        """Draft, verify, accept the confirmed prefix, and rebuild a folding cache that took
        rejected tokens."""
        active = [j for j in range(len(self.mine)) if len(self.emitted[j]) < self.max_new_tokens]
        seq = {j: self.context[j] + self.emitted[j] for j in active}
        proposal = self._propose(active, seq)
        saved = self.t_cache.snapshot()
        verify = [seq[j][self.t_len[j]:] + proposal[j] for j in active]
        out, hidden = self._target_forward(verify, [self.t_len[j] for j in active], active,
                                           self.variants[1], hidden=self.nextn)
        self.stats.target_forwards += 1
        self.stats.request_rounds += len(active)
        start, accepted = 0, {}
        for j, toks in zip(active, verify):
            rows = slice(start, start + len(toks))
            accepted[j] = self._accept(j, toks, out[rows], hidden[rows] if self.nextn else None,
                                       len(seq[j]), proposal[j])
            start += len(toks)
        self.stats.per_round.append(dict(accepted))
        self._rollback(saved, active, verify, accepted)

    def _propose(self, active, seq) -> dict:
        """``steps`` draft tokens per active request: the draft catches up on the tokens it
        has not seen, then proposes one token a forward."""
        proposal = {j: [] for j in active}
        last_hidden = {}
        for _ in range(self.steps):
            new = [(seq[j] + proposal[j])[self.d_len[j]:] for j in active]
            out, hid = self._draft_forward(active, new, [self.d_len[j] for j in active],
                                           last_hidden)
            for j, end, toks in zip(active, _ends(new), new):
                self.d_len[j] += len(toks)
                proposal[j].append(int(out[end].argmax()))
                if self.nextn:
                    last_hidden[j] = hid[end]
        return proposal

    def _accept(self, j: int, toks, rows, hidden, seq_len: int, proposal) -> int:
        """Request ``j``'s verified tokens: the longest prefix of ``proposal`` the target's
        own argmax confirms, and the target's token after it, emitted; the count accepted.
        ``rows``: the target's logits at ``toks``' positions (``hidden``: its hidden states
        there, NextN only)."""
        steps = self.steps
        first = len(toks) - steps - 1  # rows before the proposals' predictors
        choice = rows[first:].argmax(-1).tolist()  # steps + 1 greedy tokens
        a = 0
        while a < steps and choice[a] == proposal[a]:
            a += 1
        if self.nextn:  # the committed positions' hidden states
            self._keep_hidden(j, list(hidden[:first + a + 1]))
        for i in range(a + 1):
            self.emitted[j].append(choice[i])
            self.logits[j].append(rows[first + i].float().clone())
        self.stats.proposed += steps
        self.stats.accepted += a
        self.stats.emitted += a + 1
        self.t_len[j] += len(toks) - steps + a  # what precedes the proposals, then the accepted
        self.d_len[j] = min(self.d_len[j], seq_len + a)  # the draft's entries that stay true
        return a

    def _rollback(self, saved, active, verify, accepted) -> None:
        """A positional cache's rejected rows are overwritten later; a cache that folded
        them in goes back to ``saved`` and takes the accepted tokens again."""
        rejected = any(accepted[j] < self.steps for j in active)
        if self.t_cache.positional or not self.agree.any(rejected):
            return
        self.t_cache.restore(saved)
        again = [toks[:len(toks) - self.steps + accepted[j]] for j, toks in zip(active, verify)]
        self._target_forward(again, [self.t_len[j] - len(t) for j, t in zip(active, again)],
                             active, self.variants[1])
        self.stats.reruns += 1

    def result(self) -> tuple[Generation, SpeculativeStats]:
        n = self.max_new_tokens
        return (Generation(self.mine, [e[:n] for e in self.emitted],
                           [lg[:n] for lg in self.logits]), self.stats)
