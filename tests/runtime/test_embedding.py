"""Vocabulary-parallel embedding and LM head with a vocabulary the group does not divide."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed.pool import get_pool
from layer_boundary.runtime.embedding import ParallelLMHead, VocabParallelEmbedding
from layer_boundary.runtime.ledger import LEDGER
from layer_boundary.runtime.parallel import ParallelDims, build_parallel

VOCAB, HIDDEN = 97, 8
TOL = dict(rtol=1e-5, atol=1e-5)


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    head = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    # every id once (so every shard boundary and the last, short shard), then repeats, as [2, T]
    ids = torch.cat([torch.randperm(VOCAB, generator=g), torch.tensor([0, VOCAB - 1, 0, 48, 49]),
                     torch.randint(0, VOCAB, (6,), generator=g)]).view(2, -1)
    hidden = torch.randn(2, 7, HIDDEN, generator=g, dtype=torch.float64)
    return embed, head, ids, hidden


def _vocab_parallel(embed, head, ids, hidden, tie):
    n = dist.get_world_size()
    group = build_parallel(ParallelDims(world_size=n, tp=n)).tp_group
    emb = VocabParallelEmbedding(VOCAB, HIDDEN, group, dtype=embed.dtype)
    emb.weight.weight_loader(emb.weight, embed)
    lm = ParallelLMHead(VOCAB, HIDDEN, group, dtype=embed.dtype)
    if tie:
        lm.tie(emb)
    else:
        lm.weight.weight_loader(lm.weight, head)
    with LEDGER.recording() as entries:
        out = emb(ids)
        logits = lm(hidden)
    weight = emb.weight.detach().clone()  # the shard itself: a Parameter would drag its loader
    return out, logits, [(e.kind, e.group, e.group_size, e.site) for e in entries], weight


def _check(results, embed, head, ids, hidden, n):
    dense_out = F.embedding(ids, embed)
    dense_logits = hidden @ head.T
    for r, (out, logits, entries, _) in enumerate(results):
        assert out.shape == (*ids.shape, HIDDEN)
        torch.testing.assert_close(out, dense_out, **TOL, msg=lambda m: f"rank {r} embed: {m}")
        assert logits.shape == (*hidden.shape[:-1], VOCAB)
        torch.testing.assert_close(logits, dense_logits, **TOL,
                                   msg=lambda m: f"rank {r} logits: {m}")
        if n > 1:
            assert entries == [("all_reduce", "tp", n, "embed"), ("all_gather", "tp", n, "lm_head")]
        else:
            assert entries == []


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_vocab_parallel_matches_dense(tp, tie):
    embed, head, ids, hidden = _data(tp)
    results = get_pool(tp).run(_vocab_parallel, embed, head, ids, hidden, tie)
    _check(results, embed, embed if tie else head, ids, hidden, tp)

    # The module's stated layout: vocab padded to a multiple of the group size, split in
    # contiguous ranges in rank order, padded rows zero.
    padded = -(-VOCAB // tp) * tp
    want = torch.cat([embed, embed.new_zeros(padded - VOCAB, HIDDEN)])
    assert torch.equal(torch.cat([weight for *_, weight in results]), want)


def _vocab_parallel_local(embed, head, ids, hidden):
    group = build_parallel(ParallelDims()).tp_group
    emb = VocabParallelEmbedding(VOCAB, HIDDEN, group, dtype=embed.dtype)
    emb.weight.weight_loader(emb.weight, embed)
    lm = ParallelLMHead(VOCAB, HIDDEN, group, dtype=embed.dtype)
    lm.weight.weight_loader(lm.weight, head)
    with LEDGER.recording() as entries:
        out, logits = emb(ids), lm(hidden)
    weight = emb.weight.detach().clone()  # the shard itself: a Parameter would drag its loader
    return out, logits, [(e.kind, e.group, e.group_size, e.site) for e in entries], weight


def test_world1_matches_dense():
    embed, head, ids, hidden = _data(1)
    results = [_vocab_parallel_local(embed, head, ids, hidden)]
    _check(results, embed, head, ids, hidden, 1)


def test_loader_rejects_a_weight_of_the_wrong_vocab():
    group = build_parallel(ParallelDims()).tp_group
    emb = VocabParallelEmbedding(VOCAB, HIDDEN, group)
    for wrong in ((VOCAB + 1, HIDDEN), (VOCAB, HIDDEN + 1)):
        with pytest.raises(RuntimeError, match=f"expected the full shape \\({VOCAB}, {HIDDEN}\\)"):
            emb.weight.weight_loader(emb.weight, torch.zeros(*wrong))


@pytest.mark.parametrize("vocab, n", [(5, 4), (9, 8)])
def test_shards_cover_a_vocabulary_smaller_than_the_padding(vocab, n):
    # construction and loading only: no collective runs, so fake multi-rank groups will do
    from layer_boundary.runtime.parallel import Group

    weight = torch.randn(vocab, HIDDEN, dtype=torch.float64)
    shards = []
    for rank in range(n):
        emb = VocabParallelEmbedding(vocab, HIDDEN, Group("tp", tuple(range(n)), rank),
                                     dtype=weight.dtype)
        emb.weight.weight_loader(emb.weight, weight)
        shards.append(emb.weight.detach())
    padded = -(-vocab // n) * n
    assert torch.equal(torch.cat(shards), torch.cat([weight, weight.new_zeros(padded - vocab,
                                                                                HIDDEN)]))
